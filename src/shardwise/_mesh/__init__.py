"""The mesh: an n-D grid of ranks with named dims, and the process groups behind its slices.

One room per piece, each importing only the ones above it in this list:

| module | holds |
|---|---|
| `_abstract` | `AbstractMesh`: shape and dim names, no ranks (what a plan is written for) |
| `_groups` | every process group shardwise makes: one per slice of ranks, shared by the meshes that need it; the world-spanning groups for moves between meshes and for side jobs; groups a caller owns (`new_groups`, `destroy_groups`) |
| `_flat` | flattened and split dims (`mesh["dp", "cp"]._flatten("dp_cp")`, `mesh.unflatten("dp", (2, 2), ("dp_mod_ep", "ep"))`) and name lookups |
| `_device` | `DeviceMesh`, `init_device_mesh`, the current mesh (`with mesh:`) |
| `_dry` | `DryMesh`: a mesh with no processes behind it, what a dry run shards over (`dry_mesh`, `as_device_mesh`) |

Starting the default group and leaving at exit are the process's, not the mesh's:
`shardwise._process`. Other packages import from this package, never from its modules.
"""

from ._abstract import DRY_TWIN, AbstractMesh, MeshDim, check_names
from ._groups import (GROUPS, POINT_TO_POINT, crossing_group, destroy_groups, group_for, new_groups, replica_group,
                      side_group)
from ._device import DeviceMesh, _find_mesh, collective_timeout, current_mesh, get_current_mesh, init_device_mesh
from ._dry import (CACHE_SIZES, PER_RANK_CACHES, DryGroup, DryMesh, _caches_for, as_device_mesh, dry_mesh,
                   simulated_rank, simulating)

__all__ = ["CACHE_SIZES", "DRY_TWIN", "GROUPS", "PER_RANK_CACHES", "POINT_TO_POINT", "AbstractMesh", "DeviceMesh",
           "DryGroup", "DryMesh", "MeshDim", "_caches_for", "_find_mesh", "as_device_mesh", "check_names", "dry_mesh",
           "collective_timeout", "crossing_group", "current_mesh", "destroy_groups", "get_current_mesh", "group_for",
           "init_device_mesh", "new_groups", "replica_group", "side_group", "simulated_rank", "simulating"]
