"""Redistribute across meshes: a DTensor on mesh A becomes one on mesh B.

Three stages, each on the ranks it concerns:
1. on A, the layout becomes plain (Partials reduced, strided splits undone) by an ordinary
   redistribute; of the plain layouts it could become, the one whose reduction plus
   crossing moves the fewest bytes through the busiest rank is taken (a Partial reduced by
   reduce_scatter to the split the target wants moves half an all_reduce's bytes and
   leaves less to send);
2. the crossing: every rank sends each B-rank the part of its piece that B-rank needs and
   does not hold (`_redistribute._cross`), point to point over a world-spanning group of their own (`_groups.crossing_group`), posted
   all at once (receives first) and then waited on;
3. on B, a strided target layout is made from its plain form.
Ranks in neither mesh do nothing. The move is built once per pair of specs and cached.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _comm as comm
from .._mesh import crossing_group
from .._mesh import CACHE_SIZES, PER_RANK_CACHES
from .._mesh import DeviceMesh
from .._ops import order_like
from .._placement import Partial, Placement, Replicate, Shard, _StridedShard
from .._redistribute import Box, CrossPlan, Routes, Side, cross_plan, plan_between
from .._spec import DTensorSpec
from ._plans import empty_piece
from ._redistribute import redistribute_local

__all__ = ["CrossMove", "cross_move", "cross_redistribute_local", "describe_cross", "move_local", "plan_cross", "ranks_of"]

TAG = 0x5C20  # the tag of every crossing message (ordered per pair of ranks, like the program)


@dataclass(frozen=True)
class CrossMove:
    """The whole move from `src` (on the mesh of ranks `src_ranks`, row-major) to `dst` (on
    `dst_ranks`): `before` is the plain layout on the source mesh that crosses, `after` its
    form on the target mesh, `plan` the crossing (the same on every rank)."""

    src: DTensorSpec
    dst: DTensorSpec
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    before: DTensorSpec
    after: DTensorSpec
    plan: CrossPlan

    def explain(self) -> str:
        lines = [describe_cross(self.src, self.dst, self.src_ranks, self.dst_ranks)]
        if self.before != self.src:
            lines.append("  on the source mesh first: " + plan_between(self.src, self.before).explain().replace("\n", "\n  "))
        lines.append(f"  crossing {self.before.layout_str()} -> {self.after.layout_str()}:")
        lines.append(self.plan.explain())
        if self.after != self.dst:
            lines.append("  on the target mesh then: " + plan_between(self.after, self.dst).explain().replace("\n", "\n  "))
        return "\n".join(lines)


def ranks_of(mesh: Any) -> tuple[int, ...]:
    """A DeviceMesh's ranks, row-major."""
    return tuple(mesh.mesh.flatten().tolist())


def describe_cross(src: DTensorSpec, dst: DTensorSpec, src_ranks: Optional[tuple[int, ...]] = None,
                   dst_ranks: Optional[tuple[int, ...]] = None) -> str:
    """'redistribute (S(0)) on mesh (4,) of ranks [0, 1, 2, 3] -> (R) on mesh (2,) of ranks [2, 3] of a [8, 6] tensor'."""
    def words(mesh: Any, ranks: Optional[tuple[int, ...]]) -> str:
        names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
        return f"mesh {tuple(mesh.shape)}{names} of ranks {list(ranks if ranks is not None else ranks_of(mesh))}"

    return (f"redistribute {src.layout_str()} on {words(src.mesh, src_ranks)} -> {dst.layout_str()} on "
            f"{words(dst.mesh, dst_ranks)} of a {list(src.shape)} tensor")


