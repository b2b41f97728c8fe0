"""The plan between two specs: the one place a layout change of a DTensor is planned.

Propagation prices input moves with it and the tensor layer executes what it returns, so
the plan an op was priced with is the plan that runs. Whether the exchange step (one
all_to_all over the whole mesh) is available is the mesh's to say (`has_mesh_group`):
a 2-D sub-mesh without a group over its ranks plans without it.

A `_StridedShard` (a fused projection's parts, each split over a mesh dim) is planned in
parts (`plan_parts`): a rank's piece of it is exactly its `Shard` piece of the tensor with
the parts' pieces laid rank after rank, so a move that keeps every `_StridedShard` is the
`Shard` move of that tensor; any other move gathers the strided mesh dims, puts the parts
back in order (`unstride`), moves as usual, and keeps each rank's piece of every part of a
target `_StridedShard` (`stride`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .._layout import check_strided
from .._placement import Placement, Replicate, Shard, _StridedShard
from .._spec import DTensorSpec
from ._planner import RedistributePlan, plan_redistribute

__all__ = ["plan_between", "plan_parts", "StridedStep", "as_shard", "strided_dims"]


@dataclass(frozen=True)
class StridedStep:
    """`unstride` or `stride` the `_StridedShard` of tensor dim `tensor_dim` (`parts` parts)
    on mesh dim `mesh_dim` (`ways` ranks): a local step of a move (see `LocalStep`)."""

    kind: str
    mesh_dim: int
    tensor_dim: int
    parts: int
    ways: int


Part = Union[tuple[RedistributePlan, DTensorSpec], StridedStep]


def strided_dims(placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """The mesh dims that hold a `_StridedShard`."""
    return tuple(m for m, p in enumerate(placements) if isinstance(p, _StridedShard))


def as_shard(spec: DTensorSpec) -> DTensorSpec:
    """The spec with every `_StridedShard(d)` read as `Shard(d)`: the layout of the tensor
    whose parts' pieces lie rank after rank, where each rank's piece is the same."""
    return spec.with_placements(
        tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in spec.placements), spec.shard_order)


def _replicated_on(spec: DTensorSpec, dims: tuple[int, ...]) -> DTensorSpec:
    return spec.with_placements(
        tuple(Replicate() if m in dims else p for m, p in enumerate(spec.placements)), spec.shard_order)


def _plain(src: DTensorSpec, dst: DTensorSpec) -> RedistributePlan:
    mesh = src.mesh
    return plan_redistribute(
        tuple(mesh.shape), tuple(src.shape), src.dtype.itemsize, src.placements, dst.placements,
        src.shard_order, dst.shard_order, None, mesh.has_mesh_group,
    )


def plan_parts(src: DTensorSpec, dst: DTensorSpec) -> list[Part]:
    """The move from `src` to `dst` as plans (each with the spec it starts from) and
    strided local steps, in order (one plan when neither holds a `_StridedShard`)."""
    have, want = strided_dims(src.placements), strided_dims(dst.placements)
    if not have and not want:
        return [(_plain(src, dst), src)]
    mesh_shape = tuple(src.mesh.shape)
    for spec, dims in ((src, have), (dst, want)):
        for m in dims:
            check_strided(spec.shape, mesh_shape, spec.placements, m)
    if have == want and all(src.placements[m] == dst.placements[m] for m in have):
        return [(_plain(as_shard(src), as_shard(dst)), as_shard(src))]
    parts: list[Part] = []
    current = src
    if have:
        gathered = _replicated_on(as_shard(src), have)
        parts.append((_plain(as_shard(src), gathered), as_shard(src)))
        for m in have:
            p = src.placements[m]
            assert isinstance(p, _StridedShard)
            parts.append(StridedStep("unstride", m, p.dim, p.split_factor, mesh_shape[m]))
        current = _replicated_on(src, have)
    plain_dst = _replicated_on(dst, want)
    parts.append((_plain(current, plain_dst), current))
    for m in want:
        p = dst.placements[m]
        assert isinstance(p, _StridedShard)
        parts.append(StridedStep("stride", m, p.dim, p.split_factor, mesh_shape[m]))
    return parts


def plan_between(src: DTensorSpec, dst: DTensorSpec) -> RedistributePlan:
    """The cheapest plan from `src`'s layout to `dst`'s (same mesh, shape and dtype)."""
    parts = plan_parts(src, dst)
    if len(parts) == 1:
        only = parts[0]
        assert isinstance(only, tuple)
        plan = only[0]
        return plan if plan.src == src.placements and plan.dst == dst.placements else RedistributePlan(
            plan.mesh_shape, plan.global_shape, src.placements, dst.placements, plan.steps, plan.cost)
    plans = [p[0] for p in parts if isinstance(p, tuple)]
    return RedistributePlan(
        tuple(src.mesh.shape), tuple(src.shape), src.placements, dst.placements,
        tuple(s for plan in plans for s in plan.steps), sum(plan.cost for plan in plans))
