"""Planning ops on `_StridedShard` inputs: a fused projection's output (q|k|v, gate|up) split
part by part, so that splitting the parts apart needs no communication.

A rank's piece of a `_StridedShard(d, k)` tensor is exactly its `Shard(d)` piece of the
tensor whose parts' pieces lie rank after rank (`_redistribute._specs`). An op that treats
every position along `d` alike -- pointwise, a contraction, a view that keeps `d` whole, a
sum, a foreach or fused optimizer step -- gives on that tensor the same pieces as on the
real one, so it is propagated with each `_StridedShard(d)` read as `Shard(d)` (`parts_reading`) and
every `Shard` on that mesh dim in the answer read back as `_StridedShard` (`read_back`); an
input that arrives replicated and must be split is split part by part. The rest:

| op | plan |
|---|---|
| `split` / `chunk` / `slice` of `d` at part boundaries | each piece of every part stays where it is: one part comes out `Shard(d)`, several `_StridedShard(d)` (`SplitParts`, `SliceParts`) |
| `slice_backward` of such a slice (the gradient split over one mesh dim) | zeros with the gradient's pieces in their parts: `_StridedShard(d)` (`SliceBackwardParts`) |
| `cat` along `d` of equal `Shard(d)` pieces in the backward of a `split` | the pieces side by side: `_StridedShard(d, count)`, the gradient of a split fused output (`CatParts`) |
| anything else | the strided mesh dims are gathered and put back in part order first (`Unstride`); written arguments are written back |

Mixing a `_StridedShard` and a `Shard` on one mesh dim, two split factors, or a size that
does not match also goes the last way: never a silently wrong piece. Everything here is
pure: specs in, specs and sizes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .._layout import contiguous_strides
from .._placement import Placement, Replicate, Shard, _StridedShard
from .._redistribute import as_shard
from .._spec import DTensorSpec, TensorMeta
from ._call import Location, OpCall
from ._registry import OpKind, OpRule
from ._schema import OpSchema, OutputSharding

__all__ = ["CatParts", "SliceBackwardParts", "SliceParts", "SplitParts", "Unstride", "cat_parts", "has_strided",
           "parts_reading", "read_back", "slice_backward_parts", "slice_parts", "split_parts", "unstride"]

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_SLICE, _SLICE_BACKWARD, _CAT = aten.slice.Tensor, aten.slice_backward.default, aten.cat.default


def has_strided(specs: Sequence[Optional[DTensorSpec]]) -> bool:
    return any(s is not None and any(type(p) is _StridedShard for p in s.placements) for s in specs)


def _strided_on(spec: DTensorSpec) -> dict[int, _StridedShard]:
    return {m: p for m, p in enumerate(spec.placements) if isinstance(p, _StridedShard)}


def _with(spec: DTensorSpec, m: int, p: Placement) -> DTensorSpec:
    placements = list(spec.placements)
    placements[m] = p
    return spec.with_placements(tuple(placements), spec.shard_order)


def _resized(spec: DTensorSpec, m: int, p: Placement, dim: int, size: int, stride: Any) -> DTensorSpec:
    placements = list(spec.placements)
    placements[m] = p
    shape = list(spec.shape)
    shape[dim] = size
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape) if stride is None else stride, spec.dtype)
    return DTensorSpec(spec.mesh, tuple(placements), meta, spec.shard_order)


# -- split, slice and cat at part boundaries ------------------------------------------------------


@dataclass(frozen=True)
class SplitParts:
    """`split` of a `_StridedShard` dim at part boundaries: the local piece split alike."""

    dim: int
    local_sizes: tuple[int, ...]
    outputs: tuple[DTensorSpec, ...]


def split_parts(call: OpCall) -> Optional[SplitParts]:
    """The plan of a `split` that cuts a `_StridedShard` dim at its part boundaries, else None."""
    args = call.args
    if call.op not in _SPLITS or call.kwargs or not isinstance(args[0], DTensorSpec):
        return None
    spec = args[0]
    dim = (args[2] if len(args) > 2 else 0) % spec.ndim
    found = [(m, p) for m, p in _strided_on(spec).items() if p.dim == dim]
    if not found:
        return None
    (m, p), = found
    size, n = spec.shape[dim], spec.mesh.shape[m]
    if call.op is aten.split.Tensor:
        step = int(args[1])
        sizes = [min(step, size - s) for s in range(0, size, step)] if step > 0 else []
    else:
        sizes = [int(s) for s in args[1]]
    part = size // p.split_factor
    if not sizes or sum(sizes) != size or any(s % part for s in sizes):
        return None
    outputs = tuple(_resized(spec, m, Shard(dim) if s // part == 1 else _StridedShard(dim, split_factor=s // part),
                             dim, s, spec.tensor_meta.stride) for s in sizes)
    return SplitParts(dim, tuple(s // n for s in sizes), outputs)


@dataclass(frozen=True)
class SliceParts:
    """`slice` of whole parts of a `_StridedShard` dim: the same parts of the local piece."""

    dim: int
    start: int
    length: int
    output: DTensorSpec


def _bounds(size: int, start: Optional[int], end: Optional[int]) -> tuple[int, int]:
    lo = 0 if start is None else start + size if start < 0 else start
    hi = size if end is None else end + size if end < 0 else end
    return max(0, min(lo, size)), max(0, min(hi, size))


def _slice_args(call: OpCall, names: tuple[str, ...], defaults: tuple[Any, ...]) -> Optional[list[Any]]:
    values = list(call.args) + list(defaults[len(call.args):])
    kwargs = dict(call.kwargs)
    for k, name in enumerate(names):
        if name in kwargs:
            values[k] = kwargs[name]
    return values if set(kwargs) <= set(names) else None


def slice_parts(call: OpCall) -> Optional[SliceParts]:
    """The plan of a `slice` that takes whole parts of a `_StridedShard` dim (step 1), else None."""
    values = _slice_args(call, ("self", "dim", "start", "end", "step"), (None, 0, None, None, 1))
    if call.op is not _SLICE or values is None or not isinstance(values[0], DTensorSpec) or values[4] != 1:
        return None
    spec: DTensorSpec = values[0]
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
    out = _resized(spec, m, Shard(dim) if k == 1 else _StridedShard(dim, split_factor=k), dim, hi - lo,
                   spec.tensor_meta.stride)
    return SliceParts(dim, lo // part * (part // n), k * (part // n), out)


@dataclass(frozen=True)
class SliceBackwardParts:
    """The gradient of a slice of whole parts: zeros with the slice's pieces in their parts."""

    dim: int
    start: int
    local_shape: tuple[int, ...]
    output: DTensorSpec


