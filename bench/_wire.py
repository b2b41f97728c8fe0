"""Count the collectives a block of code issues, and the bytes each rank receives, for either library.

shardwise reports its own traffic (`shardwise.comm_log()`); torch's DTensor does not, so we
watch the dispatcher instead. Every collective torch.distributed issues, the eager ones
(`dist.all_gather_into_tensor` -> `c10d::_allgather_base_`) and the functional ones
DTensor uses (`_c10d_functional::all_gather_into_tensor`), is an operator there, and a
`TorchDispatchMode` sees each call with its tensors and process group. The same spy runs
on shardwise too, so the suite can check the spy against `comm_log()` before trusting it.

Bytes received per rank follow the cost model of `shardwise._comm` (one number per
collective, the same for every implementation of it):

| collective | bytes received per rank |
|---|---|
| all_gather | (n-1) x input |
| reduce_scatter | (n-1) x output |
| all_reduce | 2(n-1)/n x tensor (ring) |
| all_to_all | output - the piece this rank keeps |
| broadcast | tensor, on every rank but the root |
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collective", "WireSpy", "classify", "summary", "SHORT"]

# Dispatcher ops in these namespaces that move no data.
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "check_for_nan"}

SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A", "broadcast": "BC"}


@dataclass(frozen=True)
class Collective:
    """One collective as this rank saw it: kind (a key of SHORT, or the raw op name), group size, bytes in."""

    kind: str
    group_size: int
    bytes_received: Optional[int]  # None: an op this model does not know (shown as '?', never dropped)


def _group(value: Any) -> Any:
    """The ProcessGroup behind a c10d op's boxed group or a functional op's group name."""
    if isinstance(value, dist.ProcessGroup):
        return value
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value)
    from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]

    return _resolve_process_group(value)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _all_to_all(output_bytes: int, output_rows: int, splits: Any, n: int, me: int) -> int:
    if splits and len(splits) == n and output_rows:
        return output_bytes - output_bytes * int(splits[me]) // output_rows
    return output_bytes - output_bytes // n


def classify(op: str, a: dict[str, Any]) -> Optional[Collective]:
    """The collective one dispatcher call is (None for ops that move nothing); `a`: arguments by schema name."""
    if op in _NOT_COLLECTIVES:
        return None
    pg = a.get("process_group", a.get("group_name"))
    group = _group(pg) if pg is not None else None
    n = int(a.get("group_size") or (group.size() if group is not None else 1))
    me = group.rank() if group is not None else 0
    if op in ("_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
        inputs = _tensors(a.get("input_tensor", a.get("input_tensors", a.get("input_list", a.get("inputs")))))
        return Collective("all_gather", n, (n - 1) * sum(map(_nbytes, inputs)))
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        return Collective("all_gather", n, (n - 1) * sum(map(_nbytes, _tensors(a.get("input", a.get("inputs"))))))
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        outputs = _tensors(a.get("output_tensor", a.get("output_tensors", a.get("outputs"))))
        return Collective("reduce_scatter", n, (n - 1) * sum(map(_nbytes, outputs)))
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"):
        inputs = _tensors(a.get("input", a.get("inputs")))
        return Collective("reduce_scatter", n, (n - 1) * sum(map(_nbytes, inputs)) // n)
    if op in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
              "all_reduce_coalesced_"):
        tensors = _tensors(a.get("tensors", a.get("input", a.get("inputs"))))
        return Collective("all_reduce", n, sum(int(2 * (n - 1) / n * _nbytes(t)) for t in tensors))
    if op == "alltoall_base_":
        out = a["output"]
        return Collective("all_to_all", n, _all_to_all(_nbytes(out), out.size(0) if out.dim() else 0,
                                                        a.get("output_split_sizes"), n, me))
    if op == "all_to_all_single":
        inp = a["input"]
        splits = a.get("output_split_sizes")
        row = _nbytes(inp) // inp.size(0) if inp.dim() and inp.size(0) else 0
        total = row * sum(int(s) for s in splits) if splits else _nbytes(inp)
        rows = sum(int(s) for s in splits) if splits else (inp.size(0) if inp.dim() else 0)
        return Collective("all_to_all", n, _all_to_all(total, rows, splits, n, me))
    if op == "alltoall_":
        outs = _tensors(a.get("output_tensors"))
        return Collective("all_to_all", n, sum(map(_nbytes, outs)) - (_nbytes(outs[me]) if len(outs) > me else 0))
    if op == "broadcast_" and "tensors" in a:  # c10d's; the functional broadcast_ has `input`
        root = int(a.get("root_rank", 0))
        return Collective("broadcast", n, 0 if me == root else sum(map(_nbytes, _tensors(a.get("tensors")))))
    if op in ("broadcast", "broadcast_"):
        return Collective("broadcast", n, 0 if me == int(a.get("src", 0)) else _nbytes(a["input"]))
    return Collective(op, n, None)


class WireSpy(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every collective issued under it: `with WireSpy() as spy: ...; spy.records`."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ns, _, op = func._schema.name.partition("::")
        if ns in ("c10d", "_c10d_functional"):
            named = {arg.name: v for arg, v in zip(func._schema.arguments, args)}
            named.update(kwargs)
            found = classify(op, named)
            if found is not None:
                self.records.append(found)
        return func(*args, **kwargs)


def summary(records: list[Any]) -> tuple[Optional[int], str]:
    """(total bytes received, or None if any is unknown; a short '2xAG+A2A' string of the kinds)."""
    kinds = Counter(str(getattr(r, "kind", None) or getattr(r, "op", "?")) for r in records)
    text = "+".join(f"{c}x{SHORT.get(k, k)}" if c > 1 else SHORT.get(k, k) for k, c in kinds.items()) or "none"
    sizes = [r.bytes_received for r in records]
    return (None if any(s is None for s in sizes) else sum(sizes)), text