def _plain(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


def _spec_with(spec: DTensorSpec, placements: tuple[Placement, ...]) -> DTensorSpec:
    """`spec` in `placements`, keeping its split order where the splits are the same."""
    return spec if placements == spec.placements else spec.with_placements(placements, order_like(placements, spec))


def _side(spec: DTensorSpec, ranks: tuple[int, ...]) -> Side:
    found = spec.split_orders()
    return Side(ranks, tuple(spec.mesh.shape), tuple(found.get(d, ()) for d in range(spec.ndim)))


def _candidates(spec: DTensorSpec) -> list[DTensorSpec]:
    """The plain layouts on `spec`'s mesh that `spec` can become by reducing its Partials
    (each to Replicate, or by reduce_scatter to a split of any tensor dim)."""
    base = _plain(spec.placements)
    partial = [m for m, p in enumerate(base) if isinstance(p, Partial)]
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(spec.ndim)]
    out = []
    for combo in itertools.product(choices, repeat=len(partial)):
        placements = list(base)
        for m, p in zip(partial, combo):
            placements[m] = p
        out.append(_spec_with(spec, tuple(placements)))
    return out


def plan_cross(src: DTensorSpec, src_ranks: tuple[int, ...], dst: DTensorSpec, dst_ranks: tuple[int, ...]) -> CrossMove:
    """The move from `src` on the mesh of `src_ranks` to `dst` on the mesh of `dst_ranks` (pure:
    the specs' meshes may be abstract). Of the plain layouts the source can become, the one
    whose reduction plus crossing moves the fewest bytes through the busiest rank wins."""
    for spec, ranks in ((src, src_ranks), (dst, dst_ranks)):
        if len(ranks) != spec.mesh.size() or len(set(ranks)) != len(ranks):
            raise ValueError(f"mesh {tuple(spec.mesh.shape)} needs {spec.mesh.size()} distinct ranks, got {list(ranks)}")
    if src.shape != dst.shape:
        raise ValueError(f"{describe_cross(src, dst, src_ranks, dst_ranks)}: the global shapes differ "
                         f"({list(src.shape)} vs {list(dst.shape)})")
    after = _spec_with(dst, _plain(dst.placements))
    if after.has_partial():
        raise ValueError(f"{describe_cross(src, dst, src_ranks, dst_ranks)}: Partial is produced by ops, not "
                         "requested as a target on another mesh; use Replicate() or Shard(dim)")
    itemsize = torch.empty((), dtype=dst.dtype).element_size()
    best = None
    for before in _candidates(src):
        plan = cross_plan(tuple(src.shape), itemsize, _side(before, src_ranks), _side(after, dst_ranks))
        score = (plan_between(src, before).bytes + max(plan.received().values(), default=0),
                 sum(plan.received().values()))
        if best is None or score < best[0]:
            best = (score, before, plan)
    assert best is not None
    return CrossMove(src, dst, src_ranks, dst_ranks, best[1], after, best[2])


def cross_move(src: DTensorSpec, dst: DTensorSpec) -> CrossMove:
    """The (cached) move from `src` on one DeviceMesh to `dst` on another."""
    key = (src, dst)
    found = _MOVES.get(key)
    if found is None:
        for spec in (src, dst):
            if not isinstance(spec.mesh, DeviceMesh):
                raise TypeError(f"moving across meshes needs DeviceMeshes, got a spec on {spec.mesh!r}")
        found = _MOVES[key] = plan_cross(src, ranks_of(src.mesh), dst, ranks_of(dst.mesh))
    return found


_MOVES: dict[tuple[DTensorSpec, DTensorSpec], CrossMove] = {}
PER_RANK_CACHES.append(_MOVES.clear)
CACHE_SIZES["cross-mesh moves"] = _MOVES.__len__
_ROUTES: dict[tuple[DTensorSpec, DTensorSpec], Routes] = {}
PER_RANK_CACHES.append(_ROUTES.clear)
CACHE_SIZES["cross-mesh routes"] = _ROUTES.__len__


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (start, length) in enumerate(box):
        t = t.narrow(d, start, length)
    return t


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(length for _, length in box)


