"""Following a dry run's memory: every storage an op makes, from that op to its death.

`MemoryTracker` is a dispatch mode: after each op that makes a new storage it looks for the
storages that died (a weak reference each; a parameter's piece cannot die in a step and is
not looked at) and then counts the new ones, so the running total is exact where the peak
can be (at a birth). At the end each storage is put in the category it ends in:
parameters, gradients, optimizer state, or activations (everything else, and whatever died).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils._python_dispatch import TorchDispatchMode

from .._tensor._wrap import DTENSOR_CLASSES
from ._report import CATEGORIES, MemoryReport

__all__ = ["MemoryTracker", "storage_of"]


def _weak(storage: Any) -> Any:
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


_expired = torch.UntypedStorage._expired  # whether a storage's weak reference outlived it


def storage_of(t: Any) -> Any:
    if type(t) in DTENSOR_CLASSES:
        t = t._local_tensor
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class MemoryTracker(TorchDispatchMode):
    """Follows every storage the ops make, from the op that makes it to its death."""

    def __init__(self, counter: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter
        self.clock = 0
        self.op: Optional[str] = None
        # storage key -> [weak ref, bytes, made at, module path]; closed: (key, bytes, made, died, path)
        self.live: dict[int, list[Any]] = {}
        self.watched: dict[int, int] = {}  # the live storages that may die: key -> weak reference
        self.closed: list[tuple[int, int, int, Optional[int], str]] = []
        self.uneven: set[str] = set()
        self._specs: set[Any] = set()
        self.flops = {"forward": 0, "backward": 0}  # of the matmuls, convolutions and attentions this rank runs

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        outer, self.op = self.op, str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.op = outer
        self.clock += 1
        count = _FLOPS.get(getattr(func, "overloadpacket", None))
        if count is not None:
            self.flops["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += _flops_of(
                count, args, kwargs or {}, out)
        made = [s for s in map(self._new, _outputs(out)) if s is not None]
        if made:  # the peak can only rise here: look for deaths first, then count the births
            self._sweep()
            for storage in made:
                self._add(storage, self.clock, pinned=False)
        return out

    def _new(self, t: Any) -> Any:
        """`t`'s storage if it is one not seen alive yet, else None."""
        if type(t) in DTENSOR_CLASSES:
            self._note_spec(t._spec)
        storage = storage_of(t)
        if storage is None:
            return None
        entry = self.live.get(storage._cdata)
        return storage if entry is None or _expired(entry[0].cdata) else None

    def track(self, t: Any, pinned: bool = False) -> None:
        """Count `t`'s storage as alive from the start (`pinned`: it cannot die in the step, a
        parameter's piece, so it is not looked at after every op)."""
        storage = self._new(t)
        if storage is not None:
            self._add(storage, 0, pinned)

    def _add(self, storage: Any, made: int, pinned: bool) -> None:
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None:
            if not _expired(entry[0].cdata):
                return
            self._end(key, entry)
        weak = _weak(storage)
        self.live[key] = [weak, storage.nbytes(), made, self.counter.module_path()]
        if not pinned:
            self.watched[key] = weak.cdata

    def _end(self, key: int, entry: list[Any], died: Optional[int] = None) -> None:
        del self.live[key]
        self.watched.pop(key, None)
        self.closed.append((key, entry[1], entry[2], self.clock if died is None else died, entry[3]))

    def _sweep(self) -> None:
        expired = _expired
        dead = [k for k, c in self.watched.items() if expired(c)]
        for k in dead:
            self._end(k, self.live[k])

    def _note_spec(self, spec: Any) -> None:
        if spec in self._specs:
            return
        self._specs.add(spec)
        names = spec.mesh.mesh_dim_names
        for d, mesh_dims in spec.split_orders().items():
            size = spec.shape[d]
            for m in mesh_dims:
                n = spec.mesh.shape[m]
                if size % n:
                    self.uneven.add(names[m] if names else str(m))
                size = -(-size // n)

    def close(self) -> None:
        self.clock += 1
        self._sweep()

    def report(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> MemoryReport:
        """Peaks per category and of the total, with the split at the total's peak and per module."""
        category: dict[int, str] = {}
        owner: dict[int, str] = {}
        for module in modules:
            for name, p in module.named_parameters(remove_duplicate=True):
                path = name.rpartition(".")[0]
                for which, t in (("parameters", p), ("gradients", p.grad)):
                    s = storage_of(t) if t is not None else None
                    if s is not None:
                        category.setdefault(s._cdata, which)
                        owner.setdefault(s._cdata, path)
        paths = {id(p): name.rpartition(".")[0] for module in modules for name, p in module.named_parameters()}
        for opt in optimizers:
            for param, state in opt.state.items():
                for v in state.values():
                    s = storage_of(v) if isinstance(v, torch.Tensor) else None
                    if s is not None:
                        category.setdefault(s._cdata, "optimizer")
                        owner.setdefault(s._cdata, paths.get(id(param), ""))
        spans = list(self.closed) + [(k, e[1], e[2], None, e[3]) for k, e in self.live.items()]
        events: list[tuple[int, int, int]] = []  # (time, +1 made / -1 died, span index)
        for i, (key, nbytes, made, died, path) in enumerate(spans):
            events.append((made, 1, i))
            if died is not None:
                events.append((died, -1, i))
        events.sort(key=lambda e: (e[0], e[1]))  # at one tick, deaths before births
        now = dict.fromkeys(CATEGORIES, 0)
        peaks = dict(now)
        total, best, at_best, best_time = 0, -1, dict(now), 0
        live_at: set[int] = set()
        best_live: set[int] = set()
        for k, (time_, sign, i) in enumerate(events):
            key, nbytes = spans[i][0], spans[i][1]
            which = _category(category, spans[i])
            now[which] += sign * nbytes
            total += sign * nbytes
            if sign > 0:
                live_at.add(i)
            else:
                live_at.discard(i)
            peaks[which] = max(peaks[which], now[which])
            last_of_tick = k + 1 == len(events) or events[k + 1][0] != time_
            if last_of_tick and total > best:
                best, at_best, best_time, best_live = total, dict(now), time_, set(live_at)
        per_module: dict[str, dict[str, int]] = {}
        for i in best_live:
            key, nbytes, _, _, path = spans[i]
            which = _category(category, spans[i])
            where = owner.get(key, path) if which != "activations" else path
            row = per_module.setdefault(where, dict.fromkeys(CATEGORIES, 0))
            row[which] += nbytes
        return MemoryReport(peaks, max(best, 0), at_best, best_time, self.clock, per_module)


def _category(category: dict[int, str], span: tuple[int, int, int, Optional[int], str]) -> str:
    """A storage alive at the end is what it is then (a parameter, a gradient, optimizer
    state); one that died was an activation (a key is an address, reused once freed)."""
    return category.get(span[0], "activations") if span[3] is None else "activations"


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))  # type: ignore[no-untyped-call]


def _cpu_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                            **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))  # type: ignore[no-untyped-call]


_FLOPS: dict[Any, Any] = {**flop_registry,
                          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
                          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


def _local_shape(x: Any) -> Any:
    if type(x) in DTENSOR_CLASSES:
        return tuple(x._local_tensor.shape)
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_local_shape(v) for v in x)
    return x


def _flops_of(count: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one op on this rank's pieces (torch's formulas, on the local shapes of the
    inputs as given: an input the op moves first is counted as it came)."""
    try:
        return int(count(*_local_shape(args), **{k: _local_shape(v) for k, v in kwargs.items()},
                         out_val=_local_shape(out)))
    except Exception:  # a formula that does not take this overload's arguments: not counted
        return 0


def _outputs(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _outputs(o)
