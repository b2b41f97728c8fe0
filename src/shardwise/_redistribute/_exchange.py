"""The exchange step: one all_to_all over the whole mesh, from one unreduced layout to another.

Per-mesh-dim steps change one mesh dim at a time, so a layout whose splits trade places
across mesh dims goes through an intermediate layout and moves data twice:
`(S(0), S(1)) -> (S(1), S(0))` on a (2, 2) mesh is an all_gather and an all_to_all
(2 pieces of a quarter received per rank), although two of the four ranks already hold
their target piece and the other two only need to swap theirs (one quarter).

Without Partials every rank's piece is a box of global indices (nested `torch.chunk`
intervals, one per tensor dim), before and after. So each rank can receive exactly the
part of its target box it does not hold, straight from a rank that holds it, in one
all_to_all over the mesh: the lower bound on bytes received. Who sends what:

- a *source class* is the set of ranks holding one source box: the ranks that agree on
  the coordinates of every mesh dim that splits the source (the others replicate it);
- rank r takes the part of its target box inside its own class's box from its own piece,
  and the part inside another class's box from the member of that class that agrees with
  r on the replicating mesh dims (so replicas share the sending).

Everything here is pure: boxes, costs and routes from the mesh shape, the global shape,
the two layouts and a coordinate.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .._layout import chunk_range
from .._placement import Placement, _StridedShard

__all__ = ["Box", "Routes", "box_of", "piece_boxes", "exchange_bytes", "exchange_routes", "overlap", "scatter_routes", "MAX_EXCHANGE_RANKS"]

Box = tuple[tuple[int, int], ...]  # per tensor dim: (start, length) in global indices
Orders = tuple[tuple[int, ...], ...]  # per tensor dim: splitting mesh dims, outermost first

# Planning an exchange visits every rank; beyond this mesh size the planner leaves it out.
MAX_EXCHANGE_RANKS = 1024


def box_of(global_shape: Sequence[int], mesh_shape: Sequence[int], orders: Orders, coordinate: Sequence[int]) -> Box:
    """The global indices the rank at `coordinate` holds under a layout with split `orders`."""
    out = []
    for size, splitters in zip(global_shape, orders):
        start, length = 0, size
        for m in splitters:
            offset, length = chunk_range(length, mesh_shape[m], coordinate[m])
            start += offset
        out.append((start, length))
    return tuple(out)


def piece_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], orders: Orders,
    coordinate: Sequence[int],
) -> list[tuple[Box, Box]]:
    """The global boxes the rank at `coordinate` holds, each with where it lies in the rank's
    piece (a box of local indices): one box, the whole piece, unless a `_StridedShard` splits a
    dim into parts, whose pieces lie side by side in the rank's piece (one box per part)."""
    box = box_of(global_shape, mesh_shape, orders, coordinate)
    per_dim: list[list[tuple[tuple[int, int], tuple[int, int]]]] = [[(b, (0, b[1]))] for b in box]
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            part = global_shape[p.dim] // p.split_factor
            start, length = chunk_range(part, mesh_shape[m], coordinate[m])
            per_dim[p.dim] = [((j * part + start, length), (j * length, length)) for j in range(p.split_factor)]
    return [(tuple(g for g, _ in combo), tuple(loc for _, loc in combo)) for combo in itertools.product(*per_dim)]


