"""A torch program's `torch.distributed.tensor.parallel.loss_parallel()` around shardwise DTensors.

torch's context manager turns on loss parallelism for torch's own DTensor only (it installs
handlers in torch's dispatcher). A program ported by changing its imports but still calling
it by the full path would run shardwise's log_softmax / nll_loss without loss parallelism:
right values, but the logits gathered whole, silently. The first such op warns, once per
process, naming `shardwise.parallel.loss_parallel()`. torch's module is only looked at
where the program imported it; shardwise never imports it.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

import torch

__all__ = ["warn_if_torch_loss_parallel"]

_NLL = torch.ops.aten.nll_loss_forward.default


def warn_if_torch_loss_parallel(func: Any) -> None:
    """Warn (once) when torch's loss_parallel() is on while `func`, a loss op, runs on shardwise DTensors."""
    torch_tensor = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(torch_tensor, "DTensor", None)
    handlers = getattr(getattr(dtensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if isinstance(handlers, dict) and _NLL in handlers:
        _warn(str(func))


@functools.lru_cache(maxsize=None)
def _warn(op: str) -> None:
    del op  # one warning per process: every loss op would say the same
    warnings.warn(
        "torch.distributed.tensor.parallel.loss_parallel() is on, but it parallelizes the loss of torch's DTensor "
        "only: these are shardwise DTensors, whose logits are being gathered whole for the loss. Use "
        "shardwise.parallel.loss_parallel() instead (same call, same semantics)",
        UserWarning,
        stacklevel=3,
    )
