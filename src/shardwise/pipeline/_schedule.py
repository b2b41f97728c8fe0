"""Pipeline schedules as pure data: which (kind, micro-batch, stage) each rank runs, in order.

A schedule is the part of a pipeline that can be reasoned about without running it, so
it is kept as values: each rank's order of actions (`rank_order`) is the definition,
and the clock-tick table (`ticks`) is derived from it by running every action as soon
as its rank is free and its inputs exist, forward and backward one tick each. The
runtimes (one process over devices, or one process per stage) execute `rank_order`;
tests check the tables by hand and check the dependency rules on many sizes. A runtime
that posts its sends without blocking cannot deadlock on an order whose table exists.

ScheduleGPipe (fill-drain), 2 stages, 3 micro-batches; ``F0`` is the forward of micro-batch 0::

    tick    0   1   2   3   4   5   6   7
    rank 0  F0  F1  F2  .   .   B0  B1  B2
    rank 1  .   F0  F1  F2  B0  B1  B2  .

1F1B (PipeDream-flush): after a warm-up of `p - s - 1` forwards, stage `s` alternates one
forward and one backward, so it holds at most `p - s` micro-batches of activations
instead of `m`, in the same number of ticks::

    tick    0   1   2   3   4   5   6   7
    rank 0  F0  F1  .   B0  F2  B1  .   B2
    rank 1  .   F0  B0  F1  B1  F2  B2  .

Interleaved 1F1B (Megatron): `v` virtual stages per rank, stage `s` on rank `s % r`;
micro-batches go through the ranks in groups of `r`. 2 ranks, 2 virtual stages each
(stages 0..3), 2 micro-batches; ``F1.2`` is the forward of micro-batch 1 on stage 2::

    tick    0     1     2     3     4     5     6     7     8     9
    rank 0  F0.0  F1.0  F0.2  F1.2  .     B0.2  .     B1.2  B0.0  B1.0
    rank 1  .     F0.1  F1.1  F0.3  B0.3  F1.3  B1.3  B0.1  B1.1  .

Zero-bubble schedules split a backward in two (`_split_backward`): ``I``, the inputs'
gradients, which the stage before waits for, and ``W``, the weights', which nobody waits
for and which fills what would be idle time. Their orders come from one policy run on the
cost model below (`_zero_bubble_order`): a free rank runs a ready ``I`` first, else a
ready ``F`` while it holds fewer micro-batches' activations than its 1F1B counterpart
would (about), else a pending ``W``. ScheduleInterleavedZeroBubble is that policy on interleaved
placement (ZB-H1 with one stage per rank); ScheduleZBVZeroBubble on the V placement: two
stages per rank, rank `k` holding stages `k` and `2r-1-k`, so a micro-batch's last forward
and first backward run on rank 0 back to back. ScheduleLoopedBFS runs each of a rank's
stages for every micro-batch before the next stage (breadth first).

`ticks()` gives every action one tick. `bubble_fraction()` prices them as they cost: a
forward 1, a whole backward 2, its halves ``I`` and ``W`` 1 each, and counts the idle
fraction of rank-time. With `p` ranks and `m` micro-batches that is `(p-1)/(m+p-1)` for
ScheduleGPipe and 1F1B, and `(p-1)/(v*m+p-1)` for interleaved 1F1B when `m` is a multiple
of `p`. `clock_cycles` is torchgpipe's forward-only table of (micro-batch, partition)
pairs, which the single-process `Pipe` follows.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

__all__ = ["Action", "Schedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "clock_cycles"]

KINDS = {"F": "forward", "B": "backward", "I": "backward of the inputs' gradients",
         "W": "backward of the weights' gradients"}
COST = {"F": 1, "B": 2, "I": 1, "W": 1}  # in forwards (`bubble_fraction`): a backward is two, one per half


@dataclass(frozen=True)
class Action:
    """One unit of work on global stage `stage` for micro-batch `microbatch`: the forward
    ("F"), the backward ("B"), or the backward's halves, the inputs' gradients ("I") and then
    the weights' ("W")."""

    kind: str
    microbatch: int
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {', '.join(f'{k!r} ({v})' for k, v in KINDS.items())}, "
                             f"got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.stage}"