def overlap(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or None when they do not meet."""
    out = []
    for (sa, la), (sb, lb) in zip(a, b):
        start, stop = max(sa, sb), min(sa + la, sb + lb)
        if stop <= start:
            return None
        out.append((start, stop - start))
    return tuple(out)


def _volume(box: Optional[Box]) -> int:
    return 0 if box is None else math.prod(length for _, length in box)


def _relative(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of a tensor holding `origin`."""
    return tuple((s - o, length) for (s, length), (o, _) in zip(box, origin))


@functools.lru_cache(maxsize=4096)
def exchange_bytes(
    mesh_shape: tuple[int, ...], global_shape: tuple[int, ...], itemsize: int, src: Orders, dst: Orders
) -> float:
    """Bytes the busiest rank receives in an exchange from split `src` to split `dst`:
    its target box less what it already holds."""
    worst = 0
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        target = box_of(global_shape, mesh_shape, dst, coordinate)
        have = box_of(global_shape, mesh_shape, src, coordinate)
        worst = max(worst, _volume(target) - _volume(overlap(target, have)))
    return float(worst * itemsize)


@dataclass(frozen=True)
class Routes:
    """One rank's part of an exchange; peers are flat indices into the mesh (row-major)."""

    out_shape: tuple[int, ...]
    sends: tuple[tuple[int, Box], ...]  # (peer, box within this rank's source piece)
    recvs: tuple[tuple[int, Box], ...]  # (peer, box within this rank's target piece)
    keep: Optional[tuple[Box, Box]]  # (box within the source piece, the same within the target piece)


def _flat(coordinate: Sequence[int], mesh_shape: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coordinate, mesh_shape):
        index = index * n + c
    return index


@functools.lru_cache(maxsize=4096)
def exchange_routes(
    mesh_shape: tuple[int, ...], global_shape: tuple[int, ...], src: Orders, dst: Orders, coordinate: tuple[int, ...]
) -> Routes:
    """What the rank at `coordinate` sends, receives and keeps to go from split `src` to `dst`."""
    splitting = sorted({m for ms in src for m in ms})
    mine_src = box_of(global_shape, mesh_shape, src, coordinate)
    mine_dst = box_of(global_shape, mesh_shape, dst, coordinate)

    def same_class(a: Sequence[int], b: Sequence[int]) -> bool:
        return all(a[m] == b[m] for m in splitting)

    def same_replica(a: Sequence[int], b: Sequence[int]) -> bool:
        return all(a[m] == b[m] for m in range(len(mesh_shape)) if m not in splitting)

    sends, recvs = [], []
    for peer in itertools.product(*(range(n) for n in mesh_shape)):
        if same_class(peer, coordinate):
            continue
        if same_replica(peer, coordinate):
            # the peer takes from me what it needs of my class's box, and I from it what I need of its
            give = overlap(mine_src, box_of(global_shape, mesh_shape, dst, peer))
            if give is not None:
                sends.append((_flat(peer, mesh_shape), _relative(give, mine_src)))
            take = overlap(box_of(global_shape, mesh_shape, src, peer), mine_dst)
            if take is not None:
                recvs.append((_flat(peer, mesh_shape), _relative(take, mine_dst)))
    kept = overlap(mine_src, mine_dst)
    keep = None if kept is None else (_relative(kept, mine_src), _relative(kept, mine_dst))
    return Routes(tuple(length for _, length in mine_dst), tuple(sends), tuple(recvs), keep)


@functools.lru_cache(maxsize=4096)
def scatter_routes(
    mesh_shape: tuple[int, ...], global_shape: tuple[int, ...], dst: Orders, src: tuple[int, ...], coordinate: tuple[int, ...]
) -> Routes:
    """What the rank at `coordinate` sends, receives and keeps when the rank at `src` holds the
    whole tensor and every rank needs its piece of split `dst` (`distribute_tensor`): each rank
    receives its piece and nothing else, from `src`, in one all_to_all.

    >>> r = scatter_routes((4,), (10, 3), ((0,), ()), (0,), (2,))
    >>> r.out_shape, r.sends, r.recvs  # rows 6..8 of 10 (torch.chunk sizes 3, 3, 3, 1)
    ((3, 3), (), ((0, ((0, 3), (0, 3))),))
    >>> [peer for peer, _ in scatter_routes((4,), (10, 3), ((0,), ()), (0,), (0,)).sends]
    [1, 2, 3]
    """
    mine = box_of(global_shape, mesh_shape, dst, coordinate)
    out_shape = tuple(length for _, length in mine)
    whole = tuple((0, length) for length in out_shape)
    if tuple(coordinate) != tuple(src):
        return Routes(out_shape, (), ((_flat(src, mesh_shape), whole),) if _volume(mine) else (), None)
    sends = []
    for other in itertools.product(*(range(n) for n in mesh_shape)):
        box = box_of(global_shape, mesh_shape, dst, other)
        if other != tuple(src) and _volume(box):
            sends.append((_flat(other, mesh_shape), box))
    return Routes(out_shape, tuple(sends), (), (mine, whole))
