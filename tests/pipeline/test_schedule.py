"""Schedules as pure data: hand-written tick tables, dependency rules on many sizes, the
1F1B activation bound, bubble fractions, torchgpipe's clock_cycles, and errors."""

from __future__ import annotations

import dataclasses
import doctest

import pytest

from shardwise.pipeline import (Action, Schedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
                                clock_cycles)
from shardwise.pipeline import _schedule


def assert_valid(s: Schedule) -> None:
    """The oracle: every (kind, micro-batch, stage) runs exactly once; F(i, s) after
    F(i, s-1); B(i, s) after F(i, s) and B(i, s+1); a rank runs one action per tick, in
    its `rank_order`; stages sit on the ranks `stage_rank` names."""
    p, m = s.num_stages, s.num_microbatches
    when: dict[Action, int] = {}
    for tick, actions in enumerate(s.ticks()):
        assert actions, f"empty tick {tick}"
        ranks = [s.stage_rank(a.stage) for a in actions]
        assert len(ranks) == len(set(ranks)), f"tick {tick} runs two actions on one rank: {actions}"
        for a in actions:
            assert a not in when, f"{a} runs twice"
            when[a] = tick
    # each backward whole (B) or split in two, I then W
    back = {(i, j): "I" if Action("I", i, j) in when else "B" for i in range(m) for j in range(p)}
    assert set(when) == {Action(k, i, j) for (i, j), b in back.items() for k in ("F", b, "W")[:2 + (b == "I")]}
    for i in range(m):
        for j in range(p):
            if j > 0:
                assert when[Action("F", i, j)] > when[Action("F", i, j - 1)]
            assert when[Action(back[i, j], i, j)] > when[Action("F", i, j)]
            if j < p - 1:
                assert when[Action(back[i, j], i, j)] > when[Action(back[i, j + 1], i, j + 1)]
            if back[i, j] == "I":
                assert when[Action("W", i, j)] > when[Action("I", i, j)]
    for rank in range(s.num_ranks):
        mine = sorted((a for a in when if s.stage_rank(a.stage) == rank), key=when.__getitem__)
        assert s.rank_order(rank) == mine
        assert s.rank_stages(rank) == [j for j in range(p) if s.stage_rank(j) == rank]


def grid(s: Schedule, with_stage: bool = False) -> list[list[str]]:
    """Per rank, per tick: `F3` (or `F3.1` with the stage) or `.` when idle."""
    rows = [["."] * len(s.ticks()) for _ in range(s.num_ranks)]
    for tick, actions in enumerate(s.ticks()):
        for a in actions:
            rows[s.stage_rank(a.stage)][tick] = f"{a.kind}{a.microbatch}" + (f".{a.stage}" if with_stage else "")
    return rows