def slice_backward_parts(call: OpCall) -> Optional[SliceBackwardParts]:
    """`slice_backward` of a gradient split over one mesh dim along the sliced dim, the slice
    whole parts of the input's dim (as `slice_parts` cuts them): `_StridedShard`, no gather."""
    values = _slice_args(call, ("grad_output", "input_sizes", "dim", "start", "end", "step"), (None, None, 0, 0, 0, 1))
    if (call.op is not _SLICE_BACKWARD or values is None or not isinstance(values[0], DTensorSpec) or values[5] != 1
            or call.coordinate is None):
        return None
    spec: DTensorSpec = values[0]
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
    local = list(spec.local_shape_and_offset(call.coordinate)[0])  # the gradient's piece
    local[dim] = size // n
    return SliceBackwardParts(dim, lo // part * (part // n), tuple(local), out_spec)


@dataclass(frozen=True)
class CatParts:
    """`cat` of equal `Shard(d)` pieces along `d` into a `_StridedShard(d)`: local pieces side by side."""

    dim: int
    output: DTensorSpec


def cat_parts(call: OpCall) -> Optional[CatParts]:
    """In the backward of a `split`: the `cat` of the parts' gradients, each `Shard(d)` on one
    mesh dim and of one size that splits evenly, stays split part by part (else None)."""
    args = call.args
    if (call.op is not _CAT or not call.split_backward or call.kwargs or not args
            or not isinstance(args[0], tuple)):
        return None
    tensors = args[0]
    if len(tensors) < 2 or not all(isinstance(t, DTensorSpec) for t in tensors):
        return None
    first: DTensorSpec = tensors[0]
    dim = (args[1] if len(args) > 1 else 0) % first.ndim
    if any(t.placements != first.placements or t.shape != first.shape or t.mesh != first.mesh
           or t.shard_order != first.shard_order for t in tensors):
        return None
    on = [m for m, p in enumerate(first.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(on) != 1 or not isinstance(first.placements[on[0]], Shard):
        return None
    m = on[0]
    if first.shape[dim] % first.mesh.shape[m]:
        return None
    out = _resized(first, m, _StridedShard(dim, split_factor=len(tensors)), dim, first.shape[dim] * len(tensors), None)
    return CatParts(dim, out)


# -- propagation on the Shard reading, Shard read back as _StridedShard -----------------------------


class _Abort(Exception):
    """The translated answer does not read back as a strided one: unstride instead."""


def _translatable(rule: OpRule) -> bool:
    """Whether the op treats every position of a sharded dim alike (so the Shard reading holds)."""
    if rule.local is not None or rule.relayout or rule.kind in (OpKind.REPLICATED, OpKind.DECOMPOSED, OpKind.FALLBACK):
        return False
    return rule.kind in (OpKind.POINTWISE, OpKind.VIEW) or rule.positions_alike


def _read(a: Any) -> Any:
    if isinstance(a, DTensorSpec):
        return as_shard(a) if any(type(p) is _StridedShard for p in a.placements) else a
    if isinstance(a, tuple):
        return tuple(_read(x) for x in a)
    return a


def parts_reading(schema: OpSchema, rule: OpRule) -> Optional[OpSchema]:
    """The call with every `_StridedShard(d)` read as `Shard(d)`, for the propagator; None
    where the op does not treat every position alike (unstride instead)."""
    if not _translatable(rule):
        return None
    return OpSchema(schema.op, _read(schema.args_schema), tuple((k, _read(v)) for k, v in schema.kwargs_schema))


def read_back(result: OutputSharding, real: list[DTensorSpec], rule: OpRule,
              where: tuple[Location, ...]) -> Optional[OutputSharding]:
    """Propagation's answer on the Shard reading with the parts put back (`real`: the inputs'
    specs), or None where it does not read back as a strided one (unstride instead)."""
    try:
        return _answer(result, real, rule, where)
    except _Abort:
        return None


def _groups(rule: OpRule, where: tuple[Location, ...], n_outputs: int) -> tuple[list[int], list[int]]:
    """Group of every input location and output: the list index for a foreach / fused op
    (element k of each list meets only element k of the others), else one group."""
    per_element = rule.per_element
    inputs = [j if per_element and j is not None else 0 for _, j in where]
    outputs = list(range(n_outputs)) if per_element else [0] * n_outputs
    return inputs, outputs


def _answer(result: OutputSharding, real: list[DTensorSpec], rule: OpRule, where: tuple[Location, ...]) -> OutputSharding:
    if result.fallback or result.dynamic:
        raise _Abort
    outs = result.output_spec
    out_list: list[Optional[DTensorSpec]] = (
        [outs] if isinstance(outs, DTensorSpec) else [] if outs is None else list(outs))
    in_groups, out_groups = _groups(rule, where, len(out_list))
    # every input's layout as the op runs, read as Shard (None: as it is)
    wants = [t if t is not None else _read(r) for t, r in zip(result.input_specs, real)]
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
                raise _Abort  # two split factors, two sizes, or a plain split beside a strided one
            factor, size = factors.pop(), sizes.pop()
            if not any(wants[k].placements[m] == Shard(p.dim) for k, p in strided.items()):
                continue  # every strided input is gathered on this mesh dim: a plain answer
            for k in members:
                w = wants[k].placements[m]
                if isinstance(w, Shard):
                    if real[k].shape[w.dim] != size:
                        raise _Abort
                    wants[k] = targets[k] = _with(wants[k], m, _StridedShard(w.dim, split_factor=factor))
            for k in outputs:
                o = out_list[k]
                if o is not None and isinstance(q := o.placements[m], Shard):
                    if o.shape[q.dim] != size:
                        raise _Abort
                    out_list[k] = _with(o, m, _StridedShard(q.dim, split_factor=factor))
    moved = tuple(None if t is None or t == r else t for t, r in zip(targets, real))
    out_spec: Any = out_list[0] if isinstance(outs, DTensorSpec) else None if outs is None else tuple(out_list)
    return OutputSharding(moved, out_spec, result.shape_arg, result.fallback, result.dynamic)


# -- everything else: gather the strided mesh dims first ------------------------------------------


@dataclass(frozen=True)
class Unstride:
    """Gather every `_StridedShard` input's strided mesh dims (parts back in order), plan the op
    again on those, and write a written argument back into its strided layout."""

    moves: tuple[tuple[Location, DTensorSpec, DTensorSpec], ...]  # (where, strided spec, plain spec)
    written: tuple[tuple[Location, DTensorSpec, DTensorSpec], ...]  # (where, plain spec, strided spec)


def unstride(call: OpCall, written: set[Union[int, str]]) -> Unstride:
    moves, back = [], []
    for loc in call.locations():
        spec = call.at(loc)
        if isinstance(spec, DTensorSpec) and any(type(p) is _StridedShard for p in spec.placements):
            plain = spec.with_placements(
                tuple(Replicate() if isinstance(p, _StridedShard) else p for p in spec.placements), spec.shard_order)
            moves.append((loc, spec, plain))
            if loc[0] in written:
                back.append((loc, plain, spec))
    return Unstride(tuple(moves), tuple(back))
