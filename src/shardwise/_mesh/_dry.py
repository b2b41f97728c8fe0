"""Meshes with no processes behind them: what a dry run shards a model on and runs it over.

`DryMesh` is a `DeviceMesh` of device type "meta" whose groups are `DryGroup` labels, not
process groups: the door answers their collectives (`_comm._dry`) with results of the right
shape and no data, and tells its hooks as it would of a real one. Any `AbstractMesh` given
where a DeviceMesh is expected (`distribute_tensor`, `parallelize_module`, `shard_module`,
`replicate`, ...) becomes its DryMesh (`as_device_mesh`), so plans and styles shard a model
of meta parameters for a mesh of any size on one process, with no memory.

A DryMesh plays one rank at a time, the *simulated rank* (`simulating(rank)`; rank 0, the
one holding the largest uneven pieces, by default): its coordinate is read whenever the mesh
is asked, so the same sharded model serves a run as any rank. A sub-mesh (`mesh["tp"]`) is
the slice through the simulated rank, whichever that is.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ._device import AbstractMesh, DeviceMesh
from ._abstract import DRY_TWIN
from ._flat import _checked_split

__all__ = ["DryGroup", "DryMesh", "as_device_mesh", "dry_mesh", "simulated_rank", "simulating"]

_SIMULATED: contextvars.ContextVar[int] = contextvars.ContextVar("shardwise_simulated_rank", default=0)


def simulated_rank() -> int:
    """The global rank a DryMesh plays now."""
    return _SIMULATED.get()


# Caches whose entries hold one rank's view (a plan's local shapes, a collective's `index`):
# emptied whenever the simulated rank changes (their modules append their `clear`s here)
PER_RANK_CACHES: list[Any] = []
_CACHED_FOR = [0]
# every cache of layouts and plans, by name -> its entries now (`shardwise.debug.cache_info()`)
CACHE_SIZES: dict[str, Any] = {}


def _caches_for(rank: int) -> None:
    if rank != _CACHED_FOR[0]:
        for clear in PER_RANK_CACHES:
            clear()
        _CACHED_FOR[0] = rank


@contextlib.contextmanager
def simulating(rank: int) -> Iterator[None]:
    """Inside the block, every DryMesh plays global rank `rank`."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"a simulated rank is an int >= 0, got {rank!r}")
    token = _SIMULATED.set(rank)
    _caches_for(rank)
    try:
        yield
    finally:
        _SIMULATED.reset(token)
        _caches_for(_SIMULATED.get())


@dataclass(frozen=True)
class DryGroup:
    """The group of a DryMesh's slice: which root mesh, which of its dims, how many ranks.
    The same label serves every simulated rank (a collective record may be cached and replayed)."""

    root: tuple[tuple[int, ...], Optional[tuple[str, ...]]]
    dims: tuple[int, ...]
    size: int

    @property
    def dim_names(self) -> tuple[str, ...]:
        names = self.root[1]
        return tuple(names[d] if names else str(d) for d in self.dims)


_MESHES: dict[tuple[Any, ...], DryMesh] = {}


