"""The redistribute planner (`shardwise._redistribute._planner`) and `explain_redistribute`.

Acceptance: on meshes (4,) and (2, 2) the chosen bytes on the wire equal the ring lower
bound of each transition (all_gather, reduce_scatter, all_reduce, all_to_all). Beyond the
table: every plan is a valid chain of steps ending at the target layout, each step's
bytes follow the stated cost model (recomputed here from the layout math), no plan costs
more than the naive "gather everything, then chunk" plan or than going through any
intermediate layout, and per-mesh-dim bandwidth changes the choice.
"""

from __future__ import annotations

import doctest
import math
import re
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise
from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard, explain_redistribute, plan_for
from shardwise._layout import max_local_shape, normalize_placements, normalize_shard_order, split_orders
from shardwise._redistribute import _planner
from shardwise._redistribute import RedistributePlan, Step, plan_redistribute

from ..oracle import coordinates, local_piece

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
F32 = 4
Orders = tuple[tuple[int, ...], ...]

# --- helpers: the cost model and the chain rules, written independently ----------------


def orders_for(placements: Sequence[Placement], shard_order: Sequence[tuple[int, tuple[int, ...]]], ndim: int) -> Orders:
    """Per tensor dim: the splitting mesh dims, outermost first (default ascending)."""
    orders = [[m for m, p in enumerate(placements) if p == Shard(d)] for d in range(ndim)]
    for d, ms in shard_order:
        orders[d] = list(ms)
    return tuple(tuple(ms) for ms in orders)


def local_bytes(
    mesh_shape: Sequence[int], global_shape: Sequence[int], placements: Sequence[Placement], orders: Orders, itemsize: int
) -> int:
    """Bytes of the largest local piece, from the layout module (validates the orders too)."""
    order = normalize_shard_order(placements, {d: ms for d, ms in enumerate(orders) if ms}, len(global_shape))
    return math.prod(max_local_shape(global_shape, mesh_shape, placements, order)) * itemsize


def expected_step_bytes(kind: str, n: int, before: int, after: int) -> float:
    """Bytes received per rank for one step on a mesh dim of size n (module docstring table)."""
    if n == 1:
        return 0.0
    return {
        "all_gather": (n - 1) * before,
        "all_to_all": (n - 1) / n * before,
        "all_reduce": 2 * (n - 1) / n * before,
        "reduce_scatter": (n - 1) * after,
        "chunk": 0,
        "partialize": 0,
    }[kind]


