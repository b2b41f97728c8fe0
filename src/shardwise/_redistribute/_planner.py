"""The redistribute planner: the cheapest list of collectives from one layout to another.

Pure: it sees the mesh shape, the global shape and the two layouts, never a process.

A *state* is a layout: one placement per mesh dim plus, for each tensor dim, the mesh
dims that split it in split order (outermost first). A *step* changes the placement of
one mesh dim:

| step | from -> to on mesh dim i | condition | bytes received per rank |
|---|---|---|---|
| all_gather | S(d) -> R | i splits d innermost | (n-1) * piece |
| all_to_all | S(d) -> S(e) | i splits d innermost; i becomes e's innermost | (n-1) * (local / n along e) |
| all_reduce | P(op) -> R | | 2(n-1)/n * local |
| reduce_scatter | P(op) -> S(d) | i becomes d's innermost | (n-1) * output piece |
| chunk | R -> S(d) | i becomes d's innermost | 0 |
| partialize | R -> P(op) | only towards a target with P(op) on i | 0 |
| exchange | any -> the target (Partials as R), every mesh dim at once | no Partial before |
| all_reduce_mesh | P(op) on every mesh dim -> R on every mesh dim | one op | 2(N-1)/N * local, N ranks in the mesh | target piece less what the rank holds (see `_exchange`) |

Several Partial mesh dims mean the global value is reduced innermost mesh dim first; a
max/min Partial is reduced only after the later Partial mesh dims it does not commute with.

The cost of a step is its bytes divided by the mesh dim's relative bandwidth (default 1
for every mesh dim), with the sizes those of the largest piece (`torch.chunk` puts it on
the first rank; gloo collectives pad to it). The plan is a shortest path (Dijkstra) over
states; ties go to fewer steps. Only the innermost splitter of a tensor dim can leave it,
so layouts like `(S(0), S(0))` are undone inside-out, and a cheaper detour through
another tensor dim (an all_to_all) is found when one exists. The exchange, one all_to_all
over the whole mesh, costs its exact bytes over the slowest mesh dim's bandwidth; on a tie
the per-mesh-dim collectives win.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from .._layout import ShardOrder, format_placements, split_orders
from .._placement import Partial, Placement, Replicate, Shard
from ._exchange import MAX_EXCHANGE_RANKS, exchange_bytes

__all__ = ["Step", "RedistributePlan", "plan_redistribute", "COST_MODEL"]

COST_MODEL = (
    "bytes received per rank, ring lower bounds: all_gather (n-1)*piece, all_to_all (n-1)*(local/n), "
    "all_reduce 2(n-1)/n*local, reduce_scatter (n-1)*piece; pieces at their largest (uneven sizes padded); "
    "each step's bytes divided by its mesh dim's relative bandwidth"
)

Orders = tuple[tuple[int, ...], ...]  # per tensor dim: splitting mesh dims, outermost first
State = tuple[tuple[Placement, ...], Orders]


@dataclass(frozen=True)
class Step:
    """One collective (or local op) on one mesh dim; an exchange works on every mesh dim
    (`mesh_dim` -1, `src`/`dst` the whole placements before/after)."""

    kind: str
    mesh_dim: int
    src: Union[Placement, tuple[Placement, ...]]
    dst: Union[Placement, tuple[Placement, ...]]
    bytes: float
    placements: tuple[Placement, ...]  # after the step
    orders: Orders  # after the step
    src_orders: Orders = ()  # an exchange's orders before it (the other steps derive theirs)

    @property
    def shard_order(self) -> ShardOrder:
        return orders_to_shard_order(self.placements, self.orders)

    def __str__(self) -> str:
        if self.mesh_dim == -1:
            assert isinstance(self.src, tuple) and isinstance(self.dst, tuple)
            how = "exchange, one all_to_all" if self.kind == "exchange" else "one all_reduce over the mesh"
            return (f"every mesh dim: {format_placements(self.src)} -> {format_placements(self.dst)} "
                    f"by {how} ({_fmt_bytes(self.bytes)})")
        return f"mesh dim {self.mesh_dim}: {self.src} -> {self.dst} by {self.kind} ({_fmt_bytes(self.bytes)})"


@dataclass(frozen=True)
class RedistributePlan:
    """Ordered steps from `src` to `dst` with their total bytes on the wire per rank."""

    mesh_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[Step, ...]
    cost: float

    @property
    def bytes(self) -> int:
        return int(round(sum(s.bytes for s in self.steps)))

    def explain(self) -> str:
        lines = [
            f"redistribute {tuple(self.global_shape)} on mesh {self.mesh_shape}: "
            f"{format_placements(self.src)} -> {format_placements(self.dst)}"
        ]
        if not self.steps:
            lines.append("  nothing to do: the layouts are equal")
        for k, s in enumerate(self.steps, 1):
            lines.append(f"  {k}. {s}  -> {format_placements(s.placements)}")
        lines.append(f"  total: {_fmt_bytes(self.bytes)} received per rank")
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    return f"{int(round(n))} B"


def orders_of(placements: Sequence[Placement], shard_order: ShardOrder, ndim: int) -> Orders:
    found = split_orders(placements, shard_order)
    return tuple(found.get(d, ()) for d in range(ndim))


def orders_to_shard_order(placements: Sequence[Placement], orders: Orders) -> ShardOrder:
    return tuple((d, ms) for d, ms in enumerate(orders) if list(ms) != sorted(ms))


def _local_numel(global_shape: Sequence[int], mesh_shape: Sequence[int], orders: Orders) -> int:
    numel = 1
    for size, ms in zip(global_shape, orders):
        for m in ms:
            size = -(-size // mesh_shape[m])
        numel *= size
    return numel


def _edges(
    state: State,
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    itemsize: int,
    dst: tuple[Placement, ...],
) -> list[tuple[str, int, Placement, float, State]]:
    placements, orders = state
    local = _local_numel(global_shape, mesh_shape, orders) * itemsize
    ndim = len(global_shape)
    out: list[tuple[str, int, Placement, float, State]] = []

    def moved(i: int, new: Placement, new_orders: list[tuple[int, ...]]) -> State:
        pl = list(placements)
        pl[i] = new
        return tuple(pl), tuple(new_orders)

    for i, p in enumerate(placements):
        n = mesh_shape[i]
        if isinstance(p, Partial):
            if not _reducible(placements, i):
                continue
            out.append(("all_reduce", i, Replicate(), 2 * (n - 1) / n * local, moved(i, Replicate(), list(orders))))
            for d in range(ndim):
                o = list(orders)
                o[d] = o[d] + (i,)
                after = _local_numel(global_shape, mesh_shape, tuple(o)) * itemsize
                out.append(("reduce_scatter", i, Shard(d), (n - 1) * after, moved(i, Shard(d), o)))
        elif isinstance(p, Shard):
            d = p.dim
            if orders[d][-1] != i:
                continue
            base = list(orders)
            base[d] = base[d][:-1]
            out.append(("all_gather", i, Replicate(), (n - 1) * local, moved(i, Replicate(), base)))
            for e in range(ndim):
                if e != d:
                    o = list(base)
                    o[e] = o[e] + (i,)
                    # n-1 pieces of the local tensor split n ways along e, at their largest
                    size_e = _local_numel(global_shape[e : e + 1], mesh_shape, orders[e : e + 1])
                    piece = local // max(size_e, 1) * -(-size_e // n)
                    out.append(("all_to_all", i, Shard(e), float((n - 1) * piece), moved(i, Shard(e), o)))
        else:
            for d in range(ndim):
                o = list(orders)
                o[d] = o[d] + (i,)
                out.append(("chunk", i, Shard(d), 0.0, moved(i, Shard(d), o)))
            if isinstance(dst[i], Partial):
                out.append(("partialize", i, dst[i], 0.0, moved(i, dst[i], list(orders))))
    return out


def _one_reduction(placements: tuple[Placement, ...]) -> bool:
    """Every mesh dim Partial with the same reduce op."""
    first = placements[0]
    return isinstance(first, Partial) and all(p == first for p in placements)


def _commute(a: str, b: str) -> bool:
    return a == b or {a, b} <= {"sum", "avg"}


def _reducible(placements: tuple[Placement, ...], i: int) -> bool:
    """Whether the Partial on mesh dim i may be reduced now.

    Several Partial mesh dims reduce innermost (last mesh dim) first; sum and avg commute with
    each other, but max/min do not commute with anything else, so such a mesh dim waits until
    the later, non-commuting Partial mesh dims are reduced.
    """
    op = placements[i]
    assert isinstance(op, Partial)
    return all(
        _commute(op.reduce_op, q.reduce_op) for q in placements[i + 1 :] if isinstance(q, Partial)
    )


_EXCHANGE_RANK = 1000


@functools.lru_cache(maxsize=8192)
def plan_redistribute(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    itemsize: int,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    src_order: ShardOrder = (),
    dst_order: ShardOrder = (),
    bandwidth: Optional[tuple[float, ...]] = None,
    exchange: bool = True,
) -> RedistributePlan:
    """Cheapest plan from layout (src, src_order) to (dst, dst_order); inputs are normalized.

    >>> plan = plan_redistribute((4,), (8, 8), 4, (Shard(0),), (Shard(1),))
    >>> [s.kind for s in plan.steps], plan.bytes  # (n-1)/n of the 64-element local piece
    (['all_to_all'], 48)
    """
    ndim = len(global_shape)
    start: State = (src, orders_of(src, src_order, ndim))
    goal: State = (dst, orders_of(dst, dst_order, ndim))
    weights = bandwidth or (1.0,) * len(mesh_shape)
    tie = itertools.count()
    exchange = exchange and len(mesh_shape) > 1 and math.prod(mesh_shape) <= MAX_EXCHANGE_RANKS
    # an exchange goes to the target with its Partial mesh dims still Replicate (partialized after)
    unreduced: State = (tuple(Replicate() if isinstance(p, Partial) else p for p in dst), goal[1])
    # Ordered by (cost, steps): equal-cost plans go to the one with fewer steps.
    best: dict[State, tuple[float, int]] = {start: (0.0, 0)}
    queue: list[tuple[float, int, int, State, tuple[Step, ...]]] = [(0.0, 0, next(tie), start, ())]
    while queue:
        cost, nsteps, _, state, steps = heapq.heappop(queue)
        if state == goal:
            return RedistributePlan(mesh_shape, global_shape, src, dst, steps, cost)
        if (cost, nsteps) > best[state]:
            continue
        if exchange and state != unreduced and not any(isinstance(p, Partial) for p in state[0]):
            nbytes = exchange_bytes(mesh_shape, global_shape, itemsize, state[1], unreduced[1])
            # ranked as if it took many steps: a tie goes to the per-mesh-dim collectives
            key = (round(cost + nbytes / min(weights), 6), nsteps + _EXCHANGE_RANK)
            # (no bytes at all: every rank's target lies in what it holds, a local slice that the
            # per-mesh-dim steps may not reach without gathering first)
            if key < best.get(unreduced, (math.inf, 0)):
                best[unreduced] = key
                step = Step("exchange", -1, state[0], unreduced[0], nbytes, unreduced[0], unreduced[1], state[1])
                heapq.heappush(queue, (key[0], key[1], next(tie), unreduced, steps + (step,)))
        if exchange and _one_reduction(state[0]):
            # every mesh dim holds a term of one reduction: one all_reduce over the whole mesh
            local = _local_numel(global_shape, mesh_shape, state[1]) * itemsize
            n = math.prod(mesh_shape)
            nbytes = 2 * (n - 1) / n * local
            reduced: State = (tuple(Replicate() for _ in mesh_shape), state[1])
            key = (round(cost + nbytes / min(weights), 6), nsteps + 1)
            if key < best.get(reduced, (math.inf, 0)):
                best[reduced] = key
                step = Step("all_reduce_mesh", -1, state[0], reduced[0], nbytes, reduced[0], reduced[1], state[1])
                heapq.heappush(queue, (key[0], key[1], next(tie), reduced, steps + (step,)))
        for kind, i, new, nbytes, nxt in _edges(state, mesh_shape, global_shape, itemsize, dst):
            if mesh_shape[i] == 1:
                nbytes = 0.0
            key = (round(cost + nbytes / weights[i], 6), nsteps + 1)
            if key < best.get(nxt, (math.inf, 0)):
                best[nxt] = key
                step = Step(kind, i, state[0][i], new, nbytes, nxt[0], nxt[1])
                heapq.heappush(queue, (key[0], key[1], next(tie), nxt, steps + (step,)))
    raise ValueError(
        f"no way to redistribute {format_placements(src)} to {format_placements(dst)} on mesh {mesh_shape}: "
        f"a Partial target needs the same Partial or Replicate on that mesh dim"
    )