class DryMesh(DeviceMesh):
    """A DeviceMesh with no processes (see the module docstring). Build it from an
    `AbstractMesh` with `as_device_mesh`, or `DryMesh((8, 8), ("dp", "tp"))`."""

    __slots__ = ("_root", "_dims")

    def __init__(self, shape: Sequence[int], mesh_dim_names: Optional[Sequence[str]] = None, *,
                 _root: Optional[tuple[tuple[int, ...], Optional[tuple[str, ...]]]] = None,
                 _dims: Optional[tuple[int, ...]] = None) -> None:
        AbstractMesh.__init__(self, shape, mesh_dim_names)
        self.device_type = "meta"
        self._root = (self.shape, self.mesh_dim_names) if _root is None else _root
        self._dims = tuple(range(self.ndim)) if _dims is None else _dims
        self._sliced_from, self._flattened = None, {}  # (no flattened dims on a dry mesh)
        self._hash = hash(("dry",) + self._key())

    @classmethod
    def of(cls, mesh: AbstractMesh) -> DryMesh:
        """The DryMesh of an abstract mesh's shape and names (one per shape and names)."""
        key = (mesh.shape, mesh.mesh_dim_names)
        found = _MESHES.get(key)
        if found is None:
            found = _MESHES[key] = cls(mesh.shape, mesh.mesh_dim_names)
        return found

    # -- where the simulated rank stands ------------------------------------------------
    def _root_coordinate(self) -> tuple[int, ...]:
        rank, shape = _SIMULATED.get(), self._root[0]
        if rank >= math.prod(shape):
            raise ValueError(f"simulated rank {rank} is outside the dry mesh {shape} of {math.prod(shape)} ranks: "
                             f"simulate a rank in [0, {math.prod(shape) - 1}]")
        out = []
        for size in reversed(shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    @property
    def mesh(self) -> torch.Tensor:
        """The grid of global ranks: the root mesh's slice through the simulated rank."""
        shape = self._root[0]
        grid = torch.arange(math.prod(shape), device="cpu").reshape(shape)
        if len(self._dims) == len(shape) and self._dims == tuple(range(len(shape))):
            return grid
        c = self._root_coordinate()
        index: list[Any] = [slice(None) if i in self._dims else c[i] for i in range(len(shape))]
        kept = sorted(self._dims)
        return grid[tuple(index)].permute([kept.index(d) for d in self._dims])

    def get_coordinate(self) -> Optional[list[int]]:
        c = self._root_coordinate()
        return [c[d] for d in self._dims]

    def get_rank(self) -> int:
        return _SIMULATED.get()

    def get_local_rank(self, mesh_dim: Optional[Union[int, str]] = None) -> int:
        return self._root_coordinate()[self._dims[self._one_dim(mesh_dim)]]

    def get_group(self, mesh_dim: Optional[Union[int, str]] = None) -> Any:
        i = self._one_dim(mesh_dim)
        return DryGroup(self._root, (self._dims[i],), self.shape[i])

    def get_all_groups(self) -> list[Any]:
        return [DryGroup(self._root, (d,), s) for d, s in zip(self._dims, self.shape)]

    @property
    def has_mesh_group(self) -> bool:
        return True

    def get_mesh_group(self) -> Optional[tuple[Any, tuple[int, ...]]]:
        return DryGroup(self._root, self._dims, self.size()), tuple(range(self.size()))

    def ranks_along(self, mesh_dim: Union[int, str]) -> tuple[int, ...]:
        i = self.mesh_dim_index(mesh_dim)
        return tuple(self.mesh.movedim(i, -1).reshape(-1, self.shape[i])[self._row(i)].tolist())

    def _row(self, i: int) -> int:
        """Which row of `mesh.movedim(i, -1)` holds the simulated rank."""
        c = self.get_coordinate()
        assert c is not None
        row = 0
        for d, size in enumerate(self.shape):
            if d != i:
                row = row * size + c[d]
        return row

    def _require_member(self) -> tuple[int, ...]:
        return tuple(self.get_coordinate() or ())

    def __getitem__(self, names: Union[str, Sequence[str]]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        if self.mesh_dim_names is None:
            raise ValueError(f"mesh {self.shape} has no dim names: create it with mesh_dim_names= to slice by name")
        dims = [self.mesh_dim_index(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"sub-mesh names {names} repeat a dim")
        return self.sub(dims)

    def sub(self, dims: Sequence[int]) -> DryMesh:
        """The sub-mesh over `dims` (in that order) through the simulated rank."""
        names = None if self.mesh_dim_names is None else tuple(self.mesh_dim_names[d] for d in dims)
        return DryMesh(tuple(self.shape[d] for d in dims), names, _root=self._root, _dims=tuple(self._dims[d] for d in dims))

    def unflatten(self, mesh_dim: Union[int, str], sizes: Sequence[int], names: Sequence[str]) -> DryMesh:
        """`DeviceMesh.unflatten` on no processes: the root's shape gains the dims."""
        i = self.mesh_dim_index(mesh_dim)
        sizes, names = _checked_split(self, i, sizes, names)
        shape, root_names = self._root
        if root_names is None and len(shape) > 1:
            raise ValueError(f"cannot split a dim of {self!r}: its mesh has no dim names; give it mesh_dim_names=")
        r, old = self._dims[i], root_names or ("",)
        clash = sorted(set(names) & (set(old) - {old[r]}))
        if clash:
            raise ValueError(f"cannot split into {names}: {clash} already name dims of the mesh {root_names}; "
                             f"choose other names")
        whole = DryMesh.of(AbstractMesh(shape[:r] + sizes + shape[r + 1:], old[:r] + names + old[r + 1:]))
        grown = len(sizes) - 1
        dims: list[int] = []
        for d in self._dims:
            dims.extend(range(r, r + len(sizes)) if d == r else [d + grown if d > r else d])
        return whole.sub(dims)

    def _key(self) -> tuple[Any, ...]:
        return (self._root, self._dims, self.shape, self.mesh_dim_names)

    def __eq__(self, other: object) -> bool:
        return other is self or (type(other) is DryMesh and other._hash == self._hash and other._key() == self._key())

    __hash__ = AbstractMesh.__hash__

    def __deepcopy__(self, memo: dict[int, Any]) -> DryMesh:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        raise TypeError(f"{self!r} has no processes and holds no data: a dry run's tensors cannot be saved")

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        where = "" if self._dims == tuple(range(len(self._root[0]))) and self.shape == self._root[0] else \
            f", slice of {self._root[0]}"
        return f"DryMesh({self.shape}{names}{where})"


def dry_mesh(mesh_shape: Sequence[int], *, mesh_dim_names: Optional[Sequence[str]] = None) -> DryMesh:
    """A DeviceMesh of shape `mesh_shape` with no processes behind it: `init_device_mesh`'s
    dry twin. Shard meta parameters over it and run a step as one rank of a mesh of any size
    (`simulating(rank)`, `shardwise.debug.dry_run`); collectives return results of the right
    shape and no data. The same shape and names give the same mesh."""
    return DryMesh.of(AbstractMesh(tuple(mesh_shape), mesh_dim_names))


def as_device_mesh(mesh: Any) -> Any:
    """`mesh` as a DeviceMesh: an `AbstractMesh` becomes its DryMesh; anything else is returned
    as it is (a DeviceMesh, or a wrong value for the caller's own check to name)."""
    if type(mesh) is AbstractMesh:
        return DryMesh.of(mesh)
    return mesh


DRY_TWIN[0] = DryMesh.of
