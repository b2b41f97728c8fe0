"""Rules for the few non-pointwise ops the foundation needs: sum, mm, transposes, expand,
view/reshape on untouched sharded dims, and `*_like` factories.

The propagation issue replaces these with cost-ranked strategies for every op family.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._registry import register_rule
from ._schema import Layout, OpSchema, OutputSharding

__all__: list[str] = []

aten = torch.ops.aten


def _need(spec: DTensorSpec, placements: tuple[Placement, ...]) -> Optional[Layout]:
    """None when `spec` already has `placements` (default split order), else the Layout to reach."""
    if placements == spec.placements and not spec.shard_order:
        return None
    return Layout(placements)


def _replicate_partials(spec: DTensorSpec) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)


@register_rule([aten.sum.default, aten.sum.dim_IntList])
def _sum_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dims_arg = schema.args_schema[1] if len(schema.args_schema) > 1 else None
    keepdim = bool(schema.args_schema[2]) if len(schema.args_schema) > 2 else bool(schema.kwargs.get("keepdim", False))
    reduced = set(range(spec.ndim)) if not dims_arg else {d % max(spec.ndim, 1) for d in dims_arg}
    need: list[Placement] = []
    out: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim in reduced:
            need.append(p)
            out.append(Partial("sum"))
        elif isinstance(p, Shard):
            need.append(p)
            out.append(Shard(p.dim if keepdim else p.dim - sum(1 for r in reduced if r < p.dim)))
        elif isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            need.append(p)
            out.append(p)
        else:
            need.append(Replicate())
            out.append(Replicate())
    return OutputSharding((_need(spec, tuple(need)),), Layout(tuple(out)))


@register_rule(aten.mm.default)
def _mm_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    a, b = schema.args_schema[:2]
    assert isinstance(a, DTensorSpec) and isinstance(b, DTensorSpec)
    need_a: list[Placement] = []
    need_b: list[Placement] = []
    out: list[Placement] = []
    for pa, pb in zip(a.placements, b.placements):
        if pa == Shard(0):  # (m/n, k) @ (k, p) -> (m/n, p)
            choice: tuple[Placement, Placement, Placement] = (pa, Replicate(), Shard(0))
        elif pb == Shard(1):  # (m, k) @ (k, p/n) -> (m, p/n)
            choice = (Replicate(), pb, Shard(1))
        elif pa == Shard(1) and pb == Shard(0):  # (m, k/n) @ (k/n, p) -> partial sums
            choice = (pa, pb, Partial("sum"))
        elif isinstance(pa, Partial) and pa.reduce_op in ("sum", "avg") and not isinstance(pb, Partial):
            choice = (pa, Replicate(), pa)
        elif isinstance(pb, Partial) and pb.reduce_op in ("sum", "avg") and not isinstance(pa, Partial):
            choice = (Replicate(), pb, pb)
        else:
            choice = (Replicate(), Replicate(), Replicate())
        need_a.append(choice[0])
        need_b.append(choice[1])
        out.append(choice[2])
    return OutputSharding((_need(a, tuple(need_a)), _need(b, tuple(need_b))), Layout(tuple(out)))


def _permuted(spec: DTensorSpec, perm: list[int]) -> OutputSharding:
    out = tuple(Shard(perm.index(p.dim)) if isinstance(p, Shard) else p for p in spec.placements)
    order = tuple(sorted((perm.index(d), ms) for d, ms in spec.shard_order))
    return OutputSharding((None,), Layout(out, order))


@register_rule([aten.t.default, aten.transpose.int])
def _transpose_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    n = spec.ndim
    d0, d1 = (schema.args_schema[1], schema.args_schema[2]) if schema.op is aten.transpose.int else (0, 1)
    perm = list(range(n))
    if n >= 2:
        d0, d1 = d0 % n, d1 % n
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(spec, perm)


@register_rule(aten.permute.default)
def _permute_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    return _permuted(spec, [d % max(spec.ndim, 1) for d in schema.args_schema[1]])


@register_rule(aten.expand.default)
def _expand_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec) and isinstance(out_meta, TensorMeta)
    off = len(out_meta.shape) - spec.ndim
    need: list[Placement] = []
    out: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Shard) and spec.shape[p.dim] == out_meta.shape[p.dim + off]:
            need.append(p)
            out.append(Shard(p.dim + off))
        elif isinstance(p, Shard):
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(p)
    return OutputSharding((_need(spec, tuple(need)),), Layout(tuple(out)), shape_arg=1)


def _kept_dim(in_shape: torch.Size, out_shape: torch.Size, d: int) -> Optional[int]:
    """The output dim that is input dim `d` unchanged by a view (same size, same prefix numel)."""
    before = math.prod(in_shape[:d])
    for od in range(len(out_shape)):
        if out_shape[od] == in_shape[d] and math.prod(out_shape[:od]) == before:
            return od
    return None


@register_rule([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec) and isinstance(out_meta, TensorMeta)
    need: list[Placement] = []
    out: list[Placement] = []
    for p in spec.placements:
        od = _kept_dim(spec.shape, out_meta.shape, p.dim) if isinstance(p, Shard) else None
        if isinstance(p, Shard) and od is None:
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(Shard(od) if od is not None else p)
    if spec.shard_order and tuple(need) == spec.placements:
        return OutputSharding((Layout(tuple(need)),), Layout(tuple(out)), shape_arg=1)
    return OutputSharding((_need(spec, tuple(need)),), Layout(tuple(out)), shape_arg=1)


@register_rule([aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default])
def _like_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    return OutputSharding((None,), Layout(_replicate_partials(spec), spec.shard_order))


@register_rule(aten.unsqueeze.default)
def _unsqueeze_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec, dim = schema.args_schema[0], schema.args_schema[1]
    assert isinstance(spec, DTensorSpec)
    dim = dim % (spec.ndim + 1)
    out = tuple(Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in spec.placements)
    order = tuple((d + (d >= dim), ms) for d, ms in spec.shard_order)
    return OutputSharding((None,), Layout(out, order))


@register_rule([aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default])
def _squeeze_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    arg = schema.args_schema[1] if len(schema.args_schema) > 1 else None
    wanted = range(spec.ndim) if arg is None else ([arg] if isinstance(arg, int) else list(arg))
    gone = {d % max(spec.ndim, 1) for d in wanted if spec.ndim and spec.shape[d % spec.ndim] == 1}
    need = tuple(Replicate() if isinstance(p, Shard) and p.dim in gone else p for p in spec.placements)
    out = tuple(Shard(p.dim - sum(g < p.dim for g in gone)) if isinstance(p, Shard) else p for p in need)
    return OutputSharding((_need(spec, need),), Layout(out))
