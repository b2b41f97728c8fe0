"""from_local (with and without run_check), factories and placement-invariant random numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, layouts, seeded

MESHES = [(4,), (2, 2)]


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_random_factories_give_the_same_global_tensor_under_every_layout(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for factory in (sw.rand, sw.randn):
        for shape in [(9, 6), (3, 1), (4, 5, 2)]:
            reference = None
            for placements, order in layouts(len(mesh_shape), len(shape), partials=()):
                torch.manual_seed(1234)
                dt = factory(*shape, device_mesh=mesh, placements=placements, shard_order=order)
                # each rank generated only its own piece
                want_shape = expected_piece(torch.empty(shape), mesh.shape, placements, mesh.get_coordinate(), order).shape
                assert dt.to_local().shape == want_shape
                full = dt.full_tensor()
                if reference is None:
                    reference = full
                assert torch.equal(full, reference), (factory.__name__, shape, placements, order)


@distributed(world_size=4)
def test_random_draws_differ_and_reseeding_reproduces() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(7)
    a = sw.randn(64, 64, device_mesh=mesh, placements=[Shard(0), Shard(1)]).full_tensor()
    b = sw.randn(64, 64, device_mesh=mesh, placements=[Shard(0), Shard(1)]).full_tensor()
    torch.manual_seed(7)
    c = sw.randn(64, 64, device_mesh=mesh, placements=[Replicate(), Replicate()]).full_tensor()
    assert not torch.equal(a, b) and torch.equal(a, c)
    assert abs(a.mean().item()) < 0.05 and abs(a.std().item() - 1) < 0.05
    u = sw.rand(64, 64, device_mesh=mesh, placements=[Shard(1), Replicate()], dtype=torch.float64).full_tensor()
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02


@distributed(world_size=4)
def test_random_factories_refuse_ranks_with_different_seeds() -> None:
    from shardwise._tensor import _random

    _random._STATE.checked = False  # the check runs on the first draw of a process
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(dist.get_rank())
    with pytest.raises(ValueError, match=r"same torch seed on every rank.*rank 0: \d+.*rank 3: \d+"):
        sw.rand(4, 4, device_mesh=mesh, placements=[Shard(0)])


@distributed(world_size=4)
def test_factories_allocate_only_the_local_piece() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    r = dist.get_rank()
    z = sw.zeros(5, 3, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    assert z.shape == (5, 3) and z.to_local().shape == expected_piece(torch.empty(5, 3), (2, 2), z.placements, mesh.get_coordinate()).shape
    o = sw.ones(4, 4, device_mesh=mesh, placements=[Partial(), Replicate()])
    assert torch.equal(o.full_tensor(), torch.ones(4, 4))  # a Partial(sum) of ones is still ones
    f = sw.full((6,), 2.5, device_mesh=mesh, placements=[Shard(0), Replicate()], dtype=torch.float64)
    assert f.dtype == torch.float64 and torch.equal(f.full_tensor(), torch.full((6,), 2.5, dtype=torch.float64))
    e = sw.empty(8, device_mesh=mesh, placements=[Replicate(), Shard(0)], requires_grad=True)
    assert e.requires_grad and e.is_leaf and e.to_local().shape == (4,)
    del r


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_from_local_run_check_infers_uneven_global_shapes(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = seeded(7, 5)
    for placements, order in layouts(len(mesh_shape), 2, partials=()):
        piece = expected_piece(full, mesh.shape, placements, mesh.get_coordinate(), order)
        dt = DTensor.from_local(piece.clone(), mesh, placements, run_check=True, shard_order=order)
        assert dt.shape == full.shape, (placements, order, dt.shape)
        assert torch.equal(dt.full_tensor(), full)


@distributed(world_size=4)
def test_from_local_run_check_rejects_shapes_that_disagree_naming_every_rank() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    r = dist.get_rank()
    local = torch.zeros(2, 3 if r != 2 else 4)  # rank 2 disagrees on an unsharded dim
    with pytest.raises(ValueError, match=r"rank 2 has \(2, 4\), expected \(2, 3\).*rank 0: \(2, 3\)"):
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    local = torch.zeros(2 if r != 0 else 1, 3)  # first piece smaller than a later one: not torch.chunk sizes
    with pytest.raises(ValueError, match=r"do not form a \(S\(0\)\) layout"):
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    with pytest.raises(ValueError, match=r"(?s)disagree on the local tensor's metadata.*dtype: rank 1 differs"):
        DTensor.from_local(torch.zeros(2, 3, dtype=torch.float64 if r == 1 else torch.float32), mesh, [Shard(0)], run_check=True)


@distributed(world_size=4)
def test_from_local_run_check_broadcasts_replicated_data() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    local = torch.full((3,), float(dist.get_rank()))
    dt = DTensor.from_local(local, mesh, [Replicate()], run_check=True)
    assert torch.equal(dt.to_local(), torch.zeros(3))


@distributed(world_size=4)
def test_from_local_without_check_assumes_even_pieces_and_shape_overrides() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    local = torch.ones(3, 2)
    assert DTensor.from_local(local, mesh, [Shard(0), Shard(1)]).shape == (6, 4)
    assert DTensor.from_local(local, mesh, [Shard(1), Shard(1)]).shape == (3, 8)
    dt = DTensor.from_local(local, mesh, [Shard(0), Replicate()], shape=(5, 2), stride=(2, 1))
    assert dt.shape == (5, 2)
    with pytest.raises(ValueError, match=r"pass both or neither"):
        DTensor.from_local(local, mesh, [Shard(0), Replicate()], shape=(5, 2))


@distributed(world_size=4)
def test_redistribute_to_partial_splits_the_value_into_exact_terms() -> None:
    # (it was refused, as torch refuses it; tests/redistribute/test_partial_reduce_ops.py covers every op)
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    y = x.redistribute(mesh, [Partial()])
    assert y.placements == (Partial(),) and torch.equal(y.full_tensor(), torch.ones(4, 4))
    assert torch.equal(y.to_local(), torch.ones(4, 4) if mesh.get_local_rank(0) == 0 else torch.zeros(4, 4))
    p = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
    assert p.redistribute(mesh, [Partial()]) is p  # staying Partial is a no-op, not a request for one