def table(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def in_flight(s: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and backward has not yet."""
    live, peak = [0] * s.num_stages, [0] * s.num_stages
    for actions in s.ticks():
        for a in actions:
            live[a.stage] += 1 if a.kind == "F" else -1
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return peak


# -- exact tables, written by hand -----------------------------------------------------------

@pytest.mark.parametrize(("schedule", "expected"), [
    (ScheduleGPipe(2, 2), """
        F0 F1 .  .  B0 B1
        .  F0 F1 B0 B1 .
    """),
    (ScheduleGPipe(2, 3), """
        F0 F1 F2 .  .  B0 B1 B2
        .  F0 F1 F2 B0 B1 B2 .
    """),
    (ScheduleGPipe(3, 2), """
        F0 F1 .  .  .  .  B0 B1
        .  F0 F1 .  .  B0 B1 .
        .  .  F0 F1 B0 B1 .  .
    """),
    (Schedule1F1B(2, 3), """
        F0 F1 .  B0 F2 B1 .  B2
        .  F0 B0 F1 B1 F2 B2 .
    """),
    (Schedule1F1B(3, 4), """
        F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
        .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
    """),
    (Schedule1F1B(3, 2), """
        F0 F1 .  .  .  B0 .  B1
        .  F0 F1 .  B0 .  B1 .
        .  .  F0 B0 F1 B1 .  .
    """),  # m < p: stage 0 warms up with every micro-batch; B0 starts before F1 reaches stage 2
])
def test_tick_tables(schedule: Schedule, expected: str) -> None:
    assert grid(schedule) == table(expected)


def test_interleaved_tick_tables() -> None:
    assert grid(ScheduleInterleaved1F1B(2, 2, 2), with_stage=True) == table("""
        F0.0 F1.0 F0.2 F1.2 .    B0.2 .    B1.2 B0.0 B1.0
        .    F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 B0.1 B1.1 .
    """)
    assert grid(ScheduleInterleaved1F1B(2, 2, 4), with_stage=True) == table("""
        F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 .    B2.2 .    B3.2 B2.0 B3.0
        .    F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1 .
    """)


def test_rank_order_of_1f1b_is_warmup_steady_cooldown() -> None:
    order = Schedule1F1B(3, 4).rank_order(0)
    assert [str(a) for a in order] == ["F0.0", "F1.0", "F2.0", "B0.0", "F3.0", "B1.0", "B2.0", "B3.0"]
    assert [str(a) for a in Schedule1F1B(3, 4).rank_order(2)] == [
        "F0.2", "B0.2", "F1.2", "B1.2", "F2.2", "B2.2", "F3.2", "B3.2"]


def test_interleaved_places_stage_s_on_rank_s_mod_ranks() -> None:
    s = ScheduleInterleaved1F1B(num_ranks=3, virtual_stages=2, num_microbatches=3)
    assert (s.num_stages, s.num_ranks, s.virtual_stages) == (6, 3, 2)
    assert [s.stage_rank(j) for j in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.rank_stages(1) == [1, 4]


# -- rules on many sizes ---------------------------------------------------------------------

@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 9))
def test_gpipe_and_1f1b_respect_dependencies(p: int, m: int) -> None:
    assert_valid(ScheduleGPipe(p, m))
    assert_valid(Schedule1F1B(p, m))


@pytest.mark.parametrize("r", range(1, 5))
@pytest.mark.parametrize("v", range(1, 4))
@pytest.mark.parametrize("groups", range(1, 4))
def test_interleaved_respects_dependencies(r: int, v: int, groups: int) -> None:
    assert_valid(ScheduleInterleaved1F1B(r, v, groups * r))


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 9))
def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight(p: int, m: int) -> None:
    # the activation-memory bound: stage s holds min(p - s, m) micro-batches at most
    # (reached, so the bound is tight), where fill-drain ScheduleGPipe holds all m on every stage
    assert in_flight(Schedule1F1B(p, m)) == [min(p - s, m) for s in range(p)]
    assert in_flight(ScheduleGPipe(p, m)) == [m] * p


# -- bubbles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 9))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p: int, m: int) -> None:
    expected = (p - 1) / (m + p - 1)
    assert ScheduleGPipe(p, m).bubble_fraction() == pytest.approx(expected, abs=1e-12)
    assert Schedule1F1B(p, m).bubble_fraction() == pytest.approx(expected, abs=1e-12)
    assert len(ScheduleGPipe(p, m).ticks()) == len(Schedule1F1B(p, m).ticks()) == 2 * (m + p - 1)


@pytest.mark.parametrize("r", range(2, 5))
@pytest.mark.parametrize("v", range(2, 4))
@pytest.mark.parametrize("groups", range(1, 4))
def test_interleaving_shrinks_the_bubble(r: int, v: int, groups: int) -> None:
    m = groups * r
    interleaved = ScheduleInterleaved1F1B(r, v, m).bubble_fraction()
    assert interleaved == pytest.approx((r - 1) / (v * m + r - 1), abs=1e-12)
    assert interleaved < Schedule1F1B(r, m).bubble_fraction()


def test_examples_of_bubble_fractions() -> None:
    assert ScheduleGPipe(4, 4).bubble_fraction() == pytest.approx(3 / 7)
    assert Schedule1F1B(4, 8).bubble_fraction() == pytest.approx(3 / 11)
    assert ScheduleInterleaved1F1B(4, 2, 8).bubble_fraction() == pytest.approx(3 / 19)
    assert ScheduleGPipe(1, 5).bubble_fraction() == 0.0


@pytest.mark.parametrize("r", range(1, 5))
@pytest.mark.parametrize("m", range(1, 9))
def test_zero_bubble_and_looped_schedules_are_valid_on_many_sizes(r: int, m: int) -> None:
    for s in (ScheduleInterleavedZeroBubble(r, 1, m), ScheduleInterleavedZeroBubble(r, 2, m), ScheduleZBVZeroBubble(r, m),
              ScheduleLoopedBFS(r, 2, m)):
        assert_valid(s)
    v = ScheduleZBVZeroBubble(r, m)
    assert [v.stage_rank(j) for j in range(2 * r)] == [*range(r), *reversed(range(r))]
    dual = ScheduleDualPipeV(r, 2 * r + m)  # (at least 2r micro-batches)
    assert_valid(dual)
    assert dual.bubble_fraction() <= ScheduleZBVZeroBubble(r, 2 * r + m).bubble_fraction() + 1e-12


@pytest.mark.parametrize("r", range(2, 8))
@pytest.mark.parametrize("extra", range(0, 18, 3))
def test_zb_h1_reaches_its_bubble_and_the_v_beats_1f1b(r: int, extra: int) -> None:
    # ZB-H1: the bubble of 1F1B, (r-1)(F+B+W), shrinks to (r-1)(F+B-W), a third of it with F = B = W
    m = r + extra
    zb = ScheduleInterleavedZeroBubble(r, 1, m)
    assert zb.bubble_fraction() == pytest.approx((r - 1) / (3 * m + r - 1), abs=1e-12)
    assert ScheduleZBVZeroBubble(r, m).bubble_fraction() < zb.bubble_fraction() < Schedule1F1B(r, m).bubble_fraction()


def test_examples_of_zero_bubble_orders_and_bubbles() -> None:
    # 2 ranks in a V, 4 micro-batches: rank 0 holds stages 0 and 3, one tick of bubble in 25
    v = ScheduleZBVZeroBubble(2, 4)
    assert [str(a) for a in v.rank_order(0)[:8]] == ["F0.0", "F1.0", "F2.0", "F0.3", "I0.3", "W0.3", "F1.3", "I0.0"]
    assert v.bubble_fraction() == pytest.approx(1 / 25)
    assert Schedule1F1B(2, 4).bubble_fraction() == pytest.approx(1 / 5)  # the most a zero bubble saves: 1.25x
    assert ScheduleLoopedBFS(2, 2, 4).rank_order(1) == [
        *(Action("F", i, 1) for i in range(4)), *(Action("F", i, 3) for i in range(4)),
        *(Action("B", i, 3) for i in range(4)), *(Action("B", i, 1) for i in range(4))]


# -- torchgpipe's clock_cycles ---------------------------------------------------------------

@pytest.mark.parametrize(("m", "n", "expected"), [
    (1, 1, [[(0, 0)]]),
    (1, 3, [[(0, 0)], [(0, 1)], [(0, 2)]]),
    (3, 1, [[(0, 0)], [(1, 0)], [(2, 0)]]),
    (3, 3, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)]]),
    (4, 2, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(3, 1)]]),
])
def test_clock_cycles(m: int, n: int, expected: list[list[tuple[int, int]]]) -> None:
    assert clock_cycles(m, n) == expected


def test_clock_cycles_are_the_gpipe_forward_ticks() -> None:
    s = ScheduleGPipe(3, 4)
    forward = [[(a.microbatch, a.stage) for a in actions if a.kind == "F"] for actions in s.ticks()]
    assert forward[:6] == clock_cycles(4, 3)


# -- values and errors -----------------------------------------------------------------------

def test_schedules_are_frozen_values_with_round_tripping_repr() -> None:
    for s in (ScheduleGPipe(3, 2), Schedule1F1B(2, 5), ScheduleInterleaved1F1B(2, 3, 4)):
        assert eval(repr(s)) == s and hash(eval(repr(s))) == hash(s)
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.num_stages = 7  # type: ignore[misc]
    assert ScheduleGPipe(2, 2) != Schedule1F1B(2, 2)
    assert repr(ScheduleInterleaved1F1B(2, 3, 4)) == "ScheduleInterleaved1F1B(num_ranks=2, virtual_stages=3, num_microbatches=4)"


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ScheduleGPipe(0, 2), "num_stages=0"),
    (lambda: Schedule1F1B(2, -1), "num_microbatches=-1"),
    (lambda: ScheduleGPipe(2.0, 2), "num_stages=2.0"),
    (lambda: ScheduleInterleaved1F1B(0, 0, 4), "num_ranks=0, virtual_stages=0"),
    (lambda: clock_cycles(0, 2), "num_microbatches=0"),
    (lambda: ScheduleDualPipeV(2, 3), "num_microbatches (3) must be at least 4 for 2 ranks: use 4 or more, or "
                                      "ScheduleZBVZeroBubble"),
    (lambda: ScheduleInterleaved1F1B(2, 2, 3),
     "num_microbatches (3) must be a multiple of num_ranks (2): use 4 micro-batches, or Schedule1F1B"),
    (lambda: ScheduleGPipe(2, 2).stage_rank(2), "stage 2 is out of range for ScheduleGPipe(num_stages=2, num_microbatches=2): "
                                        "use a stage in [0, 1]"),
    (lambda: Schedule1F1B(2, 2).rank_order(-1), "rank -1 is out of range"),
    (lambda: Action("X", 0, 0), "Action kind must be one of 'F' (forward), 'B' (backward), 'I' (backward of the "
                                "inputs' gradients), 'W' (backward of the weights' gradients), got 'X'"),
])
def test_errors_name_the_values(make: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make()  # type: ignore[operator]
    assert message in str(info.value)


def test_an_order_that_cannot_run_is_reported_as_a_deadlock() -> None:
    class BackwardFirst(ScheduleGPipe):
        def rank_order(self, rank: int) -> list[Action]:
            return list(reversed(super().rank_order(rank)))

    with pytest.raises(RuntimeError, match=r"deadlocks at tick 0: ranks wait on \{0: 'B1.0', 1: 'B1.1'\}"):
        BackwardFirst(2, 2).ticks()


def test_schedule_doctests_pass() -> None:
    result = doctest.testmod(_schedule)
    assert result.attempted > 0 and result.failed == 0


def test_docstring_tables_match_the_schedules() -> None:
    doc = _schedule.__doc__ or ""
    for s, with_stage in ((ScheduleGPipe(2, 3), False), (Schedule1F1B(2, 3), False), (ScheduleInterleaved1F1B(2, 2, 2), True)):
        for rank, row in enumerate(grid(s, with_stage)):
            assert f"rank {rank}  " + " ".join(c.ljust(5 if with_stage else 3) for c in row).rstrip() in doc
