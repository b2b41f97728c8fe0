"""`ft_init_device_mesh`: a replica group's mesh, written as torchft's HSDP programs write it.

torchft's HSDP program names a mesh whose replicate dim is the replica groups:
`ft_init_device_mesh("cpu", (1, 2), ("dp_replicate", "dp_shard"), replicate_dim=0, manager=m)`.
Under shardwise each replica group is its own launch, so that dim holds one slot in every
group's world (size 1), and the average over the groups is `DistributedDataParallel`'s
`across` reducer, not a process group inside the mesh. The mesh returned is the group's own
mesh with that size-1 dim kept in place, so `fully_shard(model, mesh=mesh)` and the rest of
the program run unchanged.

The replicate dim must be the outermost: the groups are separate worlds, and a mesh whose
replicas were interleaved inside one group's ranks would be one launch, not several.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from .._mesh import DeviceMesh, init_device_mesh
from ._manager import Manager

__all__ = ["ft_init_device_mesh"]


def ft_init_device_mesh(device_type: str, mesh_shape: Sequence[int], mesh_dim_names: Optional[Sequence[str]] = None,
                        replicate_dim: int = 0, *, manager: Manager) -> DeviceMesh:
    """This replica group's mesh for an HSDP program (see the module docstring); ValueError
    naming the value for a replicate dim that is not the outermost or not of size 1."""
    if not isinstance(manager, Manager):
        raise TypeError(f"ft_init_device_mesh(manager={manager!r}): a shardwise.ft.Manager is expected")
    shape = tuple(mesh_shape)
    if len(shape) < 2:
        raise ValueError(f"ft_init_device_mesh(mesh_shape={shape}): a replicate dim and at least one dim inside each "
                         "group are expected, e.g. (1, 2) for ('dp_replicate', 'dp_shard')")
    if replicate_dim != 0:
        names = f" ({mesh_dim_names[replicate_dim]!r})" if mesh_dim_names and 0 <= replicate_dim < len(shape) else ""
        raise ValueError(f"ft_init_device_mesh(replicate_dim={replicate_dim}){names}: the replicate dim must be the "
                         "outermost, 0: replica groups are separate launches, each its own world; put it first, "
                         f"e.g. mesh_shape={(1, *shape[:replicate_dim], *shape[replicate_dim + 1:])}")
    if shape[0] != 1:
        raise ValueError(f"ft_init_device_mesh(mesh_shape={shape}): the replicate dim has size {shape[0]}; each "
                         "replica group is its own launch and holds one slot of it, so give 1 (the number of "
                         "groups is `shardwise run --ft --groups G`)")
    if manager.world_size != _product(shape):
        raise ValueError(f"ft_init_device_mesh(mesh_shape={shape}): {_product(shape)} ranks, but this replica group "
                         f"has {manager.world_size}; the dims inside the group must multiply to its size")
    return init_device_mesh(device_type, shape, mesh_dim_names=mesh_dim_names)


def _product(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
