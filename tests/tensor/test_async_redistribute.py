"""`redistribute(async_op=True)`: returns before the collective completes, equals the
synchronous result (values, layout, gradients, bytes), and keeps every rank's collectives
in program order when other collectives are issued before the result is used."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise import _comm
from shardwise._tensor._async import Pending
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, make_dtensor, seeded

CASES = {
    (4,): [((Shard(0),), (Replicate(),)), ((Shard(0),), (Shard(1),)), ((sw.Partial(),), (Shard(1),))],
    (2, 2): [((Shard(0), Shard(1)), (Shard(1), Shard(0))), ((sw.Partial(), Shard(0)), (Replicate(), Replicate()))],
}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_async_redistribute_equals_sync_values_bytes_and_gradients(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for shape in [(8, 12), (7, 5)]:
        full, grad_full = seeded(*shape), seeded(*shape, seed=5)
        for src, dst in CASES[mesh_shape]:
            x = make_dtensor(full, mesh, src).requires_grad_(True)
            with sw.comm_log() as sync_log:
                want = x.redistribute(mesh, dst)
            with sw.comm_log() as async_log:
                got = x.redistribute(mesh, dst, async_op=True)
                assert type(got._local_tensor) is Pending and got.placements == dst and got.shape == full.shape
                local = got.to_local()  # waits; hands out the arrived piece
            assert type(local) is torch.Tensor and type(got._local_tensor) is torch.Tensor
            assert [(r.op, r.bytes_received) for r in async_log] == [(r.op, r.bytes_received) for r in sync_log]
            coord = mesh.get_coordinate()
            torch.testing.assert_close(local, expected_piece(full, mesh.shape, dst, coord), rtol=1e-6, atol=1e-6)
            # gradients flow back through the asynchronous result as through the synchronous one
            g = sw.distribute_tensor(grad_full, mesh, [Replicate()] * len(mesh_shape)).redistribute(mesh, dst)
            (want * g).sum().backward()
            sync_grad, x.grad = x.grad, None
            (got * g).sum().backward()
            assert x.grad is not None and sync_grad is not None and x.grad.placements == sync_grad.placements
            torch.testing.assert_close(x.grad.to_local(), sync_grad.to_local())


@distributed(world_size=2)
def test_async_redistribute_returns_before_the_collective_can_complete() -> None:
    # Rank 1 joins the all_gather only after rank 0 has looked at its result: if redistribute
    # waited for the collective, rank 0 would never get to look (and the test would time out).
    mesh = sw.init_device_mesh("cpu", (2,))
    store = dist.distributed_c10d._get_default_store()
    x = sw.distribute_tensor(seeded(6, 4), mesh, [Shard(0)])
    if dist.get_rank() == 0:
        y = x.redistribute(mesh, [Replicate()], async_op=True)
        assert not y._local_tensor._future.done()  # type: ignore[attr-defined]
        store.set("rank0_looked", "1")
    else:
        store.get("rank0_looked")
        y = x.redistribute(mesh, [Replicate()], async_op=True)
    assert torch.equal(y.to_local(), seeded(6, 4))


@distributed(world_size=4)
def test_collectives_issued_before_the_first_use_keep_program_order() -> None:
    # Several asynchronous redistributes on different mesh dims, a synchronous one and a
    # metadata collective in between, results used in reverse order: every rank issues the
    # collectives in program order, so nothing mismatches or hangs.
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = seeded(8, 8)
    x = sw.distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    a = x.redistribute(mesh, [Replicate(), Shard(1)], async_op=True)
    b = x.redistribute(mesh, [Shard(0), Replicate()], async_op=True)
    c = x.redistribute(mesh, [Shard(1), Shard(0)])  # synchronous: waits for a and b first
    d = a.redistribute(mesh, [Replicate(), Replicate()], async_op=True)  # a pending input
    ranks = _comm.all_gather_ints([dist.get_rank()], dist.group.WORLD, 4)
    assert ranks == [[0], [1], [2], [3]]
    coord = mesh.get_coordinate()
    assert torch.equal(d.to_local(), full)
    for t in (c, b, a):
        assert torch.equal(t.to_local(), expected_piece(full, mesh.shape, t.placements, coord))
    # ops on a DTensor whose piece is still in flight wait for it
    e = x.redistribute(mesh, [Replicate(), Replicate()], async_op=True)
    assert torch.equal((e * 2).full_tensor(), full * 2)


@distributed(world_size=2)
def test_an_error_in_a_background_job_is_raised_where_the_result_is_used() -> None:
    def fails() -> torch.Tensor:
        raise ValueError("the job failed on purpose")

    future = _comm.run_async(fails)
    with pytest.raises(ValueError, match="on purpose"):
        future.result()
    _comm.wait_pending()  # a failed job does not block the collectives after it
    mesh = sw.init_device_mesh("cpu", (2,))
    assert torch.equal(sw.distribute_tensor(seeded(4, 4), mesh, [Shard(0)]).full_tensor(), seeded(4, 4))


@distributed(world_size=2)
def test_compile_traces_an_async_redistribute_synchronously() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))

    def step(x: sw.DTensor) -> sw.DTensor:
        return x.redistribute(mesh, [Replicate()], async_op=True) * 3

    compiled = sw.compile(step)
    x = sw.distribute_tensor(seeded(6, 4), mesh, [Shard(0)])
    for _ in range(3):
        assert torch.equal(compiled(x).full_tensor(), seeded(6, 4) * 3)
    assert compiled.programs() == 1
