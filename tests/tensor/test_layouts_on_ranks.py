"""Every layout on meshes (4,) and (2, 2), even and uneven: distribute, full_tensor, and
redistribute between every ordered pair, checked piece by piece against torch.chunk."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, layouts, make_dtensor, seeded

MESHES = [(4,), (2, 2)]
# even, uneven, and a dim smaller than the mesh (trailing ranks hold empty pieces)
SHAPES = [(8, 12), (7, 5), (3, 1)]


def _check_piece(dt: sw.DTensor, full: torch.Tensor, order: object = None, exact: bool = True) -> None:
    mesh = dt.device_mesh
    want = expected_piece(full, mesh.shape, dt.placements, mesh.get_coordinate(), order)  # type: ignore[arg-type]
    got = dt.to_local()
    assert got.shape == want.shape, (dt.placements, order, got.shape, want.shape)
    if exact:
        assert torch.equal(got, want), (dt.placements, order)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_distribute_then_full_tensor_is_exact_for_every_layout(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for shape in SHAPES + [(5,), (2, 3, 4)]:
        full = seeded(*shape)
        for placements, order in layouts(len(mesh_shape), len(shape), partials=("sum", "avg", "max", "min")):
            dt = sw.distribute_tensor(full, mesh, placements, shard_order=order)
            assert dt.shape == full.shape and dt.placements == placements
            if not any(p.is_partial() for p in placements):
                _check_piece(dt, full, order)
            assert torch.equal(dt.full_tensor(), full), (shape, placements, order)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4, timeout=240)
def test_redistribute_between_every_ordered_pair_of_layouts(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = seeded(*shape)
    all_layouts = list(layouts(len(mesh_shape), len(shape)))
    for src, src_order in all_layouts:
        exact = not any(p.is_partial() for p in src)
        for dst, dst_order in all_layouts:
            if any(q.is_partial() and q != p for p, q in zip(src, dst)):
                continue  # redistributing *to* Partial is refused (tested elsewhere)
            dt = make_dtensor(full, mesh, src, src_order)
            out = dt.redistribute(mesh, dst, shard_order=dst_order)
            assert out.placements == dst
            if not any(p.is_partial() for p in dst):
                _check_piece(out, full, dst_order, exact=exact)
            got = out.full_tensor()
            if exact:
                assert torch.equal(got, full), (src, src_order, dst, dst_order)
            else:
                torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_redistribute_moves_exactly_the_planned_bytes(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = seeded(8, 16)
    for src, src_order in layouts(len(mesh_shape), 2):
        for dst, dst_order in layouts(len(mesh_shape), 2, partials=()):
            dt = make_dtensor(full, mesh, src, src_order)
            plan = sw.plan_for(mesh, full.shape, src, dst, src_shard_order=src_order, dst_shard_order=dst_order)
            with sw.comm_log() as log:
                dt.redistribute(mesh, dst, shard_order=dst_order)
            moved = sum(r.bytes_received for r in log)
            # the plan prices the busiest rank: an exchange gives ranks holding their target nothing
            busiest = torch.tensor(moved)
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            assert moved <= plan.bytes == busiest.item(), (src, dst, moved, plan.explain())


@distributed(world_size=4)
def test_shard_to_shard_is_one_all_to_all_not_an_all_gather() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    dt = sw.distribute_tensor(seeded(16, 16), mesh, [Shard(0)])
    with sw.comm_log() as log:
        dt.redistribute(mesh, [Shard(1)])
    assert [r.op for r in log] == ["all_to_all"]
    assert log[0].bytes_received == 3 * 4 * 4 * 4  # (n-1) pieces of 4x4 fp32: (n-1)/n of the local 4x16


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@distributed(world_size=4)
def test_partial_reduce_ops_reduce_to_the_right_value(op: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = seeded(6, 5)
    for placements in [(Partial(op), Replicate()), (Partial(op), Partial(op)), (Shard(1), Partial(op))]:
        dt = make_dtensor(full, mesh, placements)
        torch.testing.assert_close(dt.full_tensor(), full)
        torch.testing.assert_close(dt.redistribute(mesh, [Shard(0), Replicate()]).full_tensor(), full)


@pytest.mark.parametrize("world_size", [1, 2])
def test_small_worlds(world_size: int) -> None:
    from shardwise.testing import run_distributed

    run_distributed(_redistribute_round_trip, world_size)


def _redistribute_round_trip() -> None:
    import torch.distributed as dist

    n = dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (n,))
    full = seeded(5, 3)
    for src, _ in layouts(1, 2):
        for dst, _ in layouts(1, 2, partials=()):
            out = make_dtensor(full, mesh, src).redistribute(mesh, dst)
            torch.testing.assert_close(out.full_tensor(), full)
