"""torch's private APIs that shardwise relies on and that differ between the torch versions it
supports (pyproject's range, `torch>=2.11,<2.14`): each is reached through one name here, so a
new torch release is checked, and adapted, in one place. `tests/test_structure.py` pins that no
other module calls them.

- `resize_storage_bytes_`: `fully_shard` frees and re-makes a unit's gathered parameters by
  resizing their storage as a dispatched op (inductor registers it), so a trace records it;
- `nonstrict_trace`, `dynamo_disable`, `skip_code`: how `torch.compile` treats shardwise's own
  code (`_tensor/_traceable`); they import `torch._dynamo`, which costs seconds, so only call
  them once something else has imported it;
- `register_pytree_constant`: meshes as pytree constants (compared, never flattened);
- `new_group_in_order`: a process group whose ranks keep the order given (`new_group` sorts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from types import CodeType
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

__all__ = ["TORCH_VERSION", "dynamo_disable", "new_group_in_order", "nonstrict_trace", "register_pytree_constant",
           "resize_storage_bytes_", "skip_code"]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]

F = TypeVar("F", bound=Callable[..., Any])


def resize_storage_bytes_(t: torch.Tensor, nbytes: int) -> None:
    """Resize `t`'s storage to `nbytes` in place, as a dispatched op a tracer records."""
    torch.ops.inductor.resize_storage_bytes_(t, nbytes)


def nonstrict_trace(fn: F) -> F:
    """`fn` as one call dynamo records whole, AOTAutograd tracing inside it."""
    import torch._dynamo

    return torch._dynamo.nonstrict_trace(fn)  # type: ignore[return-value]


def dynamo_disable(fn: F) -> F:
    """`fn`, run eagerly when a compiled program calls it (dynamo breaks the graph there)."""
    import torch._dynamo

    return torch._dynamo.disable(fn)  # type: ignore[no-untyped-call,no-any-return]


def skip_code(code: CodeType) -> None:
    """Dynamo never starts a frame of `code` (it still inlines it from a compiled caller)."""
    from torch._dynamo.eval_frame import skip_code as skip

    skip(code)


def register_pytree_constant(cls: type) -> None:
    """Instances of `cls` are pytree constants: leaves compared by equality, never flattened."""
    import torch.utils._pytree as pytree

    pytree.register_constant(cls)


def new_group_in_order(ranks: Sequence[int], timeout: timedelta, backend: Optional[str]) -> Any:
    """A process group over `ranks` in the order given (collectives see the ranks in it)."""
    return dist.distributed_c10d._new_group_with_tag(list(ranks), timeout=timeout, backend=backend, sort_ranks=False)
