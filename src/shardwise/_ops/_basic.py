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
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import expand_to_mesh

__all__: list[str] = []

aten = torch.ops.aten


def _need(spec: DTensorSpec, placements: tuple[Placement, ...]) -> Optional[Layout]:
    """None when `spec` already has `placements` (default split order), else the Layout to reach."""
    if placements == spec.placements and not spec.shard_order:
        return None
    return Layout(placements)


def _replicate_partials(spec: DTensorSpec) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)


@register_op_strategy([aten.sum.default, aten.sum.dim_IntList])
def _sum_strategy(schema: OpSchema) -> OpStrategy:
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
    return OpStrategy([PlacementStrategy(Layout(tuple(out)), (_need(spec, tuple(need)),))])


@register_op_strategy(aten.mm.default)
def _mm_strategy(schema: OpSchema) -> OpStrategy:
    mesh_ndim = schema.args_schema[0].mesh.ndim
    options = [
        (Shard(0), Shard(0), Replicate()),  # (m/n, k) @ (k, p) -> (m/n, p)
        (Shard(1), Replicate(), Shard(1)),  # (m, k) @ (k, p/n) -> (m, p/n)
        (Partial(), Shard(1), Shard(0)),  # (m, k/n) @ (k/n, p) -> partial sums
        (Partial(), Partial(), Replicate()),  # linear in the left input
        (Partial(), Replicate(), Partial()),  # linear in the right input
    ]
    return expand_to_mesh(mesh_ndim, options)


def _permuted(spec: DTensorSpec, perm: list[int]) -> OpStrategy:
    out = tuple(Shard(perm.index(p.dim)) if isinstance(p, Shard) else p for p in spec.placements)
    order = tuple(sorted((perm.index(d), ms) for d, ms in spec.shard_order))
    return OpStrategy([PlacementStrategy(Layout(out, order), (None,))])


@register_op_strategy([aten.t.default, aten.transpose.int])
def _transpose_strategy(schema: OpSchema) -> OpStrategy:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    n = spec.ndim
    d0, d1 = (schema.args_schema[1], schema.args_schema[2]) if schema.op is aten.transpose.int else (0, 1)
    perm = list(range(n))
    if n >= 2:
        d0, d1 = d0 % n, d1 % n
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(spec, perm)


@register_op_strategy(aten.permute.default)
def _permute_strategy(schema: OpSchema) -> OpStrategy:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    return _permuted(spec, [d % max(spec.ndim, 1) for d in schema.args_schema[1]])


@register_op_strategy(aten.expand.default)
def _expand_strategy(schema: OpSchema) -> OpStrategy:
    out_meta = schema.output_meta()
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
    return OpStrategy([PlacementStrategy(Layout(tuple(out)), (_need(spec, tuple(need)),), shape_arg=1)])


def _kept_dim(in_shape: torch.Size, out_shape: torch.Size, d: int) -> Optional[int]:
    """The output dim that is input dim `d` unchanged by a view (same size, same prefix numel)."""
    before = math.prod(in_shape[:d])
    for od in range(len(out_shape)):
        if out_shape[od] == in_shape[d] and math.prod(out_shape[:od]) == before:
            return od
    return None


@register_op_strategy([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view_strategy(schema: OpSchema) -> OpStrategy:
    out_meta = schema.output_meta()
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
        return OpStrategy([PlacementStrategy(Layout(tuple(out)), (Layout(tuple(need)),), shape_arg=1)])
    return OpStrategy([PlacementStrategy(Layout(tuple(out)), (_need(spec, tuple(need)),), shape_arg=1)])


@register_op_strategy([aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default])
def _like_strategy(schema: OpSchema) -> OpStrategy:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    return OpStrategy([PlacementStrategy(Layout(_replicate_partials(spec), spec.shard_order), (None,))])


@register_op_strategy(aten.unsqueeze.default)
def _unsqueeze_strategy(schema: OpSchema) -> OpStrategy:
    spec, dim = schema.args_schema[0], schema.args_schema[1]
    assert isinstance(spec, DTensorSpec)
    dim = dim % (spec.ndim + 1)
    out = tuple(Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in spec.placements)
    order = tuple((d + (d >= dim), ms) for d, ms in spec.shard_order)
    return OpStrategy([PlacementStrategy(Layout(out, order), (None,))])


@register_op_strategy([aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default])
def _squeeze_strategy(schema: OpSchema) -> OpStrategy:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    arg = schema.args_schema[1] if len(schema.args_schema) > 1 else None
    wanted = range(spec.ndim) if arg is None else ([arg] if isinstance(arg, int) else list(arg))
    gone = {d % max(spec.ndim, 1) for d in wanted if spec.ndim and spec.shape[d % spec.ndim] == 1}
    need = tuple(Replicate() if isinstance(p, Shard) and p.dim in gone else p for p in spec.placements)
    out = tuple(Shard(p.dim - sum(g < p.dim for g in gone)) if isinstance(p, Shard) else p for p in need)
    return OpStrategy([PlacementStrategy(Layout(out), (_need(spec, need),))])
