"""Device meshes: an n-D grid of ranks with optional dim names (`AbstractMesh`, shape and
names only, is in `_abstract`).

`DeviceMesh` adds the rank grid and one `torch.distributed` process group per slice of
each mesh dim, created once (by every process, in the same order) and reused by every
mesh and sub-mesh that needs the same slice.
"""

from __future__ import annotations

import contextvars
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .._process import collective_timeout, init_default_group, note_process
from ._groups import GROUPS, crossing_group, group_for
from ._abstract import AbstractMesh, MeshDim, check_names
from ._flat import flatten, resolve_names, unflatten
from ._torch_facing import torch_facing

__all__ = ["AbstractMesh", "DeviceMesh", "init_device_mesh", "current_mesh", "get_current_mesh", "collective_timeout"]


# Every mesh built in this process, by its ranks, shape and names: a pickled mesh (inside a
# `torch.save`d DTensor) is found again here on load, without creating process groups.
_LIVE: weakref.WeakValueDictionary[tuple[Any, ...], DeviceMesh] = weakref.WeakValueDictionary()


def _find_mesh(device_type: str, ranks: list[int], shape: tuple[int, ...], names: Optional[tuple[str, ...]]) -> DeviceMesh:
    """The mesh a pickled DTensor was saved on, in this process (`DeviceMesh.__reduce__`):
    a live one with the same ranks, shape and names, else one made from the process groups
    already created for its slices; never a new process group (that would be collective)."""
    key = (device_type, tuple(ranks), tuple(shape), names)
    found = _LIVE.get(key)
    if found is not None:
        return found
    described = f"DeviceMesh({device_type!r}, {torch.tensor(ranks).reshape(shape).tolist()})"
    if not dist.is_initialized():
        raise ValueError(
            f"loading a DTensor saved on {described} needs torch.distributed initialized and that mesh created "
            f"(init_device_mesh / DeviceMesh) on every rank first; to read a checkpoint in one process use "
            f"shardwise.checkpoint"
        )
    grid = torch.tensor(ranks, dtype=torch.int64).reshape(shape)
    me = dist.get_rank()
    groups: list[Any] = []
    for i in range(len(shape)):
        chosen = None
        for row in grid.movedim(i, -1).reshape(-1, shape[i]).tolist():
            if me in row:
                chosen = dist.group.WORLD if row == list(range(dist.get_world_size())) else GROUPS.get((id(dist.group.WORLD), tuple(row)))
                if chosen is None:
                    raise ValueError(
                        f"loading a DTensor saved on {described}: this process has no such mesh; create it on every "
                        f"rank (init_device_mesh / DeviceMesh with the same ranks) before torch.load"
                    )
        groups.append(chosen)
    return DeviceMesh(device_type, grid, mesh_dim_names=names, _groups=tuple(groups))


_CURRENT: contextvars.ContextVar[tuple[DeviceMesh, ...]] = contextvars.ContextVar("shardwise_mesh", default=())


