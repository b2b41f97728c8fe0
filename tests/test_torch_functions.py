"""torch's own functions that take a mesh, given shardwise's (issue 50): a torch program whose
imports were switched to shardwise still calls them by their full paths.

- `torch.distributed._functional_collectives` with `group=mesh` (1-D) and `group=(mesh,
  mesh_dim)`, as torchtitan's loss logging calls them;
- `torch.distributed.tensor._random.manual_seed(seed, mesh)`, as torchtitan's
  `set_determinism` calls it (torch's warns on CPU meshes and seeds nothing; on CUDA it
  seeds torch's generator, which is what shardwise's random ops draw from);
- the mesh stays shardwise's everywhere else: `type()`, copies, pickles, and shardwise's
  refusal of torch's own mesh.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

import shardwise as sw
from shardwise.testing import distributed


@distributed(world_size=4)
def test_functional_collectives_take_a_shardwise_mesh_and_a_mesh_dim() -> None:
    rank = dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.tensor([float(rank + 1)])
    # over the whole of a 1-D mesh
    flat = sw.init_device_mesh("cpu", (4,))
    assert funcol.all_reduce(x, "sum", group=flat).item() == 10.0
    # over one dim of a 2-D mesh, by (mesh, dim) and by the sub-mesh
    dp_peers = [r + 1 for r in range(4) if r % 2 == rank % 2]
    tp_peers = [r + 1 for r in range(4) if r // 2 == rank // 2]
    assert funcol.all_reduce(x, "sum", group=(mesh, 0)).item() == sum(dp_peers)
    assert funcol.all_reduce(x, "max", group=mesh["tp"]).item() == max(tp_peers)
    gathered = funcol.all_gather_tensor(x, 0, group=(mesh, 1))
    assert gathered.tolist() == [float(p) for p in tp_peers]
    with pytest.raises(AssertionError, match="Only 1D mesh"):  # torch's own rule for a 2-D mesh whole
        funcol.all_reduce(x, "sum", group=mesh)


@distributed(world_size=2)
def test_a_shardwise_mesh_is_torchs_to_the_functional_collectives_only() -> None:
    from shardwise._describe import torch_twin

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    # torch's functional collectives take it for theirs; everything else, torch.compile included, sees shardwise's
    assert funcol._resolve_group(mesh) == mesh.get_group(0).group_name
    assert not isinstance(mesh, TorchDeviceMesh) and isinstance(mesh, sw.DeviceMesh)
    assert type(mesh) is sw.DeviceMesh and mesh.__class__ is sw.DeviceMesh
    assert copy.deepcopy(mesh) is mesh and pickle.loads(pickle.dumps(mesh)) == mesh  # (a live equal mesh)
    assert torch_twin(mesh) is None  # shardwise does not take its own mesh for torch's
    assert mesh._dim_group_names == [mesh.get_group(0).group_name]


@distributed(world_size=2)
def test_torchs_dtensor_manual_seed_takes_a_shardwise_mesh_as_it_takes_its_own() -> None:
    # torchtitan's set_determinism calls it with its world mesh; on a CPU mesh torch warns that its DTensor
    # RNG is for CUDA-like devices and seeds nothing, for its own mesh and for shardwise's alike
    import warnings

    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor._random import manual_seed

    ours = sw.init_device_mesh("cpu", (2,))
    theirs = torch_init_device_mesh("cpu", (2,))
    draws = []
    for mesh in (theirs, ours):
        torch.manual_seed(5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manual_seed(123, mesh)
        assert any("manual_seed" in str(w.message) for w in caught), [str(w.message) for w in caught]
        draws.append(torch.randn(3))
    assert torch.equal(draws[0], draws[1])  # the same (un)seeding under both meshes
