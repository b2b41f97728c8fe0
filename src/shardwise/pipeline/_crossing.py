"""Stage boundaries between tensor-parallel stages of different sizes: what crosses, and how.

When stage `s` runs on a tp row of `a` ranks and stage `s + 1` on one of `b != a` ranks, a
rank of one has no "matching" rank in the other; a message's tensors then move by the
cross-mesh planner (`_redistribute._cross`) from the sending row to the receiving row:

- a DTensor on the sender's row, in placements `p`, arrives as a DTensor on the receiving
  row in `landing(p)`: the same splits (a Partial is reduced on the sender's row first, as
  cheaply as the planner finds; a strided split arrives plain);
- a plain tensor is the same on every rank of its row (a stage's ops keep it replicated),
  so it moves as Replicate and arrives plain on every receiving rank.

Every receiving rank gets exactly its target piece less nothing (the rows are disjoint),
from the senders the planner deals it to, so replicas share the sending. Both ends plan
from the message's metadata alone, on abstract meshes, so they agree without talking.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._layout import contiguous_strides
from .._mesh import AbstractMesh
from .._placement import Partial, Placement, Replicate, Shard, _StridedShard
from .._redistribute._exchange import Routes
from .._spec import DTensorSpec, TensorMeta
from .._tensor._cross import CrossMove, plan_cross

__all__ = ["Crossing", "crossing", "landing", "spec_on"]


def landing(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The placements a DTensor in `placements` arrives in on the next stage's row."""
    return tuple(Replicate() if isinstance(p, Partial) else Shard(p.dim) if isinstance(p, _StridedShard) else p
                 for p in placements)


def spec_on(mesh: AbstractMesh, placements: tuple[Placement, ...], shape: tuple[int, ...], dtype: torch.dtype,
            shard_order: Any = ()) -> DTensorSpec:
    return DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype), shard_order)


class Crossing:
    """One tensor's move from row `src_ranks` to row `dst_ranks`: the plan, and this rank's part."""

    def __init__(self, move: CrossMove, routes: Routes) -> None:
        self.move, self.routes = move, routes

    @property
    def before(self) -> tuple[tuple[Placement, ...], Any]:
        """The layout, on the sending row, in which the tensor crosses (Partials reduced)."""
        return self.move.before.placements, self.move.before.shard_order


@functools.lru_cache(maxsize=4096)
def crossing(shape: tuple[int, ...], dtype: torch.dtype, placements: Optional[tuple[Placement, ...]], shard_order: Any,
             src_ranks: tuple[int, ...], dst_ranks: tuple[int, ...]) -> Crossing:
    """The move of a tensor of `shape` in `placements` (None: a plain tensor) on the row of
    `src_ranks` to the row of `dst_ranks`, planned on abstract meshes (the same on both ends)."""
    src_mesh, dst_mesh = AbstractMesh((len(src_ranks),)), AbstractMesh((len(dst_ranks),))
    given = (Replicate(),) if placements is None else placements
    src = spec_on(src_mesh, given, shape, dtype, shard_order if placements is not None else ())
    dst = spec_on(dst_mesh, landing(given), shape, dtype)
    move = plan_cross(src, src_ranks, dst, dst_ranks)
    return Crossing(move, move.plan.routes(dist.get_rank()))
