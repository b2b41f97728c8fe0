"""Ops on `_StridedShard` DTensors: a fused projection's output (q|k|v, gate|up) split
part by part, so that splitting the parts apart needs no communication.

A rank's piece of a `_StridedShard(d, k)` tensor is exactly its `Shard(d)` piece of the
tensor whose parts' pieces lie rank after rank (`_redistribute._specs`). An op that treats
every position along `d` alike -- pointwise, a contraction, a view that keeps `d` whole, a
sum, a foreach or fused optimizer step -- gives on that tensor the same pieces as on the
real one, so its plan is made with each `_StridedShard(d)` read as `Shard(d)` and every
`Shard` on that mesh dim in the answer read back as `_StridedShard` (`Translation`); an
input that arrives replicated and must be split is split part by part. The rest:

| op | plan |
|---|---|
| `split` / `chunk` / `slice` of `d` at part boundaries | each piece of every part stays where it is: one part comes out `Shard(d)`, several `_StridedShard(d)` |
| `slice_backward` of such a slice (the gradient split over one mesh dim) | zeros with the gradient's pieces in their parts: `_StridedShard(d)` |
| `cat` along `d` of equal `Shard(d)` pieces in the backward of a `split` | the pieces side by side: `_StridedShard(d, count)`, the gradient of a split fused output |
| anything else | the strided mesh dims are gathered and put back in part order first (`UnstridedPlan`); written arguments are written back |

Mixing a `_StridedShard` and a `Shard` on one mesh dim, two split factors, or a size that
does not match also goes the last way: never a silently wrong piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._layout import contiguous_strides
from .._ops import OpKind, OpRule, OutputSharding
from .._placement import Placement, Replicate, Shard, _StridedShard
from .._redistribute import run_program
from .._redistribute._specs import as_shard
from .._spec import DTensorSpec, TensorMeta
from ._plans import Location
from ._redistribute import Move, move_between
from ._wrap import DTensorBase, Wrapper, wrap

__all__ = ["Translation", "has_strided", "in_split_backward", "split_plan", "slice_plan", "slice_backward_plan", "cat_plan",
           "translation", "UnstridedPlan"]

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_SLICE, _SLICE_BACKWARD = aten.slice.Tensor, aten.slice_backward.default
_SPLIT_BACKWARD = frozenset({"SplitBackward0", "SplitWithSizesBackward0"})


def has_strided(specs: Sequence[Optional[DTensorSpec]]) -> bool:
    return any(s is not None and any(type(p) is _StridedShard for p in s.placements) for s in specs)


def in_split_backward() -> bool:
    """Whether the op runs in the backward of a `split` (its `cat` of the pieces' gradients)."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ in _SPLIT_BACKWARD


def _strided_on(spec: DTensorSpec) -> dict[int, _StridedShard]:
    return {m: p for m, p in enumerate(spec.placements) if isinstance(p, _StridedShard)}


# -- split and cat ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitPlan:
    """`split` of a `_StridedShard` dim at part boundaries: the local piece split alike."""

    dim: int
    local_sizes: tuple[int, ...]
    outputs: tuple[Wrapper, ...]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        pieces = args[0]._local_tensor.split(list(self.local_sizes), self.dim)
        return [w(p) for p, w in zip(pieces, self.outputs)]


def split_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[SplitPlan]:
    """The plan of a `split` that cuts a `_StridedShard` dim at its part boundaries, else None."""
    if func not in _SPLITS or kwargs or not isinstance(args[0], DTensorBase):
        return None
    spec: DTensorSpec = args[0]._spec
    dim = (args[2] if len(args) > 2 else 0) % spec.ndim
    found = [(m, p) for m, p in _strided_on(spec).items() if p.dim == dim]
    if not found:
        return None
    (m, p), = found
    size, n = spec.shape[dim], spec.mesh.shape[m]
    if func is aten.split.Tensor:
        step = int(args[1])
        sizes = [min(step, size - s) for s in range(0, size, step)] if step > 0 else []
    else:
        sizes = [int(s) for s in args[1]]
    part = size // p.split_factor
    if not sizes or sum(sizes) != size or any(s % part for s in sizes):
        return None
    outputs = []
    for s in sizes:
        k = s // part
        placements = list(spec.placements)
        placements[m] = Shard(dim) if k == 1 else _StridedShard(dim, split_factor=k)
        shape = list(spec.shape)
        shape[dim] = s
        meta = TensorMeta(torch.Size(shape), spec.tensor_meta.stride, spec.dtype)
        outputs.append(Wrapper(DTensorSpec(spec.mesh, tuple(placements), meta, spec.shard_order)))
    return SplitPlan(dim, tuple(s // n for s in sizes), tuple(outputs))


@dataclass(frozen=True)
class SlicePlan:
    """`slice` of whole parts of a `_StridedShard` dim: the same parts of the local piece."""

    dim: int
    start: int
    length: int
    output: Wrapper

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.output(args[0]._local_tensor.narrow(self.dim, self.start, self.length))


def _bounds(size: int, start: Optional[int], end: Optional[int]) -> tuple[int, int]:
    lo = 0 if start is None else start + size if start < 0 else start
    hi = size if end is None else end + size if end < 0 else end
    return max(0, min(lo, size)), max(0, min(hi, size))


def _slice_args(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...], defaults: tuple[Any, ...]) -> Optional[list[Any]]:
    values = list(args) + list(defaults[len(args):])
    for k, name in enumerate(names):
        if name in kwargs:
            values[k] = kwargs[name]
    return values if set(kwargs) <= set(names) else None


def slice_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[SlicePlan]:
    """The plan of a `slice` that takes whole parts of a `_StridedShard` dim (step 1), else None."""
    values = _slice_args(args, kwargs, ("self", "dim", "start", "end", "step"), (None, 0, None, None, 1))
    if func is not _SLICE or values is None or not isinstance(values[0], DTensorBase) or values[4] != 1:
        return None
    spec: DTensorSpec = values[0]._spec
    dim = values[1] % spec.ndim
    found = [(m, p) for m, p in _strided_on(spec).items() if p.dim == dim]
    if not found:
        return None
    (m, p), = found
    size, n = spec.shape[dim], spec.mesh.shape[m]
    part = size // p.split_factor
    lo, hi = _bounds(size, values[2], values[3])
    if hi <= lo or lo % part or hi % part:
        return None
    k = (hi - lo) // part
    placements = list(spec.placements)
    placements[m] = Shard(dim) if k == 1 else _StridedShard(dim, split_factor=k)
    shape = list(spec.shape)
    shape[dim] = hi - lo
    meta = TensorMeta(torch.Size(shape), spec.tensor_meta.stride, spec.dtype)
    out = Wrapper(DTensorSpec(spec.mesh, tuple(placements), meta, spec.shard_order))
    return SlicePlan(dim, lo // part * (part // n), k * (part // n), out)


@dataclass(frozen=True)
class SliceBackwardPlan:
    """The gradient of a slice of whole parts: zeros with the slice's pieces in their parts."""

    dim: int
    start: int
    local_shape: tuple[int, ...]
    output: Wrapper

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        piece = args[0]._local_tensor
        out = piece.new_zeros(self.local_shape)
        out.narrow(self.dim, self.start, piece.shape[self.dim]).copy_(piece)
        return self.output(out)


def slice_backward_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[SliceBackwardPlan]:
    """`slice_backward` of a gradient split over one mesh dim along the sliced dim, the slice
    whole parts of the input's dim (as `slice_plan` cuts them): `_StridedShard`, no gather."""
    values = _slice_args(args, kwargs, ("grad_output", "input_sizes", "dim", "start", "end", "step"),
                         (None, None, 0, 0, 0, 1))
    if func is not _SLICE_BACKWARD or values is None or not isinstance(values[0], DTensorBase) or values[5] != 1:
        return None
    spec: DTensorSpec = values[0]._spec
    sizes = [int(s) for s in values[1]]
    dim = values[2] % spec.ndim
    on = [m for m, p in enumerate(spec.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(on) != 1:
        return None
    m, n = on[0], spec.mesh.shape[on[0]]
    p = spec.placements[m]
    k = p.split_factor if isinstance(p, _StridedShard) else 1
    size = sizes[dim]
    lo, hi = _bounds(size, values[3], values[4])
    if hi - lo != spec.shape[dim] or (hi - lo) % k:
        return None
    part = (hi - lo) // k
    if part % n or size % part or lo % part:
        return None
    placements = list(spec.placements)
    placements[m] = _StridedShard(dim, split_factor=size // part)
    meta = TensorMeta(torch.Size(sizes), contiguous_strides(sizes), spec.dtype)
    out_spec = DTensorSpec(spec.mesh, tuple(placements), meta, spec.shard_order)
    local = list(values[0]._local_tensor.shape)
    local[dim] = size // n
    return SliceBackwardPlan(dim, lo // part * (part // n), tuple(local), Wrapper(out_spec))


@dataclass(frozen=True)
class CatPlan:
    """`cat` of equal `Shard(d)` pieces along `d` into a `_StridedShard(d)`: local pieces side by side."""

    dim: int
    output: Wrapper

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.output(torch.cat([t._local_tensor for t in args[0]], self.dim))


def cat_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[CatPlan]:
    """In the backward of a `split`: the `cat` of the parts' gradients, each `Shard(d)` on one
    mesh dim and of one size that splits evenly, stays split part by part (else None)."""
    if func is not aten.cat.default or kwargs or not args or not isinstance(args[0], (list, tuple)):
        return None
    tensors = args[0]
    if len(tensors) < 2 or not all(isinstance(t, DTensorBase) for t in tensors):
        return None
    first: DTensorSpec = tensors[0]._spec
    dim = (args[1] if len(args) > 1 else 0) % first.ndim
    if any(t._spec.placements != first.placements or t._spec.shape != first.shape or t._spec.mesh != first.mesh
           or t._spec.shard_order != first.shard_order for t in tensors):
        return None
    on = [m for m, p in enumerate(first.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(on) != 1 or not isinstance(first.placements[on[0]], Shard):
        return None
    m = on[0]
    if first.shape[dim] % first.mesh.shape[m]:
        return None
    placements = list(first.placements)
    placements[m] = _StridedShard(dim, split_factor=len(tensors))
    shape = list(first.shape)
    shape[dim] *= len(tensors)
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), first.dtype)
    return CatPlan(dim, Wrapper(DTensorSpec(first.mesh, tuple(placements), meta, first.shard_order)))


# -- translation: plan on the Shard reading, read Shard back as _StridedShard ------------------


class Abort(Exception):
    """The translated answer does not read back as a strided one: unstride instead."""


def translatable(rule: OpRule) -> bool:
    """Whether the op treats every position of a sharded dim alike (so the Shard reading holds)."""
    if rule.local is not None or rule.relayout or rule.kind in (OpKind.REPLICATED, OpKind.DECOMPOSED, OpKind.FALLBACK):
        return False
    return rule.kind in (OpKind.POINTWISE, OpKind.VIEW) or rule.positions_alike


@dataclass(frozen=True)
class Translation:
    """How `_make_plan` reads and answers for an op with `_StridedShard` inputs: the schema
    sees `spec(s)`; `answer` turns the propagator's answer into the real one (or raises `Abort`)."""

    func: Any
    where: tuple[Location, ...]

    @staticmethod
    def spec(s: DTensorSpec) -> DTensorSpec:
        return as_shard(s) if any(type(p) is _StridedShard for p in s.placements) else s

    def _groups(self, n_outputs: int) -> tuple[list[int], list[int]]:
        """Group of every input location and output: the list index for a foreach / fused op
        (element k of each list meets only element k of the others), else one group."""
        name = self.func.__name__
        per_element = name.startswith("_foreach_") or name.startswith("_fused_")
        inputs = [j if per_element and j is not None else 0 for _, j in self.where]
        outputs = list(range(n_outputs)) if per_element else [0] * n_outputs
        return inputs, outputs

    def answer(self, result: OutputSharding, real: list[DTensorSpec]) -> OutputSharding:
        if result.fallback or result.dynamic:
            raise Abort
        outs = result.output_spec
        out_list: list[Optional[DTensorSpec]] = (
            [outs] if isinstance(outs, DTensorSpec) else [] if outs is None else list(outs))
        in_groups, out_groups = self._groups(len(out_list))
        # every input's layout as the op runs, read as Shard (None: as it is)
        wants = [t if t is not None else Translation.spec(r) for t, r in zip(result.input_specs, real)]
        targets: list[Optional[DTensorSpec]] = list(result.input_specs)
        for g in set(in_groups):
            members = [k for k, gk in enumerate(in_groups) if gk == g]
            outputs = [k for k, gk in enumerate(out_groups) if gk == g]
            for m in range(real[0].mesh.ndim):
                strided = {k: p for k in members if isinstance(p := real[k].placements[m], _StridedShard)}
                if not strided:
                    continue
                factors = {p.split_factor for p in strided.values()}
                sizes = {real[k].shape[p.dim] for k, p in strided.items()}
                if len(factors) != 1 or len(sizes) != 1 or any(isinstance(real[k].placements[m], Shard) for k in members):
                    raise Abort  # two split factors, two sizes, or a plain split beside a strided one
                factor, size = factors.pop(), sizes.pop()
                if not any(wants[k].placements[m] == Shard(p.dim) for k, p in strided.items()):
                    continue  # every strided input is gathered on this mesh dim: a plain answer
                for k in members:
                    w = wants[k].placements[m]
                    if isinstance(w, Shard):
                        if real[k].shape[w.dim] != size:
                            raise Abort
                        wants[k] = targets[k] = _with(wants[k], m, _StridedShard(w.dim, split_factor=factor))
                for k in outputs:
                    o = out_list[k]
                    if o is not None and isinstance(q := o.placements[m], Shard):
                        if o.shape[q.dim] != size:
                            raise Abort
                        out_list[k] = _with(o, m, _StridedShard(q.dim, split_factor=factor))
        moved = tuple(None if t is None or t == r else t for t, r in zip(targets, real))
        out_spec: Any = out_list[0] if isinstance(outs, DTensorSpec) else None if outs is None else tuple(out_list)
        return OutputSharding(moved, out_spec, result.shape_arg, result.fallback, result.dynamic)


def _with(spec: DTensorSpec, m: int, p: Placement) -> DTensorSpec:
    placements = list(spec.placements)
    placements[m] = p
    return spec.with_placements(tuple(placements), spec.shard_order)


def translation(func: Any, rule: OpRule, where: tuple[Location, ...]) -> Optional[Translation]:
    return Translation(func, where) if translatable(rule) else None


# -- everything else: gather the strided mesh dims first ------------------------------------------


def _plain_spec(spec: DTensorSpec) -> DTensorSpec:
    return spec.with_placements(
        tuple(Replicate() if isinstance(p, _StridedShard) else p for p in spec.placements), spec.shard_order)


@dataclass(frozen=True)
class UnstridedPlan:
    """Gather every `_StridedShard` input's strided mesh dims (parts back in order), run the op
    as usual on those, and write a written argument back into its strided layout."""

    func: Any
    moves: tuple[tuple[Location, Move], ...]
    written: tuple[tuple[Location, Move], ...]
    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        new_args: list[Any] = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
        new_kwargs: dict[str, Any] = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
        swapped: dict[int, Any] = {}
        for (key, j), move in self.moves:
            holder: Any = new_args if isinstance(key, int) else new_kwargs
            original = holder[key] if j is None else holder[key][j]
            plain = wrap(run_program(move.program, original._local_tensor), move.dst)
            swapped[id(plain)] = original
            if j is None:
                holder[key] = plain
            else:
                holder[key][j] = plain
        call_args = tuple(tuple(a) if isinstance(args[i], tuple) else a for i, a in enumerate(new_args))
        out = self.dispatch(self.func, call_args, new_kwargs)
        for (key, j), back in self.written:
            holder = new_args if isinstance(key, int) else new_kwargs
            plain = holder[key] if j is None else holder[key][j]
            swapped[id(plain)]._local_tensor.copy_(run_program(back.program, plain._local_tensor))
        if isinstance(out, (list, tuple)):
            return type(out)(swapped.get(id(o), o) for o in out)
        return swapped.get(id(out), out)


def unstrided_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[Location, ...],
                   written: set[Any], dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> UnstridedPlan:
    moves, back = [], []
    for key, j in where:
        value = args[key] if isinstance(key, int) else kwargs[key]
        a = value if j is None else value[j]
        if isinstance(a, DTensorBase) and any(type(p) is _StridedShard for p in a._spec.placements):
            plain = _plain_spec(a._spec)
            moves.append(((key, j), move_between(a._spec, plain)))
            if key in written:
                back.append(((key, j), move_between(plain, a._spec)))
    return UnstridedPlan(func, tuple(moves), tuple(back), dispatch)
