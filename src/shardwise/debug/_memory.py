"""Following a dry run's memory: every storage an op makes, from that op to its death.

`MemoryTracker` is a dispatch mode: after each op that makes a new storage it looks for the
storages that died (a weak reference each; a parameter's piece cannot die in a step and is
not looked at) and then counts the new ones, so the running total is exact where the peak
can be (at a birth). At the end each storage is put in the category it ends in:
parameters, gradients, optimizer state, or activations (everything else, and whatever died).

An fsdp unit frees its unsharded parameters in place (`resize_(0)`: the storage lives on,
empty) and refills them before the next use, and says so (`_memory_events`), as it does
when it starts a gather: a storage freed so ends its span before the next op, one refilled
starts a new span, and those and the gather's buffers are the unit's. They form a fifth
category, unsharded (only in the report of a program with units), owned by the unit's
module path, and the report lists each unit with what it held unsharded (or was
gathering) at the peak.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils._python_dispatch import TorchDispatchMode

from .._memory_events import listening
from .._tensor import DTENSOR_CLASSES
from ..fsdp._state import state_of
from ._report import CATEGORIES, UNSHARDED, MemoryReport

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
        # storage key -> [weak ref, bytes, made at, module path, fsdp unit or None]
        self.live: dict[int, list[Any]] = {}
        self.watched: dict[int, int] = {}  # the live storages that may die: key -> weak reference
        self.closed: list[_Span] = []
        self._listening: Any = None
        self.uneven: set[str] = set()
        self._specs: set[Any] = set()
        self.flops = {"forward": 0, "backward": 0}  # of the matmuls, convolutions and attentions this rank runs

    def __enter__(self) -> MemoryTracker:
        """Follow the ops, and hear fsdp units free and refill their storages (`_memory_events`)."""
        self._listening = listening(self._heard)
        self._listening.__enter__()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self._listening.__exit__(*exc)

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
        self.live[key] = [weak, storage.nbytes(), made, self.counter.module_path(), None]
        if not pinned:
            self.watched[key] = weak.cdata

    def _end(self, key: int, entry: list[Any], died: Optional[int] = None) -> None:
        del self.live[key]
        self.watched.pop(key, None)
        self.closed.append(_Span(key, entry[1], entry[2], self.clock if died is None else died, entry[3], entry[4]))

    def _heard(self, unit: Any) -> None:
        """`unit` started a gather, or filled or freed its unsharded storages in place, between
        two ops: a freed one was alive with the last op's outputs and is gone before the next
        op's (it dies at the next tick, deaths first); a filled one and a gather's buffer
        (counted already as the outputs of the ops that made them, or counted now) are the unit's."""
        fulls = [p.full for p in unit.params if p.full is not None]
        buffers = [started.result() for _, started in unit.inflight if started.done()]  # (dry: done when issued)
        for t in fulls + buffers:
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            entry = self.live.get(key)
            if entry is not None and (nbytes == 0 or entry[1] != nbytes):
                self._end(key, entry, self.clock + 1)
                entry = None
            if nbytes == 0:
                continue
            if entry is None:
                self._add(storage, self.clock, pinned=False)
                entry = self.live[key]
            entry[4] = unit

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
        spans = list(self.closed) + [_Span(k, e[1], e[2], None, e[3], e[4]) for k, e in self.live.items()]
        kinds = CATEGORIES + (UNSHARDED,) if any(s.unit is not None for s in spans) else CATEGORIES
        events: list[tuple[int, int, int]] = []  # (time, +1 made / -1 died, span index)
        for i, span in enumerate(spans):
            events.append((span.made, 1, i))
            if span.died is not None:
                events.append((span.died, -1, i))
        events.sort(key=lambda e: (e[0], e[1]))  # at one tick, deaths before births
        now = dict.fromkeys(kinds, 0)
        peaks = dict(now)
        total, best, at_best, best_time = 0, -1, dict(now), 0
        live_at: set[int] = set()
        best_live: set[int] = set()
        for k, (time_, sign, i) in enumerate(events):
            nbytes = spans[i].nbytes
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
        unit_paths = _unit_paths(modules)
        units = {unit_paths.get(id(s.unit), s.unit.name): 0
                 for s in sorted((s for s in spans if s.unit is not None), key=lambda s: s.made)}
        per_module: dict[str, dict[str, int]] = {}
        for i in best_live:
            span = spans[i]
            which = _category(category, span)
            if span.unit is not None:
                where = unit_paths.get(id(span.unit), span.unit.name)
                units[where] += span.nbytes
            else:
                where = owner.get(span.key, span.path) if which != "activations" else span.path
            row = per_module.setdefault(where, dict.fromkeys(kinds, 0))
            row[which] += span.nbytes
        return MemoryReport(peaks, max(best, 0), at_best, best_time, self.clock, per_module, units)


class _Span(NamedTuple):
    """A storage's life: made at tick `made`, died at `died` (None: alive at the end), with the
    module path it was made in and the fsdp unit whose unsharded parameter it is (or None)."""

    key: int
    nbytes: int
    made: int
    died: Optional[int]
    path: str
    unit: Any


def _category(category: dict[int, str], span: _Span) -> str:
    """A unit's unsharded parameter (or gather buffer) is unsharded; any other storage alive at
    the end is what it is then (a parameter, a gradient, optimizer state); one that died was
    an activation (a key is an address, reused once freed)."""
    if span.unit is not None:
        return UNSHARDED
    return category.get(span.key, "activations") if span.died is None else "activations"


def _unit_paths(modules: list[nn.Module]) -> dict[int, str]:
    """id of each fsdp unit under `modules` -> the path of the module it was made for."""
    paths: dict[int, str] = {}
    for module in modules:
        for name, sub in module.named_modules():
            state = state_of(sub)
            if state is not None and state.unit is not None:
                paths.setdefault(id(state.unit), name)
    return paths


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
