"""Moving a tensor from one mesh to another: who sends which box to whom (pure).

Both ends are plain layouts (Shard / Replicate with split orders; Partials are reduced and
strided splits undone on their own mesh first, see `_tensor._cross`). Then every rank of
either mesh holds one box of global indices, or nothing. A rank of the target mesh needs
its target box; what of it lies in the box it already holds on the source mesh (the same
process in both meshes) it keeps, and every other part comes from one holder of the
source box it lies in. Source boxes do not overlap (a plain layout tiles the tensor; its
replicas hold the same box), so each rank receives exactly its target box less what it
holds: the lower bound. Among a source box's replicas, the receivers that need it are
dealt out in turn, so replicas share the sending.

Ranks are global (process group ranks of the world), the meshes may be disjoint, overlap,
or be the same processes in another shape or order; a rank in neither does nothing.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional

from ._exchange import Box, Routes, box_of, overlap

__all__ = ["Side", "CrossPlan", "cross_plan"]

Orders = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Side:
    """One end of a move: the mesh's global ranks (row-major), its shape, and the split orders
    of a plain layout on it (per tensor dim, the mesh dims splitting it, outermost first)."""

    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    orders: Orders

    def boxes(self, global_shape: tuple[int, ...]) -> dict[int, Box]:
        """Each rank's box."""
        coordinates = itertools.product(*(range(n) for n in self.mesh_shape))
        return {rank: box_of(global_shape, self.mesh_shape, self.orders, c) for rank, c in zip(self.ranks, coordinates)}


def _volume(box: Optional[Box]) -> int:
    return 0 if box is None else math.prod(length for _, length in box)


def _relative(box: Box, origin: Box) -> Box:
    return tuple((s - o, length) for (s, length), (o, _) in zip(box, origin))


@dataclass(frozen=True)
class CrossPlan:
    """Every transfer of a move, as (sender, receiver, global box); the same on every rank."""

    global_shape: tuple[int, ...]
    itemsize: int
    src: Side
    dst: Side
    transfers: tuple[tuple[int, int, Box], ...]

    @functools.cached_property
    def _boxes(self) -> tuple[dict[int, Box], dict[int, Box]]:
        return self.src.boxes(self.global_shape), self.dst.boxes(self.global_shape)

    def routes(self, rank: int) -> Routes:
        """What `rank` sends (boxes of its source piece), receives (boxes of its target piece)
        and keeps; peers are global ranks. `out_shape` is () for a rank outside the target mesh."""
        have, want = self._boxes[0].get(rank), self._boxes[1].get(rank)
        sends = tuple((r, _relative(box, have)) for s, r, box in self.transfers if s == rank and have is not None)
        recvs = tuple((s, _relative(box, want)) for s, r, box in self.transfers if r == rank and want is not None)
        kept = overlap(have, want) if have is not None and want is not None else None
        keep = None if kept is None or not _volume(kept) else (_relative(kept, have), _relative(kept, want))  # type: ignore[arg-type]
        out_shape = () if want is None else tuple(length for _, length in want)
        return Routes(out_shape, sends, recvs, keep)

    def received(self) -> dict[int, int]:
        """Bytes each rank receives."""
        out = dict.fromkeys(sorted(set(self.src.ranks) | set(self.dst.ranks)), 0)
        for _, r, box in self.transfers:
            out[r] += _volume(box) * self.itemsize
        return out

    def sent(self) -> dict[int, int]:
        """Bytes each rank sends."""
        out = dict.fromkeys(sorted(set(self.src.ranks) | set(self.dst.ranks)), 0)
        for s, _, box in self.transfers:
            out[s] += _volume(box) * self.itemsize
        return out

    def lower_bound(self) -> dict[int, int]:
        """Bytes each rank must receive at least: its target box less what it holds already."""
        have, want = self._boxes
        out = dict.fromkeys(sorted(set(self.src.ranks) | set(self.dst.ranks)), 0)
        for rank, box in want.items():
            held = have.get(rank)
            out[rank] = (_volume(box) - _volume(overlap(box, held) if held is not None else None)) * self.itemsize
        return out

    def explain(self) -> str:
        received, sent, bound = self.received(), self.sent(), self.lower_bound()
        lines = []
        for rank in received:
            peers = sorted({s for s, r, _ in self.transfers if r == rank})
            source = f" from rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}" if peers else ""
            lines.append(f"  rank {rank}: receives {received[rank]} B{source} (lower bound {bound[rank]} B), "
                         f"sends {sent[rank]} B")
        lines.append(f"  total: {sum(received.values())} B moved in {len(self.transfers)} messages; busiest rank "
                     f"receives {max(received.values(), default=0)} B")
        return "\n".join(lines)


@functools.lru_cache(maxsize=1024)
def cross_plan(global_shape: tuple[int, ...], itemsize: int, src: Side, dst: Side) -> CrossPlan:
    """The transfers that move a tensor of `global_shape` from `src` to `dst`.

    >>> a = Side((0, 1), (2,), ((0,), ()))          # rows split over ranks 0, 1
    >>> b = Side((2, 3), (2,), ((), (0,)))          # columns split over ranks 2, 3
    >>> plan = cross_plan((4, 4), 4, a, b)
    >>> plan.transfers[:2]  # rank 2 needs columns 0..1 of every row: rows 0..1 from rank 0, 2..3 from rank 1
    ((0, 2, ((0, 2), (0, 2))), (1, 2, ((2, 2), (0, 2))))
    """
    have, want = src.boxes(global_shape), dst.boxes(global_shape)
    holders: dict[Box, list[int]] = {}
    for rank, box in have.items():
        if _volume(box):
            holders.setdefault(box, []).append(rank)
    dealt = dict.fromkeys(holders, 0)
    transfers = []
    for rank, target in want.items():
        mine = have.get(rank)
        for box, ranks in holders.items():
            if box == mine:
                continue  # kept: this process holds it on the source mesh
            part = overlap(box, target)
            if part is None or not _volume(part):
                continue
            sender = ranks[dealt[box] % len(ranks)]
            dealt[box] += 1
            transfers.append((sender, rank, part))
    return CrossPlan(global_shape, itemsize, src, dst, tuple(transfers))