@dataclass(frozen=True)
class Schedule(abc.ABC):
    """`num_stages` stages on `num_ranks` ranks, `num_microbatches` micro-batches.

    Every schedule respects: F(i, s) after F(i, s-1); B(i, s) (or I(i, s)) after F(i, s) and
    after B(i, s+1) (or I(i, s+1)); W(i, s) after I(i, s); each rank runs at most one action
    per tick.
    """

    num_stages: int
    num_microbatches: int
    num_ranks: int

    def stage_rank(self, stage: int) -> int:
        """The rank (or device) that runs `stage`: `stage % num_ranks`."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage!r} is out of range for {self!r}: use a stage in [0, {self.num_stages - 1}]")
        return stage % self.num_ranks

    def rank_stages(self, rank: int) -> list[int]:
        """The stages `rank` runs, in increasing order."""
        self._check_rank(rank)
        return list(range(rank, self.num_stages, self.num_ranks))

    @abc.abstractmethod
    def rank_order(self, rank: int) -> list[Action]:
        """The order in which `rank` runs its actions (the definition of the schedule)."""

    def ticks(self) -> list[tuple[Action, ...]]:
        """Per clock tick, the actions that run in it (at most one per rank, ordered by rank),
        every action one tick."""
        spans = _simulate(self, weighted=False)
        table: list[list[Action]] = [[] for _ in range(max((end for _, _, end in spans), default=0))]
        for a, start, _ in spans:
            table[start].append(a)
        return [tuple(sorted(actions, key=lambda a: self.stage_rank(a.stage))) for actions in table]

    def bubble_fraction(self) -> float:
        """Idle fraction of rank-time, each action priced by `COST` (a forward 1, a backward 2)."""
        spans = _simulate(self, weighted=True)
        busy = sum(end - start for _, start, end in spans)
        return 1.0 - busy / (self.num_ranks * max(end for _, _, end in spans))

    def needs(self, a: Action) -> list[tuple[Action, ...]]:
        """What `a` waits for: each entry is met by any one of its actions."""
        i, s = a.microbatch, a.stage
        if a.kind == "F":
            return [(Action("F", i, s - 1),)] if s > 0 else []
        if a.kind == "W":
            return [(Action("I", i, s),)]
        gradient = [(Action("B", i, s + 1), Action("I", i, s + 1))] if s < self.num_stages - 1 else []
        return [(Action("F", i, s),), *gradient]

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank!r} is out of range for {self!r}: use a rank in [0, {self.num_ranks - 1}]")


class ScheduleGPipe(Schedule):
    """Fill-drain: every forward, then every backward (micro-batches in order); stage `s`
    on rank `s`. Holds all `m` micro-batches' activations at the turn."""

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        _check_sizes(num_stages=num_stages, num_microbatches=num_microbatches)
        super().__init__(num_stages, num_microbatches, num_stages)

    def rank_order(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        m = self.num_microbatches
        return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]

    def __repr__(self) -> str:
        return f"ScheduleGPipe(num_stages={self.num_stages}, num_microbatches={self.num_microbatches})"


