"""Run a redistribute plan on this rank's local tensor, one step at a time, through `comm`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import _comm as comm
from .._layout import chunk_range
from .._placement import Partial, Shard
from ._exchange import exchange_routes
from ._planner import RedistributePlan, Step

__all__ = ["Call", "execute_plan", "single_collective"]


def _local_size(size: int, mesh_shape: Sequence[int], splitters: Sequence[int], coordinate: Sequence[int]) -> int:
    for m in splitters:
        size = chunk_range(size, mesh_shape[m], coordinate[m])[1]
    return size


def _pieces(parent: int, n: int) -> list[int]:
    return [chunk_range(parent, n, j)[1] for j in range(n)]


Call = tuple[str, tuple[Any, ...]]  # a `_comm` tensor collective's name and its arguments


def _collective(
    step: Step,
    local: torch.Tensor,
    plan: RedistributePlan,
    groups: Sequence[Any],
    coordinate: tuple[int, ...],
    whole: Optional[tuple[Any, Sequence[int]]],
) -> Optional[Call]:
    """The `_comm` collective that performs `step` on `local`, or None for a step without one."""
    mesh_shape, gshape = plan.mesh_shape, plan.global_shape
    kind = step.kind
    if kind == "exchange":
        assert whole is not None, "an exchange needs the whole mesh's group: plan with exchange=False"
        group, ranks = whole
        routes = exchange_routes(mesh_shape, gshape, step.src_orders, step.orders, coordinate)
        sends = [(ranks[peer], box) for peer, box in routes.sends]
        recvs = [(ranks[peer], box) for peer, box in routes.recvs]
        return "all_to_all_boxes", (local, group, len(ranks), routes.out_shape, sends, recvs, routes.keep)
    if kind == "all_reduce_mesh":
        assert whole is not None and isinstance(step.src, tuple) and isinstance(step.src[0], Partial)
        return "all_reduce", (local, whole[0], len(whole[1]), step.src[0].reduce_op)
    i = step.mesh_dim
    n, me = mesh_shape[i], coordinate[i]
    if kind in ("chunk", "partialize") or n == 1:
        return None  # local; on a mesh dim of one rank, its piece is already the whole and its term the total
    if kind == "all_gather":
        assert isinstance(step.src, Shard)
        d = step.src.dim
        parent = _local_size(gshape[d], mesh_shape, step.orders[d], coordinate)
        return "all_gather_cat", (local, groups[i], n, d, _pieces(parent, n))
    if kind == "all_to_all":
        assert isinstance(step.src, Shard) and isinstance(step.dst, Shard)
        d, e = step.src.dim, step.dst.dim
        parent_d = _local_size(gshape[d], mesh_shape, step.orders[d], coordinate)
        return "all_to_all_cat", (local, groups[i], n, e, d, _pieces(local.size(e), n), _pieces(parent_d, n), me)
    if kind == "all_reduce":
        assert isinstance(step.src, Partial)
        return "all_reduce", (local, groups[i], n, step.src.reduce_op)
    if kind == "reduce_scatter":
        assert isinstance(step.src, Partial) and isinstance(step.dst, Shard)
        d = step.dst.dim
        return "reduce_scatter_cat", (local, groups[i], n, d, _pieces(local.size(d), n), me, step.src.reduce_op)
    raise NotImplementedError(kind)  # pragma: no cover - the planner emits only the kinds above


def _local_step(step: Step, local: torch.Tensor, n: int, me: int) -> torch.Tensor:
    if step.kind == "chunk":
        assert isinstance(step.dst, Shard)
        d = step.dst.dim
        start, length = chunk_range(local.size(d), n, me)
        return local.narrow(d, start, length).contiguous()
    if step.kind == "partialize":
        assert isinstance(step.dst, Partial)
        if step.dst.reduce_op == "sum" and me != 0:
            return torch.zeros_like(local)
    return local


def execute_plan(
    local: torch.Tensor,
    plan: RedistributePlan,
    groups: Sequence[Any],
    coordinate: tuple[int, ...],
    whole: Optional[tuple[Any, Sequence[int]]] = None,
) -> torch.Tensor:
    """Apply `plan` to `local` (this rank's piece); `groups[i]` is this rank's group on mesh
    dim i; `whole` the group over the whole mesh and each mesh position's rank in it (for
    the steps over every mesh dim)."""
    for step in plan.steps:
        call = _collective(step, local, plan, groups, coordinate, whole)
        if call is None:
            i = step.mesh_dim
            local = _local_step(step, local, plan.mesh_shape[i], coordinate[i])
        else:
            name, args = call
            local = getattr(comm, name)(*args)  # looked up per call: a trace routes these names
    return local


def single_collective(
    local: torch.Tensor,
    plan: RedistributePlan,
    groups: Sequence[Any],
    coordinate: tuple[int, ...],
    whole: Optional[tuple[Any, Sequence[int]]] = None,
) -> Optional[Call]:
    """The one `_comm` collective a plan of exactly one such step makes; None for any other plan."""
    if len(plan.steps) != 1:
        return None
    return _collective(plan.steps[0], local, plan, groups, coordinate, whole)
