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

With `p` ranks and `m` micro-batches the idle fraction of rank-ticks (`bubble_fraction`)
is `(p-1)/(m+p-1)` for ScheduleGPipe and 1F1B, and `(p-1)/(v*m+p-1)` for interleaved 1F1B when
`m` is a multiple of `p`. `clock_cycles` is torchgpipe's forward-only table of
(micro-batch, partition) pairs, which the single-process `Pipe` follows.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

__all__ = ["Action", "Schedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "clock_cycles"]


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward ("F") or backward ("B") of micro-batch `microbatch`
    on global stage `stage`."""

    kind: str
    microbatch: int
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"Action kind must be 'F' (forward) or 'B' (backward), got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.stage}"


@dataclass(frozen=True)
class Schedule(abc.ABC):
    """`num_stages` stages on `num_ranks` ranks, `num_microbatches` micro-batches.

    Every schedule respects: F(i, s) after F(i, s-1); B(i, s) after F(i, s) and after
    B(i, s+1); each rank runs at most one action per tick.
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
        """Per clock tick, the actions that run in it (at most one per rank, ordered by rank)."""
        return list(_simulate(self))

    def bubble_fraction(self) -> float:
        """Idle fraction of rank-ticks, forward and backward counting one tick each."""
        table = _simulate(self)
        busy = sum(len(actions) for actions in table)
        return 1.0 - busy / (self.num_ranks * len(table))

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
def _simulate(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Run each rank's order, every action at the first tick its rank is free and its
    inputs (previous stage's forward, next stage's backward, own forward) are done."""
    orders = [schedule.rank_order(rank) for rank in range(schedule.num_ranks)]
    last = schedule.num_stages - 1
    done: dict[Action, int] = {}  # action -> tick it ran in
    position = [0] * schedule.num_ranks
    table: list[tuple[Action, ...]] = []
    while any(p < len(o) for p, o in zip(position, orders)):
        tick = len(table)
        running = []
        for rank, order in enumerate(orders):
            if position[rank] == len(order):
                continue
            a = order[position[rank]]
            if a.kind == "F":
                needs = [Action("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
            else:
                needs = [Action("F", a.microbatch, a.stage)]
                needs += [Action("B", a.microbatch, a.stage + 1)] if a.stage < last else []
            if all(done.get(n, tick) < tick for n in needs):
                running.append(a)
        if not running:
            stuck = {rank: str(order[position[rank]])
                     for rank, order in enumerate(orders) if position[rank] < len(order)}
            raise RuntimeError(f"{schedule!r} deadlocks at tick {tick}: ranks wait on {stuck}")
        for a in running:
            done[a] = tick
            position[schedule.stage_rank(a.stage)] += 1
        table.append(tuple(running))
    return tuple(table)


def _check_sizes(**sizes: int) -> None:
    bad = [f"{name}={value!r}" for name, value in sizes.items()
           if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"schedule sizes must be positive integers, got {', '.join(bad)}")