class Schedule1F1B(Schedule):
    """1F1B (PipeDream-flush): stage `s` runs `min(p - s - 1, m)` forwards, then alternates
    one forward and one backward, then drains its backwards; stage `s` on rank `s`. Any
    `m >= 1` is accepted (with `m < p` the warm-up covers every micro-batch)."""

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        _check_sizes(num_stages=num_stages, num_microbatches=num_microbatches)
        super().__init__(num_stages, num_microbatches, num_stages)

    def rank_order(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        m = self.num_microbatches
        warmup = min(self.num_stages - rank - 1, m)
        order = [Action("F", i, rank) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: F(warmup + i), B(i)
            order += [Action("F", warmup + i, rank), Action("B", i, rank)]
        return order + [Action("B", i, rank) for i in range(m - warmup, m)]

    def __repr__(self) -> str:
        return f"Schedule1F1B(num_stages={self.num_stages}, num_microbatches={self.num_microbatches})"


class ScheduleInterleaved1F1B(Schedule):
    """Interleaved 1F1B (Narayanan et al. 2021): `virtual_stages` stages per rank, stage
    `s` on rank `s % num_ranks`. Micro-batches enter in groups of `num_ranks`; each rank
    runs the forwards of one group on its first stage, then on its second, and so on,
    and the backwards in the mirror order. Requires `num_microbatches % num_ranks == 0`."""

    def __init__(self, num_ranks: int, virtual_stages: int, num_microbatches: int) -> None:
        _check_sizes(num_ranks=num_ranks, virtual_stages=virtual_stages, num_microbatches=num_microbatches)
        if num_microbatches % num_ranks:
            raise ValueError(
                f"interleaved 1F1B sends micro-batches through the ranks in groups of num_ranks, so "
                f"num_microbatches ({num_microbatches}) must be a multiple of num_ranks ({num_ranks}): "
                f"use {num_microbatches + num_ranks - num_microbatches % num_ranks} micro-batches, or Schedule1F1B")
        super().__init__(num_ranks * virtual_stages, num_microbatches, num_ranks)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_order(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        r, v, m = self.num_ranks, self.virtual_stages, self.num_microbatches
        total = m * v
        # enough forwards that the first backward's input arrives as the warm-up ends
        warmup = min(total, 2 * (r - rank - 1) + (v - 1) * r)

        def action(kind: str, k: int) -> Action:  # k-th forward (or backward) of this rank
            group, in_group = divmod(k, r * v)
            chunk = in_group // r if kind == "F" else v - 1 - in_group // r
            return Action(kind, group * r + in_group % r, chunk * r + rank)

        order = [action("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [action("F", warmup + k), action("B", k)]
        return order + [action("B", k) for k in range(total - warmup, total)]

    def __repr__(self) -> str:
        return (f"ScheduleInterleaved1F1B(num_ranks={self.num_ranks}, virtual_stages={self.virtual_stages}, "
                f"num_microbatches={self.num_microbatches})")


class _Looped(Schedule):
    """`virtual_stages` stages per rank, stage `s` on rank `s % num_ranks`."""

    def __init__(self, num_ranks: int, virtual_stages: int, num_microbatches: int) -> None:
        _check_sizes(num_ranks=num_ranks, virtual_stages=virtual_stages, num_microbatches=num_microbatches)
        super().__init__(num_ranks * virtual_stages, num_microbatches, num_ranks)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks


class ScheduleLoopedBFS(_Looped):
    """Looped breadth-first (Lamy-Poirier 2023): `virtual_stages` stages per rank, stage `s` on
    rank `s % num_ranks`; each rank runs its first stage's forward for every micro-batch, then
    its next stage's, and the backwards in the mirror order (last stage first). Any
    `num_microbatches >= 1`."""

    def rank_order(self, rank: int) -> list[Action]:
        stages, m = self.rank_stages(rank), self.num_microbatches
        return ([Action("F", i, s) for s in stages for i in range(m)]
                + [Action("B", i, s) for s in reversed(stages) for i in range(m)])

    def __repr__(self) -> str:
        return (f"ScheduleLoopedBFS(num_ranks={self.num_ranks}, virtual_stages={self.virtual_stages}, "
                f"num_microbatches={self.num_microbatches})")


class ScheduleInterleavedZeroBubble(_Looped):
    """Zero bubble on interleaved placement (Qi et al. 2024; ZB-H1 with `virtual_stages=1`):
    stage `s` on rank `s % num_ranks`, each backward split into I and W, the order from the
    zero-bubble policy (module docstring). Each rank holds at most `activation_bound` pairs
    between F and W: with one stage per rank `r + 2`, 1F1B's first rank's `r` and two past
    their I (which keep only the weights' inputs); that reaches ZB-H1's bubble,
    `(r-1)/(3m+r-1)` in `COST` units, for every `m >= r`. With several, interleaved 1F1B's
    first rank's bound. Any `num_microbatches >= 1`."""

    def activation_bound(self, rank: int) -> int:
        """The most (micro-batch, stage) pairs whose forward ran and W has not, on `rank`."""
        r, v = self.num_ranks, self.virtual_stages
        return min(self.num_microbatches * v, 2 * (r - 1) + (v - 1) * r + 1 if v > 1 else r + 2)

    def rank_order(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        return list(_zero_bubble_order(self)[rank])

    def __repr__(self) -> str:
        return (f"ScheduleInterleavedZeroBubble(num_ranks={self.num_ranks}, virtual_stages={self.virtual_stages}, "
                f"num_microbatches={self.num_microbatches})")


class _VShape(Schedule):
    """Two stages per rank in a V: rank `k` holds stages `k` and `2r-1-k`."""

    def stage_rank(self, stage: int) -> int:
        super().stage_rank(stage)  # (checks the stage)
        return stage if stage < self.num_ranks else self.num_stages - 1 - stage

    def rank_stages(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return [rank, self.num_stages - 1 - rank]


class ScheduleZBVZeroBubble(_VShape):
    """ZB-V (Qi et al. 2024): two stages per rank in a V, rank `k` holding stages `k` and
    `2r-1-k`; backwards split into I and W, the order from the zero-bubble policy (module
    docstring), holding at most `2r` (micro-batch, stage) pairs' activations per rank (1F1B's
    memory: `r` micro-batches of a whole rank's layers). Any `num_microbatches >= 1`."""

    def __init__(self, num_ranks: int, num_microbatches: int) -> None:
        _check_sizes(num_ranks=num_ranks, num_microbatches=num_microbatches)
        super().__init__(2 * num_ranks, num_microbatches, num_ranks)

    def activation_bound(self, rank: int) -> int:
        return min(2 * self.num_microbatches, 2 * self.num_ranks)

    def rank_order(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        return list(_zero_bubble_order(self)[rank])

    def __repr__(self) -> str:
        return f"ScheduleZBVZeroBubble(num_ranks={self.num_ranks}, num_microbatches={self.num_microbatches})"


class ScheduleDualPipeV(_VShape):
    """DualPipeV (DeepSeek's DualPipe folded into a V by Sea AI Lab): two stages per rank in a
    V, as ScheduleZBVZeroBubble. A rank warms up on its first stage, then on both, then pairs
    a forward of one stage with a backward of the other (the pairs DualPipe overlaps with the
    other's communication; here one after the other), and cools down with backwards whose
    W it defers, running the deferred W in order where it would wait. Needs
    `num_microbatches >= 2 * num_ranks`."""

    def __init__(self, num_ranks: int, num_microbatches: int) -> None:
        _check_sizes(num_ranks=num_ranks, num_microbatches=num_microbatches)
        if num_microbatches < 2 * num_ranks:
            raise ValueError(f"DualPipeV fills the V with 2 * num_ranks micro-batches before its steady state, so "
                             f"num_microbatches ({num_microbatches}) must be at least {2 * num_ranks} for "
                             f"{num_ranks} ranks: use {2 * num_ranks} or more, or ScheduleZBVZeroBubble")
        super().__init__(2 * num_ranks, num_microbatches, num_ranks)

    def rank_order(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        r, m = self.num_ranks, self.num_microbatches
        stages = self.rank_stages(rank)  # phase 0 goes down the V, phase 1 comes back up
        order: list[Action] = []
        forwards, backwards = [0, 0], [0, 0]
        deferred: list[Action] = []

        def forward(phase: int) -> None:
            order.append(Action("F", forwards[phase], stages[phase]))
            forwards[phase] += 1

        def backward(phase: int, split: bool = False) -> None:
            i = backwards[phase]
            backwards[phase] += 1
            order.append(Action("I" if split else "B", i, stages[phase]))
            if split:
                deferred.append(Action("W", i, stages[phase]))

        def weight() -> None:
            order.append(deferred.pop(0))

        for _ in range(2 * (r - rank - 1)):  # warm-up on the first stage
            forward(0)
        for _ in range(rank + 1):  # then on both
            forward(0)
            forward(1)
        for _ in range(r - rank - 1):  # the first backwards come back: I now, W at once
            backward(1, split=True)
            weight()
            forward(1)
        for _ in range(m - 2 * r + rank + 1):  # steady: F of one stage beside B of the other
            forward(0)
            backward(1)
            forward(1)
            backward(0)
        for _ in range(r - rank - 1):
            backward(1)
            forward(1)
            backward(0)
        last = rank + 1
        for k in range(last):  # cool-down: the second half defers its W
            backward(1, split=k > last // 2 or (k == last // 2 and rank % 2 == 1))
            backward(0, split=k >= last // 2)
        for _ in range(r - rank - 1):
            weight()
            backward(0, split=True)
        while deferred:
            weight()
        return order

    def __repr__(self) -> str:
        return f"ScheduleDualPipeV(num_ranks={self.num_ranks}, num_microbatches={self.num_microbatches})"


def clock_cycles(num_microbatches: int, num_partitions: int) -> list[list[tuple[int, int]]]:
    """torchgpipe's forward schedule: in clock cycle `k`, micro-batch `i` runs on
    partition `j` for every `i + j == k`.

    >>> clock_cycles(3, 2)
    [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    _check_sizes(num_microbatches=num_microbatches, num_partitions=num_partitions)
    m, n = num_microbatches, num_partitions
    return [[(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))] for k in range(m + n - 1)]


@functools.lru_cache(maxsize=256)
def _simulate(schedule: Schedule, weighted: bool) -> tuple[tuple[Action, int, int], ...]:
    """Run each rank's order, every action as soon as its rank is free and what it needs
    (`Schedule.needs`) has finished; (action, start, end) in the order they start. `weighted`: each
    action lasts its `COST`, else one tick."""
    orders = [schedule.rank_order(rank) for rank in range(schedule.num_ranks)]
    finished: dict[Action, int] = {}
    position, free = [0] * schedule.num_ranks, [0] * schedule.num_ranks
    spans: list[tuple[Action, int, int]] = []
    tick = 0
    while any(p < len(o) for p, o in zip(position, orders)):
        for rank, order in enumerate(orders):
            if position[rank] == len(order) or free[rank] > tick:
                continue
            a = order[position[rank]]
            if all(any(finished.get(n, tick + 1) <= tick for n in need) for need in schedule.needs(a)):
                free[rank] = finished[a] = tick + (COST[a.kind] if weighted else 1)
                position[rank] += 1
                spans.append((a, tick, free[rank]))
        if all(f <= tick for f in free) and not any(start == tick for _, start, _ in spans[-len(orders):]):
            stuck = {rank: str(order[position[rank]])
                     for rank, order in enumerate(orders) if position[rank] < len(order)}
            raise RuntimeError(f"{schedule!r} deadlocks at tick {tick}: ranks wait on {stuck}")
        tick += 1
    return tuple(spans)


@functools.lru_cache(maxsize=64)
def _zero_bubble_order(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the order the zero-bubble policy gives on `COST`: a free rank runs the ready I of
    the earliest micro-batch (latest stage first), else the ready F of the earliest micro-batch
    (earliest stage first) while it holds fewer than `activation_bound(rank)` (micro-batch,
    stage) pairs between their F and their W, else its earliest pending W; else it waits."""
    r, m = schedule.num_ranks, schedule.num_microbatches
    stages = [schedule.rank_stages(rank) for rank in range(r)]
    bound = [schedule.activation_bound(rank) for rank in range(r)]  # type: ignore[attr-defined]
    finished: dict[Action, int] = {}
    orders: list[list[Action]] = [[] for _ in range(r)]
    free, held = [0] * r, [0] * r
    total = 3 * m * schedule.num_stages
    tick = 0
    while sum(len(o) for o in orders) < total:
        started = False
        for rank in range(r):
            if free[rank] > tick:
                continue
            ready = [a for kind in "IFW" for i in range(m) for s in stages[rank]
                     for a in (Action(kind, i, s),)
                     if a not in finished and all(any(finished.get(n, tick + 1) <= tick for n in need)
                                                  for need in schedule.needs(a))]
            inputs = sorted((a for a in ready if a.kind == "I"), key=lambda a: (a.microbatch, -a.stage))
            forwards = sorted((a for a in ready if a.kind == "F"), key=lambda a: (a.microbatch, a.stage))
            weights = sorted((a for a in ready if a.kind == "W"), key=lambda a: (a.microbatch, a.stage))
            pick = (inputs[:1] or (forwards[:1] if held[rank] < bound[rank] else []) or weights[:1])
            if not pick:
                continue
            a = pick[0]
            free[rank] = finished[a] = tick + COST[a.kind]
            held[rank] += {"F": 1, "I": 0, "W": -1}[a.kind]
            orders[rank].append(a)
            started = True
        if not started and all(f <= tick for f in free):
            raise RuntimeError(f"{schedule!r}: the zero-bubble policy found nothing to run at tick {tick}")
        tick += 1
    return tuple(tuple(o) for o in orders)


def _check_sizes(**sizes: int) -> None:
    bad = [f"{name}={value!r}" for name, value in sizes.items()
           if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"schedule sizes must be positive integers, got {', '.join(bad)}")

