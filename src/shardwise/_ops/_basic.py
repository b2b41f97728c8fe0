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