"""The exchange step: one all_to_all over the whole mesh between unreduced layouts.

Pure part: every rank's routes, run by a simulator over every coordinate, rebuild each
target piece exactly as the naive interpreter (tests/oracle.py) chunks it, every message
is sent by exactly the rank its receiver expects it from with the size it expects, and
the busiest rank receives what `exchange_bytes` says. On ranks: the layouts that trade
splits across mesh dims move one all_to_all of exactly the lacking bytes, forward and
backward, on (2, 2) and on a 2-D mesh that does not cover the world (its own group).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise import Placement, Replicate, Shard
from shardwise._layout import normalize_shard_order, split_orders
from shardwise._redistribute._exchange import exchange_bytes, exchange_routes
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, seeded
from ..oracle import coordinates, local_piece

Orders = tuple[tuple[int, ...], ...]


def _orders(placements: tuple[Placement, ...], order: dict[int, tuple[int, ...]], ndim: int) -> Orders:
    found = split_orders(placements, normalize_shard_order(placements, order, ndim))
    return tuple(tuple(found.get(d, ())) for d in range(ndim))


def _region(t: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    for d, (start, length) in enumerate(box):
        t = t.narrow(d, start, length)
    return t


@st.composite
def _cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple, dict, tuple, dict]:
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=2, max_size=3)))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    choice = st.one_of(st.just(Replicate()), st.integers(0, len(shape) - 1).map(Shard))
    layouts = []
    for _ in range(2):
        placements = tuple(draw(choice) for _ in mesh_shape)
        order = {d: tuple(draw(st.permutations(ms))) for d, ms in split_orders(placements).items() if len(ms) > 1}
        layouts += [placements, order]
    return (mesh_shape, shape, *layouts)  # type: ignore[return-value]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_routes_rebuild_every_target_piece_from_messages_that_match(case: tuple) -> None:
    mesh_shape, shape, src, src_order, dst, dst_order = case
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    src_orders, dst_orders = _orders(src, src_order, len(shape)), _orders(dst, dst_order, len(shape))
    coords = list(coordinates(mesh_shape))
    routes = {c: exchange_routes(mesh_shape, shape, src_orders, dst_orders, c) for c in coords}
    pieces = {c: local_piece(full, mesh_shape, src, c, src_order) for c in coords}
    # messages[(sender, receiver)]: what the sender packs for the receiver
    messages = {(c, coords[peer]): _region(pieces[c], box) for c in coords for peer, box in routes[c].sends}
    worst = 0
    for c in coords:
        want = local_piece(full, mesh_shape, dst, c, dst_order)
        got = torch.full(routes[c].out_shape, float("nan"))
        keep = routes[c].keep
        if keep is not None:
            _region(got, keep[1]).copy_(_region(pieces[c], keep[0]))
        received = 0
        for peer, box in routes[c].recvs:
            message = messages.pop((coords[peer], c))
            target = _region(got, box)
            assert message.shape == target.shape, (c, coords[peer])
            target.copy_(message)
            received += message.numel()
        assert torch.equal(got, want), (c, src, src_order, dst, dst_order)
        worst = max(worst, received)
    assert not messages, f"sent but never expected: {sorted(messages)}"
    assert exchange_bytes(mesh_shape, shape, 4, src_orders, dst_orders) == worst * 4


@pytest.mark.parametrize(
    ("src", "dst", "received"),
    [
        # (0, 0) and (1, 1) hold their targets already; (0, 1) and (1, 0) swap a quarter each
        ((Shard(0), Shard(1)), (Shard(1), Shard(0)), {(0, 0): 0, (0, 1): 1 / 4, (1, 0): 1 / 4, (1, 1): 0}),
        # each rank's target column block has 4 row blocks, one of which it holds
        ((Shard(0), Shard(0)), (Shard(1), Shard(1)), {c: 3 / 16 for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}),
    ],
)
@distributed(world_size=4)
def test_splits_trading_mesh_dims_move_one_all_to_all_of_what_each_rank_lacks(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], received: dict[tuple[int, int], float]
) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = seeded(16, 12)
    x = sw.distribute_tensor(full, mesh, src).requires_grad_(True)
    with sw.comm_log() as log:
        y = x.redistribute(mesh, dst)
    coord = tuple(mesh.get_coordinate())  # type: ignore[arg-type]
    assert [r.op for r in log] == ["all_to_all"]
    assert log[0].bytes_received == received[coord] * full.numel() * 4  # type: ignore[index]
    assert torch.equal(y.to_local(), expected_piece(full, mesh.shape, dst, coord))
    # the backward is the exchange the other way
    grad = seeded(16, 12, seed=3)
    with sw.comm_log() as log:
        (y * sw.distribute_tensor(grad, mesh, dst)).sum().backward()
    assert "all_to_all" in [r.op for r in log] and "all_gather" not in [r.op for r in log]
    assert x.grad is not None and x.grad.placements == src
    assert torch.equal(x.grad.to_local(), expected_piece(grad, mesh.shape, src, coord))


@distributed(world_size=4)
def test_a_2d_mesh_on_part_of_the_world_exchanges_over_its_own_group() -> None:
    mesh = sw.DeviceMesh("cpu", [[3, 1]])  # (1, 2): ranks 0 and 2 are not in it (but build it: groups are collective)
    full = seeded(5, 5)  # uneven: the per-mesh-dim all_to_all pays for padding, the exchange does not
    plan = sw.plan_for(mesh, full.shape, (Shard(0), Shard(1)), (Shard(1), Shard(0)))
    assert [s.kind for s in plan.steps] == ["exchange"], plan.explain()
    if mesh.get_coordinate() is None:
        return
    x = sw.distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    with sw.comm_log() as log:
        y = x.redistribute(mesh, [Shard(1), Shard(0)])
    assert [r.op for r in log] == ["all_to_all"]
    assert torch.equal(y.to_local(), expected_piece(full, mesh.shape, [Shard(1), Shard(0)], mesh.get_coordinate()))
    assert torch.equal(y.full_tensor(), full)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@distributed(world_size=4)
def test_partial_on_every_mesh_dim_is_reduced_by_one_all_reduce_over_the_mesh(op: str) -> None:
    from ..dist_helpers import make_dtensor

    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = seeded(6, 5)
    x = make_dtensor(full, mesh, (sw.Partial(op), sw.Partial(op)))  # genuinely different terms per rank
    with sw.comm_log() as log:
        y = x.redistribute(mesh, [Replicate(), Replicate()])
    assert [(r.op, r.group_size) for r in log] == [("all_reduce", 4)]
    torch.testing.assert_close(y.to_local(), full)


@distributed(world_size=3)
def test_layouts_holding_the_same_boxes_are_relabelled_without_a_message() -> None:
    # a [1, 1] tensor split by rows or by columns over 3 ranks: rank 0 holds it either way
    mesh = sw.init_device_mesh("cpu", (1, 3))
    full = seeded(1, 1)
    x = sw.distribute_tensor(full, mesh, [Replicate(), Shard(0)]).requires_grad_(True)
    with sw.comm_log() as log:
        y = x.redistribute(mesh, [Replicate(), Shard(1)])
    assert list(log) == []
    coord = tuple(mesh.get_coordinate())  # type: ignore[arg-type]
    assert torch.equal(y.to_local(), expected_piece(full, mesh.shape, [Replicate(), Shard(1)], coord))
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad.full_tensor(), torch.ones(1, 1))
