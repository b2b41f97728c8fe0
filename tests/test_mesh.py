"""DeviceMesh on real process groups: coordinates, groups, sub-meshes, current mesh, errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import AbstractMesh, Replicate, Shard
from shardwise.testing import distributed


@distributed(world_size=4)
def test_2d_mesh_coordinates_groups_and_sizes() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = dist.get_rank()
    assert mesh.get_coordinate() == [r // 2, r % 2]
    assert mesh.ndim == 2 and mesh.shape == (2, 2) and mesh.size() == 4 and mesh.size("tp") == 2
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert mesh.get_local_rank("dp") == r // 2 and mesh.get_local_rank(1) == r % 2
    # collectives on a mesh dim's group reach exactly that slice
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == sum(mesh.ranks_along("tp"))
    assert mesh.ranks_along("dp") == (r % 2, r % 2 + 2)


@distributed(world_size=4)
def test_sub_meshes_reuse_the_parent_groups() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    assert tp.ndim == 1 and tp.mesh_dim_names == ("tp",)
    assert tp.mesh.tolist() == list(mesh.ranks_along("tp"))
    assert tp.get_group() is mesh.get_group("tp")
    both = mesh["tp", "dp"]  # reordered dims
    assert both.shape == (2, 2) and both.mesh.tolist() == [[0, 2], [1, 3]]
    assert both.get_group("dp") is mesh.get_group("dp")
    # a DTensor on a sub-mesh works end to end
    x = torch.arange(12.0).reshape(4, 3)
    d = sw.distribute_tensor(x, tp, [Shard(0)])
    assert torch.equal(d.full_tensor(), x)


@distributed(world_size=4)
def test_mesh_as_context_manager_is_the_current_mesh() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    assert sw.current_mesh() is None
    with pytest.raises(ValueError, match="no current mesh"):
        sw.get_current_mesh()
    with mesh:
        assert sw.get_current_mesh() is mesh
        z = sw.zeros(8, 2, placements=[Shard(0)])
        assert z.device_mesh is mesh and z.to_local().shape == (2, 2)
    assert sw.current_mesh() is None


@distributed(world_size=4)
def test_creating_the_same_mesh_twice_reuses_groups() -> None:
    a = sw.init_device_mesh("cpu", (2, 2))
    b = sw.init_device_mesh("cpu", (2, 2))
    assert a == b and hash(a) == hash(b)
    assert a.get_group(0) is b.get_group(0) and a.get_group(1) is b.get_group(1)


@distributed(world_size=4)
def test_mesh_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"mesh_shape \(3,\) holds 3 ranks but the world has 4"):
        sw.init_device_mesh("cpu", (3,))
    with pytest.raises(ValueError, match=r"repeats \['tp'\]"):
        sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "tp"))
    with pytest.raises(ValueError, match=r"3 names for a 2-D mesh"):
        sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b", "c"))
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"'pp' is not a dim of this mesh \(dim names: \('dp', 'tp'\)\)"):
        mesh["pp"]
    with pytest.raises(ValueError, match=r"mesh dim 2 is out of range for a 2-D mesh"):
        mesh.size(2)
    with pytest.raises(ValueError, match=r"placements \(S\(0\)\) has 1 entries but the mesh has 2 dims"):
        sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"placements\[1\] = S\(2\) is out of range for a 2-D tensor: use a dim in \[-2, 1\]"):
        sw.distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(2)])
    with pytest.raises(TypeError, match=r"placements\[0\] is 'S0'"):
        sw.distribute_tensor(torch.ones(4, 4), mesh, ["S0", Replicate()])  # type: ignore[list-item]


def test_abstract_mesh_needs_no_processes() -> None:
    m = AbstractMesh((2, 4), ("dp", "tp"))
    assert m.size() == 8 and m.size("tp") == 4 and m.mesh_dim_index("dp") == 0
    assert m == AbstractMesh((2, 4), ("dp", "tp")) and m != AbstractMesh((4, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"'x' is not a dim of this mesh"):
        m.size("x")
    plan = sw.plan_for(AbstractMesh((64, 8)), (4096, 4096), [Shard(0), Shard(1)], [Replicate(), Replicate()])
    assert plan.bytes == (4096 * 4096 - 4096 * 4096 // 512) * 4  # all_gather lower bound over 512 ranks


@distributed(world_size=4)
def test_a_mesh_slice_listing_ranks_out_of_order_collects_in_mesh_order() -> None:
    # Regression: groups were made with torch's new_group, which sorts its ranks, so along
    # the row [3, 2] rank 2 came first and all_gather / reduce_scatter swapped the pieces.
    from shardwise import Partial, Shard

    from .dist_helpers import expected_piece, make_dtensor, seeded

    mesh = sw.DeviceMesh("cpu", [[0, 1], [3, 2]])
    full = seeded(8, 6)
    for placements in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Partial(), Shard(1)), (Shard(0), Partial())]:
        x = make_dtensor(full, mesh, placements)
        torch.testing.assert_close(x.full_tensor(), full)
        y = x.redistribute(mesh, [Shard(1), Shard(0)])
        coord = mesh.get_coordinate()
        torch.testing.assert_close(y.to_local(), expected_piece(full, mesh.shape, [Shard(1), Shard(0)], coord))


@pytest.mark.parametrize("shape", [("2",), (2.7,), (True,), (2, False), 4, "22"])
def test_abstract_mesh_refuses_sizes_that_are_not_ints_naming_them(shape: object) -> None:
    # Regression: int() coerced '2', 2.7 and True into sizes 2, 2 and 1
    with pytest.raises(TypeError, match=r"mesh shape") as err:
        AbstractMesh(shape)  # type: ignore[arg-type]
    assert repr(shape if not isinstance(shape, tuple) else next(s for s in shape if not type(s) is int)) in str(err.value)


@distributed(world_size=4)
def test_flatten_merges_mesh_dims_into_one_the_root_mesh_then_knows_by_name() -> None:
    # torchtitan's FSDP x CP code calls the private DeviceMesh._flatten (dp_shard x cp) and then
    # slices the flattened dim from the whole mesh; shardwise had no _flatten
    mesh = sw.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten()
    assert flat.mesh_dim_names == ("dp_shard_cp",) and flat.shape == (2,)
    r = dist.get_rank()
    assert flat.mesh.tolist() == ([0, 1] if r < 2 else [2, 3])
    assert mesh["dp_shard_cp"] == flat
    both = mesh["dp_replicate", "dp_shard_cp"]
    assert both.shape == (2, 2) and both.mesh.tolist() == [[0, 1], [2, 3]]
    dp = mesh["dp_replicate", "cp"]._flatten("dp_cp")  # not contiguous in the mesh: still row-major over them
    assert dp.mesh.tolist() == [0, 1, 2, 3] and mesh["dp_cp"].shape == (4,)
    # collectives go over the flattened group, in its order
    t = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh["dp_cp"], [Shard(0)])
    assert t.to_local().tolist() == [[2.0 * r, 2.0 * r + 1]]
    assert torch.equal(t.full_tensor(), torch.arange(8.0).reshape(4, 2))
    s = sw.DTensor.from_local(torch.tensor([float(r)]), both, [Shard(0), Replicate()], run_check=False)
    assert s.full_tensor().tolist() == ([0.0, 2.0] if r % 2 == 0 else [1.0, 3.0])
    with pytest.raises(ValueError, match="already has a dim of that name"):
        mesh["dp_replicate", "dp_shard"]._flatten("cp")
    with pytest.raises(ValueError, match=r"'nope' is not a dim of this mesh .*flattened dims \['dp_cp', 'dp_shard_cp'\]"):
        mesh["nope", "dp_cp"]


@distributed(world_size=4)
def test_unflatten_splits_a_dim_into_smaller_groups_over_the_same_ranks() -> None:
    # torchtitan builds its expert-parallel mesh by splitting a dim (the private
    # DeviceMesh._unflatten): ep borrows part of the data-parallel ranks
    r = dist.get_rank()
    world = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    split = world.unflatten("world", (2, 2), ("dp", "ep"))
    assert split.shape == (2, 2) and split.mesh_dim_names == ("dp", "ep")
    assert split.mesh.tolist() == [[0, 1], [2, 3]] and split.get_coordinate() == [r // 2, r % 2]
    assert split["ep"].mesh.tolist() == ([0, 1] if r < 2 else [2, 3])
    assert world._unflatten(0, (2, 2), ("dp", "ep")) == split
    # the same program through torch's DeviceMesh gives the same grid and slices
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    theirs = torch_mesh("cpu", (4,), mesh_dim_names=("world",))._unflatten(0, (2, 2), ("dp", "ep"))
    assert theirs.mesh.tolist() == split.mesh.tolist() and theirs.mesh_dim_names == split.mesh_dim_names
    for name in ("dp", "ep"):
        assert theirs[name].mesh.tolist() == split[name].mesh.tolist(), name
        assert theirs.get_local_rank(name) == split.get_local_rank(name), name
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=split.get_group("ep"))
    assert t.item() == sum(split.ranks_along("ep"))
    # a sub-mesh is split through its root: the other dims keep their groups, and a later
    # flatten of the new dims reaches every copy of the sub-mesh (here, both tp ranks)
    mesh = sw.init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp_shard", "tp"))
    moe = mesh["dp_shard"].unflatten("dp_shard", (2, 2), ("efsdp", "ep"))
    assert moe.mesh_dim_names == ("efsdp", "ep") and moe.mesh.tolist() == [[0, 1], [2, 3]]
    assert moe.get_group("ep") is split.get_group("ep")  # one group per slice of ranks
    assert moe["efsdp", "ep"]._flatten("dp_again").mesh.tolist() == [0, 1, 2, 3]
    s = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), moe, [Shard(0), Shard(1)])
    assert s.to_local().tolist() == [[4.0 * (r // 2) + r % 2], [4.0 * (r // 2) + 2 + r % 2]]
    assert torch.equal(s.full_tensor(), torch.arange(8.0).reshape(4, 2))
    with pytest.raises(ValueError, match=r"sizes must multiply to 4"):
        world.unflatten("world", (3, 2), ("a", "b"))
    with pytest.raises(ValueError, match=r"\['tp'\] already name dims"):
        mesh.unflatten("dp_shard", (2, 2), ("tp", "ep"))
    with pytest.raises(ValueError, match="one name per size"):
        world.unflatten(0, (2, 2), ("a",))


@distributed(world_size=2)
def test_unflatten_takes_torchtitans_fake_backend_override_and_makes_real_groups() -> None:
    # torchtitan's ParallelDims.build_mesh unflattens its world mesh with backend_override="fake"
    # for every dim of degree 1: `_unflatten` refused any backend_override, so it could not build
    world = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, 2), ("pp", "dp"), backend_override={"pp": "fake", "dp": "gloo"})
    assert mesh.mesh_dim_names == ("pp", "dp") and mesh.mesh.tolist() == [[0, 1]]
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=mesh.get_group("pp"))  # a real group of one, not a fake one
    assert t.item() == 1.0
    with pytest.raises(ValueError, match=r"backend_override=\{'dp': 'mpi'\}"):
        world._unflatten(0, (1, 2), ("pp", "dp"), backend_override={"dp": "mpi"})


def test_dry_mesh_unflatten_and_simulated_ranks() -> None:
    from shardwise.debug import dry_mesh, simulating

    mesh = dry_mesh((2, 8), mesh_dim_names=("pp", "dp"))
    assert mesh is dry_mesh((2, 8), mesh_dim_names=("pp", "dp")) and mesh.device_type == "meta"
    moe = mesh.unflatten("dp", (2, 4), ("efsdp", "ep"))
    assert moe.shape == (2, 2, 4) and moe.mesh_dim_names == ("pp", "efsdp", "ep")
    ep = mesh["dp"].unflatten("dp", (2, 4), ("efsdp", "ep"))["ep"]
    with simulating(13):
        assert moe.get_coordinate() == [1, 1, 1]
        assert ep.ranks_along("ep") == (12, 13, 14, 15) and ep.get_local_rank() == 1
    with pytest.raises(ValueError, match="must multiply to 8"):
        mesh.unflatten("dp", (3, 3), ("a", "b"))