def _check_peers(routes: Routes, what: str, device: torch.device) -> None:
    """SHARDWISE_CHECK: this rank and each of its peers swap a digest of the move (fixed size,
    so the check cannot itself mismatch); a peer running another move is a CollectiveError
    naming both, before any piece of a wrong size is sent."""
    group, me = crossing_group(), dist.get_rank()
    digest = int.from_bytes(hashlib.blake2b(what.encode(), digest_size=8).digest(), "big") >> 1
    peers = sorted({p for p, _ in routes.sends} | {p for p, _ in routes.recvs})
    theirs = {p: torch.empty(1, dtype=torch.int64, device=device) for p in peers}
    label = f"the SHARDWISE_CHECK digest of {what}"
    works = [comm.irecv(theirs[p], p, group, tag=TAG + 1, label=label) for p in peers]
    works += [comm.isend(torch.tensor([digest], device=device), p, group, tag=TAG + 1, label=label) for p in peers]
    for work in works:
        work.wait()
    other = [p for p in peers if int(theirs[p]) != digest]
    if other:
        ranks = ", ".join(map(str, other))
        raise comm.CollectiveError(
            [what], me, ranks=sorted({me, *other}),
            elsewhere={p: "another move between meshes" for p in other},
            reason=f"the ranks disagree (SHARDWISE_CHECK): rank {me} issues {what}; rank{'s' if len(other) > 1 else ''} "
                   f"{ranks} issue{'s' if len(other) == 1 else ''} another move between meshes (its shape, dtype, "
                   f"layouts or meshes differ)")


def _cross(piece: torch.Tensor, routes: Routes, out_shape: Optional[tuple[int, ...]], label: str) -> Optional[torch.Tensor]:
    """Post every receive, then every send, of this rank's routes; wait; assemble the target
    piece of `out_shape` (None on a rank outside the target mesh)."""
    world = crossing_group()
    arrived = []
    for peer, box in routes.recvs:
        buffer = torch.empty(_shape(box), dtype=piece.dtype, device=piece.device)
        arrived.append((box, comm.irecv(buffer, peer, world, tag=TAG, label=f"{label} from rank {peer}")))
    sent = [comm.isend(_region(piece, box).contiguous(), peer, world, tag=TAG, label=f"{label} to rank {peer}")
            for peer, box in routes.sends]
    out = None if out_shape is None else piece.new_empty(out_shape)
    if out is not None and routes.keep is not None:
        _region(out, routes.keep[1]).copy_(_region(piece, routes.keep[0]))
    for box, work in arrived:
        received = work.wait()
        if out is not None:
            _region(out, box).copy_(received)
    for work in sent:
        work.wait()
    return out


def cross_redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's piece of `dst` (on another mesh than `src`), from its piece of `src`."""
    move = cross_move(src, dst)
    in_src = src.mesh.get_coordinate() is not None  # type: ignore[attr-defined]
    coordinate = dst.mesh.get_coordinate()  # type: ignore[attr-defined]
    if not in_src and coordinate is None:
        return empty_piece(dst.tensor_meta, local.device)
    try:
        piece = redistribute_local(local, src, move.before) if in_src else local.new_empty((0,))
        out_shape = None if coordinate is None else move.after.local_shape_and_offset(coordinate)[0]
        routes = _ROUTES.get((src, dst))
        if routes is None:  # this rank's part of the plan, read off once per move
            routes = _ROUTES[(src, dst)] = move.plan.routes(dist.get_rank())
        if comm.checking():
            _check_peers(routes, f"{describe_cross(src, dst)} ({str(dst.dtype).removeprefix('torch.')})", local.device)
        out = _cross(piece, routes, out_shape, "a piece of the moved tensor")  # the error adds which move
        if out is None:
            return empty_piece(dst.tensor_meta, local.device)
        return redistribute_local(out, move.after, dst)
    except comm.CollectiveError as exc:
        raise exc.add_operation(describe_cross(src, dst))


def move_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's piece of `dst` from its piece of `src`, on the same mesh or across meshes."""
    if src.mesh == dst.mesh:
        return redistribute_local(local, src, dst)
    return cross_redistribute_local(local, src, dst)