def check_plan(
    plan: RedistributePlan,
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    itemsize: int,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    src_order: tuple[tuple[int, tuple[int, ...]], ...] = (),
    dst_order: tuple[tuple[int, tuple[int, ...]], ...] = (),
    bandwidth: tuple[float, ...] | None = None,
) -> None:
    """Every step is legal from the state before it, costs what the model says, and the
    chain ends at (dst, dst_order) without revisiting a state."""
    ndim = len(global_shape)
    placements, orders = src, orders_for(src, src_order, ndim)
    seen = {(placements, orders)}
    cost = 0.0
    for k, step in enumerate(plan.steps):
        i, where = step.mesh_dim, f"step {k + 1} ({step})"
        if step.kind == "all_reduce_mesh":  # every mesh dim a term of one reduction: reduced at once
            assert all(p == placements[0] and isinstance(p, Partial) for p in placements), where
            assert (step.src, step.src_orders) == (placements, orders), where
            after = (Replicate(),) * len(mesh_shape)
            assert (step.dst, step.placements, step.orders) == (after, after, orders), where
            n = math.prod(mesh_shape)
            want = 2 * (n - 1) / n * local_bytes(mesh_shape, global_shape, placements, orders, itemsize)
            assert step.bytes == pytest.approx(want), where
            cost += step.bytes / (min(bandwidth) if bandwidth else 1.0)
            placements = after
            assert (placements, orders) not in seen, f"{where}: revisits a state"
            seen.add((placements, orders))
            continue
        if step.kind == "exchange":  # one all_to_all over the whole mesh, straight to the target
            # it lands on the target with Partials as Replicate (partialized after, for free)
            assert all(s.kind == "partialize" for s in plan.steps[k + 1 :]), f"{where}: only partialize may follow"
            assert not any(isinstance(p, Partial) for p in placements), where
            assert (step.src, step.src_orders) == (placements, orders), where
            target_orders = orders_for(dst, dst_order, ndim)
            unreduced = tuple(Replicate() if isinstance(p, Partial) else p for p in dst)
            assert (step.dst, step.placements, step.orders) == (unreduced, unreduced, target_orders), where
            want = exchange_oracle_bytes(mesh_shape, global_shape, placements, orders, target_orders) * itemsize
            assert step.bytes == want, f"{where}: {step.bytes} bytes, the oracle says {want}"
            # (0 bytes: every rank's target box lies in what it holds, a local slice at run time)
            assert len(mesh_shape) > 1, where
            cost += step.bytes / (min(bandwidth) if bandwidth else 1.0)
            placements, orders = unreduced, target_orders
            assert (placements, orders) not in seen, f"{where}: revisits a state"
            seen.add((placements, orders))
            continue
        assert 0 <= i < len(mesh_shape), where
        assert step.src == placements[i], where
        new = list(orders)
        if step.kind in ("all_gather", "all_to_all"):
            assert isinstance(step.src, Shard), where
            d = step.src.dim
            assert orders[d] and orders[d][-1] == i, f"{where}: only the innermost splitter may leave"
            new[d] = orders[d][:-1]
        if step.kind == "all_gather":
            assert step.dst == Replicate(), where
        elif step.kind == "all_to_all":
            assert isinstance(step.dst, Shard) and step.dst.dim != step.src.dim, where
            new[step.dst.dim] = new[step.dst.dim] + (i,)
        elif step.kind == "all_reduce":
            assert isinstance(step.src, Partial) and step.dst == Replicate(), where
        elif step.kind == "reduce_scatter":
            assert isinstance(step.src, Partial) and isinstance(step.dst, Shard), where
            new[step.dst.dim] = orders[step.dst.dim] + (i,)
        elif step.kind == "chunk":
            assert step.src == Replicate() and isinstance(step.dst, Shard), where
            new[step.dst.dim] = orders[step.dst.dim] + (i,)
        elif step.kind == "partialize":
            assert step.src == Replicate() and step.dst == dst[i], where
            assert isinstance(step.dst, Partial), where
        else:
            raise AssertionError(f"{where}: unknown kind {step.kind!r}")
        after_placements = placements[:i] + (step.dst,) + placements[i + 1 :]
        after_orders = tuple(new)
        assert step.placements == after_placements, where
        assert step.orders == after_orders, where
        before_b = local_bytes(mesh_shape, global_shape, placements, orders, itemsize)
        after_b = local_bytes(mesh_shape, global_shape, after_placements, after_orders, itemsize)
        want = expected_step_bytes(step.kind, mesh_shape[i], before_b, after_b)
        if step.kind == "all_to_all":  # n-1 pieces of the local tensor split along e, at their largest
            e, n = step.dst.dim, mesh_shape[i]  # type: ignore[union-attr]
            size_e = global_shape[e]
            for m in orders[e]:
                size_e = -(-size_e // mesh_shape[m])
            want = (n - 1) * (before_b // itemsize // max(size_e, 1)) * -(-size_e // n) * itemsize
        assert step.bytes == pytest.approx(want), f"{where}: {step.bytes} bytes, model says {want}"
        cost += step.bytes / (bandwidth[i] if bandwidth else 1.0)
        placements, orders = after_placements, after_orders
        assert (placements, orders) not in seen, f"{where}: revisits a state"
        seen.add((placements, orders))
    assert placements == dst
    assert orders == orders_for(dst, dst_order, ndim)
    assert plan.src == src and plan.dst == dst
    assert plan.cost == pytest.approx(cost, abs=1e-5)
    assert plan.bytes == round(sum(s.bytes for s in plan.steps))
    if plan.steps:
        assert plan.steps[-1].shard_order == dst_order


def exchange_oracle_bytes(
    mesh_shape: tuple[int, ...], global_shape: tuple[int, ...], src: Sequence[Placement], src_orders: Orders,
    dst_orders: Orders,
) -> int:
    """Elements the busiest rank lacks of its target piece, by chunking a tensor of global
    indices with the naive interpreter (tests/oracle.py)."""
    ids = torch.arange(math.prod(global_shape)).reshape(global_shape)
    worst = 0
    for c in coordinates(mesh_shape):
        def held(orders: Orders) -> set[int]:
            placements = [Replicate()] * len(mesh_shape)
            for d, ms in enumerate(orders):
                for m in ms:
                    placements[m] = Shard(d)
            return set(local_piece(ids, mesh_shape, placements, c, {d: ms for d, ms in enumerate(orders)}).flatten().tolist())
        worst = max(worst, len(held(dst_orders) - held(src_orders)))
    return worst


def naive_cost(
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    itemsize: int,
    src: tuple[Placement, ...],
    src_order: tuple[tuple[int, tuple[int, ...]], ...],
    bandwidth: tuple[float, ...] | None = None,
) -> float:
    """Gather everything to Replicate (innermost splitter first, Partial by all_reduce),
    then chunk and partialize to the target for free."""
    placements, orders = list(src), [list(ms) for ms in orders_for(src, src_order, len(global_shape))]
    cost = 0.0
    while any(p != Replicate() for p in placements):
        i = next(
            i
            for i, p in reversed(list(enumerate(placements)))
            if isinstance(p, Partial) or (isinstance(p, Shard) and orders[p.dim][-1] == i)
        )
        local = local_bytes(mesh_shape, global_shape, tuple(placements), tuple(map(tuple, orders)), itemsize)
        p = placements[i]
        kind = "all_reduce" if isinstance(p, Partial) else "all_gather"
        cost += expected_step_bytes(kind, mesh_shape[i], local, 0) / (bandwidth[i] if bandwidth else 1.0)
        if isinstance(p, Shard):
            orders[p.dim].pop()
        placements[i] = Replicate()
    return cost


# --- strategies -----------------------------------------------------------------------


def placement_strategy(ndim: int, ops: Sequence[str] = ("sum", "avg", "max", "min")) -> st.SearchStrategy[Placement]:
    choices: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if ops:
        choices.append(st.sampled_from(list(ops)).map(Partial))
    if ndim:
        choices.append(st.integers(0, ndim - 1).map(Shard))
    return st.one_of(*choices)


def draw_order(draw: st.DrawFn, placements: tuple[Placement, ...], ndim: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A random valid split order, canonical (only the non-default entries)."""
    wanted = {d: tuple(draw(st.permutations(ms))) for d, ms in split_orders(placements).items() if len(ms) > 1}
    return normalize_shard_order(placements, wanted, ndim)


Case = tuple[
    tuple[int, ...], tuple[int, ...], int, tuple[Placement, ...], tuple[Placement, ...],
    tuple[tuple[int, tuple[int, ...]], ...], tuple[tuple[int, tuple[int, ...]], ...],
]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    global_shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    ndim = len(global_shape)
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    src = tuple(draw(placement_strategy(ndim)) for _ in mesh_shape)
    dst = tuple(draw(placement_strategy(ndim)) for _ in mesh_shape)
    return mesh_shape, global_shape, itemsize, src, dst, draw_order(draw, src, ndim), draw_order(draw, dst, ndim)


# --- acceptance: lower bounds on (4,) and (2, 2) ---------------------------------------


def _kinds(plan: RedistributePlan) -> list[str]:
    return [s.kind for s in plan.steps]


SHAPES = [(8, 8), (16, 12), (4, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("src", "dst", "fraction", "kinds"),
    [
        ((S0,), (R,), 3 / 4, ["all_gather"]),
        ((S1,), (R,), 3 / 4, ["all_gather"]),
        ((P,), (S0,), 3 / 4, ["reduce_scatter"]),
        ((P,), (S1,), 3 / 4, ["reduce_scatter"]),
        ((P,), (R,), 2 * 3 / 4, ["all_reduce"]),  # ties with reduce_scatter + all_gather: fewer steps win
        ((S0,), (S1,), 3 / 16, ["all_to_all"]),  # (n-1)/n of the N/4 local piece
        ((S1,), (S0,), 3 / 16, ["all_to_all"]),
        ((R,), (S0,), 0, ["chunk"]),
        ((R,), (Partial("max"),), 0, ["partialize"]),
    ],
    ids=lambda v: "".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_lower_bound_bytes_on_mesh_4(
    shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...], fraction: float, kinds: list[str]
) -> None:
    plan = plan_redistribute((4,), shape, F32, src, dst)
    assert plan.bytes == fraction * math.prod(shape) * F32
    assert _kinds(plan) == kinds
    assert all(s.mesh_dim == 0 for s in plan.steps)
    check_plan(plan, (4,), shape, F32, src, dst)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("src", "dst", "fraction", "kinds"),
    [
        # all_gather over all 4 ranks: (n-1)/n of the tensor, whichever mesh dim goes first
        ((S0, S1), (R, R), 3 / 4, ["all_gather", "all_gather"]),
        ((S1, S0), (R, R), 3 / 4, ["all_gather", "all_gather"]),
        ((S0, S0), (R, R), 3 / 4, ["all_gather", "all_gather"]),
        ((R, S1), (R, R), 1 / 2, ["all_gather"]),
        ((S0, R), (R, R), 1 / 2, ["all_gather"]),
        # reduce_scatter over all 4 ranks
        ((P, P), (S0, S1), 3 / 4, ["reduce_scatter", "reduce_scatter"]),
        ((P, P), (S0, S0), 3 / 4, ["reduce_scatter", "reduce_scatter"]),
        ((P, R), (S0, R), 1 / 2, ["reduce_scatter"]),
        # all_reduce over all 4 ranks: 2(n-1)/n, reached as reduce_scatter, all_reduce, all_gather
        ((P, P), (R, R), 2 * 3 / 4, None),
        ((R, P), (R, R), 2 * 1 / 2, ["all_reduce"]),
        # all_to_all on one mesh dim of 2: (n-1)/n of the N/2 local piece
        ((S0, R), (S1, R), 1 / 4, ["all_to_all"]),
        ((R, S1), (R, S0), 1 / 4, ["all_to_all"]),
        # moving a shard between mesh dims: rank (0, 1) must receive half the tensor
        ((S0, R), (R, S0), 1 / 2, ["all_gather", "chunk"]),
        ((S0, S1), (S0, S1), 0, []),
        # splits trading mesh dims: one all_to_all over the mesh, each rank receives what it lacks
        ((S0, S1), (S1, S0), 1 / 4, ["exchange"]),  # (0, 0) and (1, 1) keep theirs; the others swap
        ((S0, S0), (S1, S1), 3 / 16, ["exchange"]),  # a column block of 4 rows, one of which it holds
    ],
    ids=lambda v: "".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_lower_bound_bytes_on_mesh_2x2(
    shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...], fraction: float, kinds: list[str] | None
) -> None:
    plan = plan_redistribute((2, 2), shape, F32, src, dst)
    assert plan.bytes == fraction * math.prod(shape) * F32
    if kinds is not None:
        assert sorted(_kinds(plan)) == sorted(kinds)
    check_plan(plan, (2, 2), shape, F32, src, dst)


def test_all_reduce_over_a_2x2_mesh_is_one_all_reduce_over_the_mesh() -> None:
    plan = plan_redistribute((2, 2), (8, 8), F32, (P, P), (R, R))
    assert plan.bytes == 384  # 2 * 3/4 * 256; two all_reduces would cost 512
    assert _kinds(plan) == ["all_reduce_mesh"]
    # without a group over the whole mesh: reduce_scatter, all_reduce, all_gather, the same bytes
    split = plan_redistribute((2, 2), (8, 8), F32, (P, P), (R, R), exchange=False)
    assert split.bytes == 384 and _kinds(split) == ["reduce_scatter", "all_reduce", "all_gather"]
    assert split.steps[0].mesh_dim == split.steps[2].mesh_dim != split.steps[1].mesh_dim


def test_nested_shards_are_undone_inside_out() -> None:
    plan = plan_redistribute((2, 2), (8, 8), F32, (S0, S0), (R, R))
    assert [(s.kind, s.mesh_dim, s.bytes) for s in plan.steps] == [("all_gather", 1, 64), ("all_gather", 0, 128)]
    swapped = plan_redistribute((2, 2), (8, 8), F32, (S0, S0), (R, R), ((0, (1, 0)),))
    assert [(s.kind, s.mesh_dim, s.bytes) for s in swapped.steps] == [("all_gather", 0, 64), ("all_gather", 1, 128)]


def test_changing_only_the_split_order_is_not_free() -> None:
    src, dst_order = (S0, S0), ((0, (1, 0)),)
    plan = plan_redistribute((2, 2), (8, 8), F32, src, src, (), dst_order)
    assert plan.steps and plan.bytes > 0
    assert plan.bytes <= naive_cost((2, 2), (8, 8), F32, src, ())
    check_plan(plan, (2, 2), (8, 8), F32, src, src, (), dst_order)


def test_bytes_scale_with_itemsize() -> None:
    for itemsize in (1, 2, 8):
        plan = plan_redistribute((2, 2), (16, 12), itemsize, (P, P), (S0, S1))
        assert plan.bytes == 3 / 4 * 16 * 12 * itemsize


# --- uneven shapes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "src", "dst", "want"),
    [
        ((7, 5), (S0,), (R,), 3 * 2 * 5 * F32),  # pieces 2, 2, 2, 1 rows: padded to 2
        ((3,), (S0,), (R,), 3 * 1 * F32),  # 1, 1, 1, 0
        ((3, 8), (S0,), (R,), 3 * 1 * 8 * F32),  # dim smaller than the mesh: 1, 1, 1, 0
        ((7, 5), (P,), (S0,), 3 * 2 * 5 * F32),
        ((0, 5), (S0,), (R,), 0),
        ((5, 0), (P,), (R,), 0),
    ],
)
def test_uneven_shapes_are_priced_at_the_largest_piece(
    shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...], want: int
) -> None:
    plan = plan_redistribute((4,), shape, F32, src, dst)
    assert len(plan.steps) == 1
    assert plan.bytes == want
    check_plan(plan, (4,), shape, F32, src, dst)


@pytest.mark.parametrize("shape", [(2, 3), (1, 1), (2, 9), (5, 2, 3)])
def test_tiny_dims_get_a_plan_no_dearer_than_the_direct_all_gather(shape: tuple[int, ...]) -> None:
    # (2, 3) on 4 ranks: rows 1, 1, 0, 0. The planner may detour through S(1) when the
    # model prices that lower; it must never price above the direct all_gather.
    plan = plan_redistribute((4,), shape, F32, (S0,), (R,))
    direct = 3 * math.prod(max_local_shape(shape, (4,), (S0,))) * F32
    assert 0 < plan.bytes <= direct
    check_plan(plan, (4,), shape, F32, (S0,), (R,))


def test_layouts_that_hold_the_same_boxes_move_nothing() -> None:
    # a [1, 1] tensor split by rows or by columns over 3 ranks: rank 0 holds it either way, the
    # others nothing; the move is a local relabel, not the all_to_all the per-dim model prices
    # at 2 elements (hypothesis found a detour through Replicate cheaper than the direct plan)
    plan = plan_redistribute((1, 3, 1), (1, 1), 1, (R, S0, R), (R, S1, R))
    assert plan.cost == 0 and [s.bytes for s in plan.steps] == [0], plan


def test_mesh_dims_of_size_one_cost_nothing() -> None:
    plan = plan_redistribute((1, 4), (8,), F32, (S0, S0), (R, R))
    assert [(s.kind, s.mesh_dim, s.bytes) for s in plan.steps] == [("all_gather", 1, 24), ("all_gather", 0, 0)]


# --- properties over random layouts ---------------------------------------------------


@SETTINGS
@given(cases())
def test_every_plan_is_a_valid_chain_priced_by_the_model(case: Case) -> None:
    mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order = case
    plan = plan_redistribute(mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order)
    check_plan(plan, mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order)


@SETTINGS
@given(cases())
def test_plan_is_never_worse_than_gathering_everything(case: Case) -> None:
    mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order = case
    plan = plan_redistribute(mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order)
    assert plan.cost <= naive_cost(mesh_shape, global_shape, itemsize, src, src_order) + 1e-6


@SETTINGS
@given(cases(), st.data())
def test_plan_is_never_worse_than_a_detour_through_another_layout(case: Case, data: st.DataObject) -> None:
    mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order = case
    ndim = len(global_shape)
    # Partial only where dst has that Partial: every edge of the detour is then one the
    # direct search may take too (partialize exists only towards the target's Partial).
    mid = tuple(
        data.draw(st.one_of(placement_strategy(ndim, ()), st.just(d)) if isinstance(d, Partial) else placement_strategy(ndim, ()))
        for d in dst
    )
    mid_order = draw_order(data.draw, mid, ndim)
    direct = plan_redistribute(mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order)
    first = plan_redistribute(mesh_shape, global_shape, itemsize, src, mid, src_order, mid_order)
    second = plan_redistribute(mesh_shape, global_shape, itemsize, mid, dst, mid_order, dst_order)
    assert direct.cost <= first.cost + second.cost + 1e-5


@SETTINGS
@given(cases(), st.data())
def test_weighted_plans_are_valid_and_cost_bytes_over_bandwidth(case: Case, data: st.DataObject) -> None:
    mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order = case
    bandwidth = tuple(data.draw(st.sampled_from([0.25, 1.0, 3.0])) for _ in mesh_shape)
    plan = plan_redistribute(mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order, bandwidth)
    check_plan(plan, mesh_shape, global_shape, itemsize, src, dst, src_order, dst_order, bandwidth)
    assert plan.cost <= naive_cost(mesh_shape, global_shape, itemsize, src, src_order, bandwidth) + 1e-5


@SETTINGS
@given(cases())
def test_equal_layouts_need_no_steps(case: Case) -> None:
    mesh_shape, global_shape, itemsize, src, _, src_order, _ = case
    plan = plan_redistribute(mesh_shape, global_shape, itemsize, src, src, src_order, src_order)
    assert plan.steps == () and plan.bytes == 0 and plan.cost == 0


# --- bandwidth ------------------------------------------------------------------------


def _bytes_on(plan: RedistributePlan, mesh_dim: int) -> float:
    return sum(s.bytes for s in plan.steps if s.mesh_dim == mesh_dim)


def test_a_slow_mesh_dim_is_relieved_at_the_price_of_more_bytes() -> None:
    src, dst = (S0, R), (R, R)
    fast = plan_redistribute((2, 2), (8, 8), F32, src, dst)
    assert [(s.kind, s.mesh_dim, s.bytes) for s in fast.steps] == [("all_gather", 0, 128)]
    # mesh dim 0 100x slower: chunk on the fast dim first, so the slow all_gather moves half.
    slow = plan_redistribute((2, 2), (8, 8), F32, src, dst, bandwidth=(0.01, 1.0))
    assert [(s.kind, s.mesh_dim, s.bytes) for s in slow.steps] == [
        ("chunk", 1, 0),
        ("all_gather", 0, 64),
        ("all_gather", 1, 128),
    ]
    assert slow.bytes == 192 > fast.bytes
    assert slow.cost == pytest.approx(64 / 0.01 + 128)
    check_plan(slow, (2, 2), (8, 8), F32, src, dst, bandwidth=(0.01, 1.0))
    # a slow mesh dim 1 changes nothing
    assert _kinds(plan_redistribute((2, 2), (8, 8), F32, src, dst, bandwidth=(1.0, 0.01))) == ["all_gather"]


@pytest.mark.parametrize("slow", [0, 1])
def test_a_slow_mesh_dim_carries_the_smallest_share_of_an_all_reduce(slow: int) -> None:
    bandwidth = tuple(0.01 if m == slow else 1.0 for m in range(2))
    plan = plan_redistribute((2, 2), (8, 8), F32, (P, P), (R, R), bandwidth=bandwidth)
    assert plan.bytes == 384
    assert _bytes_on(plan, slow) == 128  # only the reduction of a half-size piece
    assert _bytes_on(plan, 1 - slow) == 256
    assert plan.cost == pytest.approx(128 / 0.01 + 256)


# --- plan_for / explain_redistribute ----------------------------------------------------


def test_plan_for_normalizes_its_inputs() -> None:
    mesh = AbstractMesh((2, 2), ("dp", "tp"))
    plan = plan_for(mesh, (8, 8), [Shard(-2), Shard(-1)], [R, R], dtype=torch.bfloat16)
    assert plan.src == (S0, S1)
    assert plan.bytes == 3 / 4 * 64 * 2
    ordered = plan_for(mesh, (8,), [S0, S0], [S0, S0], dst_shard_order={0: (1, 0)})
    assert ordered.steps and ordered.steps[-1].orders == ((1, 0),)
    same = plan_for(mesh, (8,), [S0, S0], [S0, S0], src_shard_order={-1: [1, 0]}, dst_shard_order={0: (1, 0)})
    assert same.steps == ()


def test_plan_for_passes_bandwidth_through() -> None:
    plan = plan_for(AbstractMesh((2, 2)), (8, 8), [S0, R], [R, R], bandwidth=[0.01, 1])
    assert _kinds(plan) == ["chunk", "all_gather", "all_gather"]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"src": [S0], "dst": [R, R]}, r"src placements.*1 entries.*2 dims"),
        ({"src": [S0, R], "dst": [Shard(2), R]}, r"dst placements\[0\] = S\(2\).*\[-2, 1\]"),
        ({"src": [S0, R], "dst": [R, R], "bandwidth": [1.0]}, r"bandwidth \(1\.0,\).*\(2\)"),
        ({"src": [S0, S0], "dst": [R, R], "src_shard_order": {0: (1,)}}, r"\(1,\).*\(0, 1\)"),
    ],
)
def test_plan_for_rejects_bad_input_with_the_values(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        plan_for(AbstractMesh((2, 2)), (8, 8), **kwargs)  # type: ignore[arg-type]


def test_plan_for_rejects_non_placements() -> None:
    with pytest.raises(TypeError, match=r"src placements\[1\]"):
        plan_for(AbstractMesh((2, 2)), (8, 8), [S0, "R"], [R, R])  # type: ignore[list-item]


def test_explain_names_each_collective_and_the_total() -> None:
    text = explain_redistribute((2, 2), (8, 8), [P, R], [R, S0])
    plan = plan_for(AbstractMesh((2, 2)), (8, 8), [P, R], [R, S0])
    lines = text.splitlines()
    assert lines[0] == "redistribute (8, 8) on mesh (2, 2): (P(sum), R) -> (R, S(0))"
    assert len(lines) == len(plan.steps) + 2
    for k, step in enumerate(plan.steps, 1):
        assert lines[k].strip().startswith(f"{k}. mesh dim {step.mesh_dim}: {step.src} -> {step.dst} by {step.kind}")
        assert f"({round(step.bytes)} B)" in lines[k]
    assert {"all_reduce", "chunk"} <= set(re.findall(r"by (\w+)", text))
    assert lines[-1].strip() == "total: 128 B received per rank"  # chunk first: the all_reduce moves half


def test_explain_names_the_steps_over_the_whole_mesh() -> None:
    text = explain_redistribute((2, 2), (8, 8), [P, P], [R, R])
    assert "every mesh dim: (P(sum), P(sum)) -> (R, R) by one all_reduce over the mesh (384 B)" in text
    text = explain_redistribute((2, 2), (8, 8), [S0, S1], [S1, S0])
    assert "every mesh dim: (S(0), S(1)) -> (S(1), S(0)) by exchange, one all_to_all (64 B)" in text


def test_explain_accepts_an_abstract_mesh_and_keyword_options() -> None:
    text = explain_redistribute(AbstractMesh((4,)), (8, 8), [S0], [S1], dtype=torch.float64)
    assert "all_to_all" in text and "total: 96 B" in text  # 3/4 of the 16-element piece, 8 B each


def test_explain_says_when_there_is_nothing_to_do() -> None:
    text = explain_redistribute((4,), (8, 8), [S0], [S0])
    assert "nothing to do" in text and "total: 0 B" in text and len(text.splitlines()) == 3


def test_public_names_are_the_planner_ones() -> None:
    assert shardwise.explain_redistribute is explain_redistribute and shardwise.plan_for is plan_for
    assert shardwise.RedistributePlan is RedistributePlan
    assert "all_to_all" in shardwise.COST_MODEL and "bandwidth" in shardwise.COST_MODEL
    assert isinstance(plan_redistribute((4,), (8,), 4, (S0,), (R,)).steps[0], Step)


def test_planner_and_explain_doctests_pass() -> None:
    from shardwise import _explain

    for module in (_planner, _explain):
        result = doctest.testmod(module)
        assert result.attempted >= 1 and result.failed == 0, (module.__name__, result)


def test_normalize_placements_is_what_plan_for_uses() -> None:
    # plan_redistribute itself takes normalized input: plan_for must hand it S(1), not S(-1)
    plan = plan_for(AbstractMesh((4,)), (8, 8), [Shard(-1)], [R])
    assert plan.src == normalize_placements([Shard(-1)], 1, 2) == (S1,)