class DeviceMesh(AbstractMesh):
    """An n-D grid of global ranks; collectives along a mesh dim use that dim's group.

    Construct it on every process with the same arguments (it creates process groups).
    As a context manager it becomes the current mesh, used by factories when no mesh is given.
    """

    __slots__ = ("device_type", "_grid", "_ranks", "_coordinate", "_groups", "_slice_ranks", "_whole", "_sliced_from", "_flattened",
                 "__weakref__")

    device_type: str

    def __init__(
        self,
        device_type: str,
        mesh: Union[torch.Tensor, Sequence[Any]],
        *,
        mesh_dim_names: Optional[Sequence[str]] = None,
        _groups: Optional[tuple[Any, ...]] = None,
    ) -> None:
        grid = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
        if grid.ndim == 0:
            grid = grid.reshape(1)
        super().__init__(tuple(grid.shape), mesh_dim_names)
        ranks = grid.flatten().tolist()
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"mesh {grid.tolist()} lists a rank twice: every rank may appear once")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: use shardwise.init_device_mesh (it initializes from "
                "torchrun's environment) or call torch.distributed.init_process_group first"
            )
        world = dist.get_world_size()
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"mesh ranks {bad} are outside the world of {world} processes: use ranks in [0, {world - 1}]")
        self.device_type = device_type
        self._grid = grid
        # the ranks in order, as Python ints: equality and hashing never touch the grid tensor
        # (a tensor op would be intercepted while torch.compile traces with fake tensors)
        self._ranks = tuple(ranks)
        self._hash = hash((device_type, self._ranks, self.shape, self.mesh_dim_names))
        me = dist.get_rank()
        where = (grid == me).nonzero()
        self._coordinate: Optional[tuple[int, ...]] = tuple(where[0].tolist()) if len(where) else None
        whole = _groups is None
        if _groups is None:
            _groups = self._create_groups()
        self._groups = _groups
        self._slice_ranks = tuple(self._ranks_along(i) for i in range(self.ndim))
        self._whole = self._whole_group(ranks, create=whole)
        self._sliced_from: Optional[tuple[DeviceMesh, tuple[int, ...]]] = None  # (root mesh, its dims) of a sub-mesh
        self._flattened: dict[str, tuple[int, ...]] = {}  # flattened dim name -> the dims it merges (`_flat`)
        _LIVE.setdefault(self._key(), self)
        note_process()  # so that peers can tell this process died, should it (once per process)

    def _whole_group(self, ranks: list[int], create: bool) -> Optional[tuple[Any, tuple[int, ...]]]:
        """The group over every rank of a mesh of 2+ dims (for a redistribute's exchange step)
        and each mesh position's rank in it: WORLD when the mesh covers the world, else made
        here when this constructor makes the per-dim groups (collectively), else None."""
        if self.ndim < 2:
            return None
        if sorted(ranks) == list(range(dist.get_world_size())):
            return dist.group.WORLD, tuple(ranks)
        if not create:
            return None
        group = group_for(tuple(sorted(ranks)), "nccl" if self.device_type == "cuda" else None)
        if self._coordinate is None:
            return None
        return group, tuple(dist.get_group_rank(group, r) for r in ranks)

    def _create_groups(self) -> tuple[Any, ...]:
        backend = "nccl" if self.device_type == "cuda" else None
        crossing_group(backend)  # made with the first mesh (collectively), for moves between meshes
        mine: list[Any] = []
        for i in range(self.ndim):
            moved = self._grid.movedim(i, -1).reshape(-1, self.shape[i])
            chosen = None
            for row in moved.tolist():
                group = group_for(tuple(row), backend)
                if self._coordinate is not None and dist.get_rank() in row:
                    chosen = group
            mine.append(chosen)
        return tuple(mine)

    def _ranks_along(self, mesh_dim: int) -> tuple[int, ...]:
        if self._coordinate is None:
            return ()
        index: list[Any] = list(self._coordinate)
        index[mesh_dim] = slice(None)
        return tuple(self._grid[tuple(index)].tolist())

    # -- queries -------------------------------------------------------------------
    @property
    def mesh(self) -> torch.Tensor:
        """The grid of global ranks."""
        return self._grid

    def get_coordinate(self) -> Optional[list[int]]:
        """This process's coordinate in the mesh, or None if it is not part of it."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_rank(self) -> int:
        return dist.get_rank()

    def get_local_rank(self, mesh_dim: Optional[MeshDim] = None) -> int:
        i = self._one_dim(mesh_dim)
        coordinate = self._require_member()
        return coordinate[i]

    def get_group(self, mesh_dim: Optional[MeshDim] = None) -> Any:
        """The process group of this process's slice along `mesh_dim`."""
        i = self._one_dim(mesh_dim)
        self._require_member()
        return self._groups[i]

    def get_all_groups(self) -> list[Any]:
        return list(self._groups)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: F811 -- what isinstance() consults: see `_torch_facing`
        return torch_facing(type(self), sys._getframe(1))

    @property
    def _dim_group_names(self) -> list[str]:
        """Each mesh dim's process group name, as torch's mesh lists them (torch's functional
        collectives resolve `group=mesh` and `(mesh, mesh_dim)` through it)."""
        self._require_member()
        return [group.group_name for group in self._groups]

    @property
    def has_mesh_group(self) -> bool:
        """Whether this mesh has a process group over all its ranks (a mesh of 2+ dims built
        by `DeviceMesh(...)` / `init_device_mesh`; a sub-mesh has one only when it covers
        the world): redistribute plans use the exchange step only where it does."""
        return self._whole is not None

    def get_mesh_group(self) -> Optional[tuple[Any, tuple[int, ...]]]:
        """The process group over every rank of the mesh and each mesh position's rank in
        it (row-major), or None where `has_mesh_group` is False."""
        return self._whole

    def ranks_along(self, mesh_dim: MeshDim) -> tuple[int, ...]:
        """Global ranks of this process's slice along `mesh_dim`, in mesh order."""
        return self._slice_ranks[self.mesh_dim_index(mesh_dim)]

    def _one_dim(self, mesh_dim: Optional[MeshDim]) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"this mesh has {self.ndim} dims {self.shape}: name the mesh dim you mean")
            return 0
        return self.mesh_dim_index(mesh_dim)

    def _require_member(self) -> tuple[int, ...]:
        if self._coordinate is None:
            raise ValueError(f"rank {dist.get_rank()} is not part of the mesh {self._grid.tolist()}")
        return self._coordinate

    def abstract(self) -> AbstractMesh:
        return AbstractMesh(self.shape, self.mesh_dim_names)

    # -- sub-meshes ----------------------------------------------------------------
    def __getitem__(self, names: Union[str, Sequence[str]]) -> DeviceMesh:
        """The sub-mesh over the named dims that contains this process: `mesh["tp"]`."""
        if isinstance(names, str):
            names = (names,)
        names = tuple(names)
        if self.mesh_dim_names is None and not self._flattened:
            raise ValueError(f"mesh {self.shape} has no dim names: create it with mesh_dim_names= to slice by name")
        if self._flattened and any(n in self._flattened for n in names):
            flat: DeviceMesh = resolve_names(self, names)  # a dim made by `_flatten`
            return flat
        dims = [self.mesh_dim_index(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"sub-mesh names {names} repeat a dim")
        coordinate = self._require_member()
        index: list[Any] = [slice(None) if i in dims else c for i, c in enumerate(coordinate)]
        kept = [i for i in range(self.ndim) if i in dims]
        sub = self._grid[tuple(index)].permute([kept.index(d) for d in dims])
        made = DeviceMesh(
            self.device_type, sub, mesh_dim_names=names, _groups=tuple(self._groups[d] for d in dims)
        )
        root, root_dims = self._sliced_from or (self, tuple(range(self.ndim)))
        made._sliced_from = (root, tuple(root_dims[d] for d in dims))
        return made

    def _flatten(self, mesh_dim_name: Optional[str] = None) -> DeviceMesh:
        """This mesh as one dim over its ranks (row-major), named `mesh_dim_name` (default: the
        names joined by "_"), which the mesh it was sliced from then knows as a dim: torch's
        private `DeviceMesh._flatten`, as torchtitan calls it. Call on every process."""
        flat: DeviceMesh = flatten(self, mesh_dim_name)
        return flat

    def unflatten(self, mesh_dim: MeshDim, sizes: Sequence[int], names: Sequence[str]) -> DeviceMesh:
        """The same ranks with mesh dim `mesh_dim` split into dims of `sizes` (row-major) named
        `names`: e.g. expert parallelism over part of the data-parallel ranks,
        `mesh.unflatten("dp_shard", (2, 2), ("dp_shard_mod_ep", "ep"))`. The other dims keep
        their process groups; the new dims' groups are made here, so call it on every process.
        On a sub-mesh, the mesh it was sliced from gains the dims and the result is its slice."""
        split: DeviceMesh = unflatten(self, mesh_dim, sizes, names)
        return split

    def _unflatten(self, dim: MeshDim, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override: Any = None) -> DeviceMesh:
        """torch's private `DeviceMesh._unflatten`, as torchtitan calls it: `unflatten`.

        `backend_override` maps new dim names (or their positions) to a backend. torchtitan's
        `ParallelDims` passes "fake" for every dim of degree 1 and for dims it never
        communicates over, to spare torch the process groups; here those dims get real groups
        (a collective over them is then right, not a fake's garbage), so "fake" and the mesh's
        own backend are taken as they are; any other backend is refused."""
        if backend_override:
            own = (None, "fake", "nccl" if self.device_type == "cuda" else "gloo")
            other = {k: v for k, v in dict(backend_override).items()
                     if (v[0] if isinstance(v, tuple) else v) not in own}
            if other:
                raise ValueError(f"_unflatten(backend_override={other}): a mesh's dims use the mesh's backend; only "
                                 f"'fake' (taken as the mesh's backend) or the mesh's own backend may be named")
        return self.unflatten(dim, mesh_sizes, mesh_dim_names)

    # -- current mesh ----------------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        _CURRENT.set(_CURRENT.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.set(_CURRENT.get()[:-1])

    def _key(self) -> tuple[Any, ...]:
        return (self.device_type, self._ranks, self.shape, self.mesh_dim_names)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        return type(other) is DeviceMesh and self._hash == other._hash and self._key() == other._key()

    __hash__ = AbstractMesh.__hash__

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceMesh:
        # a mesh names process groups, which cannot be copied: `copy.deepcopy(model)` of a
        # sharded model shares it, as it shares the processes
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its ranks, shape and names; loading finds the live mesh (`_find_mesh`)."""
        return (_find_mesh, (self.device_type, self._grid.flatten().tolist(), self.shape, self.mesh_dim_names))

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self._grid.tolist()}{names})"


def get_current_mesh() -> DeviceMesh:
    """The innermost mesh entered with `with mesh:`; raises if there is none."""
    stack = _CURRENT.get()
    if not stack:
        raise ValueError("no current mesh: pass device_mesh= or enter one with `with mesh:`")
    return stack[-1]


def current_mesh() -> Optional[DeviceMesh]:
    """The innermost mesh entered with `with mesh:`, or None."""
    stack = _CURRENT.get()
    return stack[-1] if stack else None


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Optional[Sequence[str]] = None
) -> DeviceMesh:
    """A mesh of shape `mesh_shape` over all processes, in rank order.

    Initializes the default process group from torchrun's environment if needed (gloo for
    cpu, nccl for cuda). Call it on every process with the same arguments.
    """
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
        raise TypeError(f"mesh_shape must be a sequence of ints, one per mesh dim, got {mesh_shape!r}: e.g. (2, 4)")
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape {shape} is invalid: give positive ints, one per mesh dim")
    check_names(mesh_dim_names, len(shape))
    n = 1
    for s in shape:
        n *= s
    if not dist.is_initialized():
        init_default_group(device_type, n)
    world = dist.get_world_size()
    if n != world:
        raise ValueError(
            f"mesh_shape {shape} holds {n} ranks but the world has {world} processes: "
            f"the product of mesh_shape must equal the world size"
        )
    grid = torch.arange(n).reshape(shape)
    return DeviceMesh(device_type, grid, mesh_dim_names=mesh_dim_names)

