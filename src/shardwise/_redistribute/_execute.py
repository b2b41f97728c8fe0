"""Run a redistribute plan on this rank's local tensor, one step at a time, through `comm`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import _comm as comm
from .._layout import chunk_range
from .._placement import Partial, Shard
from ._exchange import exchange_routes
from ._planner import RedistributePlan

__all__ = ["execute_plan"]


def _local_size(size: int, mesh_shape: Sequence[int], splitters: Sequence[int], coordinate: Sequence[int]) -> int:
    for m in splitters:
        size = chunk_range(size, mesh_shape[m], coordinate[m])[1]
    return size


def _pieces(parent: int, n: int) -> list[int]:
    return [chunk_range(parent, n, j)[1] for j in range(n)]


def execute_plan(
    local: torch.Tensor,
    plan: RedistributePlan,
    groups: Sequence[Any],
    coordinate: tuple[int, ...],
    whole: Optional[tuple[Any, Sequence[int]]] = None,
) -> torch.Tensor:
    """Apply `plan` to `local` (this rank's piece); `groups[i]` is this rank's group on mesh
    dim i; `whole` the group over the whole mesh and each mesh position's rank in it (for
    an exchange step)."""
    mesh_shape, gshape = plan.mesh_shape, plan.global_shape
    for step in plan.steps:
        kind = step.kind
        if kind == "exchange":
            assert whole is not None, "an exchange needs the whole mesh's group: plan with exchange=False"
            group, ranks = whole
            routes = exchange_routes(mesh_shape, gshape, step.src_orders, step.orders, coordinate)
            local = comm.all_to_all_boxes(
                local, group, len(ranks), routes.out_shape,
                [(ranks[peer], box) for peer, box in routes.sends],
                [(ranks[peer], box) for peer, box in routes.recvs],
                routes.keep,
            )
            continue
        if kind == "all_reduce_mesh":
            assert whole is not None and isinstance(step.src, tuple) and isinstance(step.src[0], Partial)
            local = comm.all_reduce(local, whole[0], len(whole[1]), step.src[0].reduce_op)
            continue
        i, n, me = step.mesh_dim, mesh_shape[step.mesh_dim], coordinate[step.mesh_dim]
        if kind == "chunk":
            assert isinstance(step.dst, Shard)
            d = step.dst.dim
            start, length = chunk_range(local.size(d), n, me)
            local = local.narrow(d, start, length).contiguous()
        elif kind == "partialize":
            assert isinstance(step.dst, Partial)
            if step.dst.reduce_op == "sum" and me != 0:
                local = torch.zeros_like(local)
        elif n == 1:
            pass  # one rank on this mesh dim: its piece is already the whole, its term the total
        elif kind == "all_gather":
            assert isinstance(step.src, Shard)
            d = step.src.dim
            parent = _local_size(gshape[d], mesh_shape, step.orders[d], coordinate)
            local = comm.all_gather_cat(local, groups[i], n, d, _pieces(parent, n))
        elif kind == "all_to_all":
            assert isinstance(step.src, Shard) and isinstance(step.dst, Shard)
            d, e = step.src.dim, step.dst.dim
            parent_d = _local_size(gshape[d], mesh_shape, step.orders[d], coordinate)
            local = comm.all_to_all_cat(
                local, groups[i], n, split_dim=e, cat_dim=d,
                split_sizes=_pieces(local.size(e), n), cat_pieces=_pieces(parent_d, n), index=me,
            )
        elif kind == "all_reduce":
            assert isinstance(step.src, Partial)
            local = comm.all_reduce(local, groups[i], n, step.src.reduce_op)
        elif kind == "reduce_scatter":
            assert isinstance(step.src, Partial) and isinstance(step.dst, Shard)
            d = step.dst.dim
            local = comm.reduce_scatter_cat(
                local, groups[i], n, d, _pieces(local.size(d), n), me, step.src.reduce_op
            )
        else:  # pragma: no cover - the planner emits only the kinds above
            raise NotImplementedError(kind)
    return local

