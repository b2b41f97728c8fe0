"""`ShardingSpec`: a partition spec on a `Mesh`, with its tile assignment, replication groups and type.

These are the GSPMD description of a layout, computed as torch_xla's SPMD module computes
them, so code written against those names reads the same values here: the *tile
assignment* is the logical mesh transposed so that its leading axes follow the split
tensor dims in order (mesh axes of a tuple entry merged, major to minor) and its trailing
axes are the unused mesh axes; the *replication groups* are the devices that hold the
same shard; the *group assignment* places the groups on the tensor's tile grid. All of it
is pure and cached per (mesh, partition spec). The same spec is also a shardwise layout
(`placements`, `shard_order`), and `shard_indices` gives each device's piece of a tensor
from the tile assignment, with `torch.chunk` sizes like every shardwise layout.

>>> from shardwise.spmd import Mesh
>>> spec = ShardingSpec(Mesh(range(8), (4, 2), ("x", "y")), ("x", None))
>>> spec.sharding_type, spec.replication_groups, spec.group_assignment
(<ShardingType.PARTIAL: 5>, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0], [1], [2], [3]])
>>> spec.placements, spec.shard_indices((8, 3))[5]
((Shard(dim=0), Replicate()), (slice(4, 6, None), slice(0, 3, None)))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from .._describe import as_shape, describe
from .._layout import ShardOrder, chunk_range
from .._partition_spec import PartitionEntry, normalize_partition_spec, to_placements
from .._placement import Placement
from ._mesh import Mesh

if TYPE_CHECKING:
    from .._tensor import DTensor

__all__ = ["ShardingType", "ShardingSpec"]

# Per tensor dim, the mesh axes (indices, major to minor) that split it; () = not split.
NormalSpec = tuple[tuple[int, ...], ...]


class ShardingType(IntEnum):
    """The kind of a sharding, numbered as XLA's `OpSharding.Type`.

    - REPLICATED: every device holds the whole tensor.
    - MAXIMAL: one device holds it (a 1-device mesh).
    - TUPLE: a sharding per element of a tuple (not produced here).
    - TILED: the tensor is split over every device, no copies.
    - MANUAL: the program handles the pieces itself (manual sharding).
    - PARTIAL: *partial replication* -- split across groups of devices, replicated within
      each group (mesh axes no entry names). Not DTensor's `Partial`, a pending reduction.
    - UNKNOWN: left to the compiler (implicit replication; not produced here).
    """

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


class ShardingArgs(NamedTuple):
    """What a (mesh, partition spec) pair computes once: arrays are read-only."""

    tile_assignment: npt.NDArray[np.int64]
    group_assignment: npt.NDArray[np.int64]  # empty unless PARTIAL
    replication_groups: npt.NDArray[np.int64]  # (groups, devices per group); empty unless PARTIAL
    sharding_type: ShardingType


def _tile_assignment(mesh: Mesh, dims: NormalSpec) -> npt.NDArray[np.int64]:
    """The logical mesh with the split tensor dims' mesh axes first (in spec order), then the unused axes."""
    tiled = [ms for ms in dims if ms]
    used = [m for ms in tiled for m in ms]
    unused = [m for m in range(len(mesh.mesh_shape)) if m not in used]
    sizes = [math.prod(mesh.mesh_shape[m] for m in ms) for ms in tiled] + [mesh.mesh_shape[m] for m in unused]
    # Transposing puts each tuple entry's axes next to each other, major first; the
    # row-major reshape then merges them into one axis per split tensor dim.
    tile: npt.NDArray[np.int64] = mesh.get_logical_mesh().transpose(used + unused).reshape(sizes)
    return tile


def _sharding_type(mesh: Mesh, dims: NormalSpec, tile_ndim: int) -> ShardingType:
    if not dims:
        return ShardingType.REPLICATED  # a 0-D tensor can only be replicated
    if tile_ndim > len(dims):
        return ShardingType.PARTIAL  # some mesh axes are unused: replicated over them
    if mesh.size() == 1:
        return ShardingType.MAXIMAL
    if not any(dims):
        return ShardingType.REPLICATED
    if not all(dims):
        return ShardingType.PARTIAL
    return ShardingType.TILED


@functools.lru_cache(maxsize=1024)
def sharding_args(mesh: Mesh, dims: NormalSpec) -> ShardingArgs:
    """Tile assignment, group assignment, replication groups and type of a normalized spec (cached)."""
    tile = _tile_assignment(mesh, dims)
    kind = _sharding_type(mesh, dims, tile.ndim)
    groups = np.zeros((0, 0), dtype=np.int64)
    assignment = np.zeros((0,), dtype=np.int64)
    if kind is ShardingType.PARTIAL:
        n_tiled = sum(1 for ms in dims if ms)
        # One row per shard (row-major over the tile grid): the devices that hold it.
        groups = tile.reshape(math.prod(tile.shape[:n_tiled]), -1)
        tiles = iter(tile.shape[:n_tiled])
        assignment = np.arange(len(groups), dtype=np.int64).reshape([next(tiles) if ms else 1 for ms in dims])
    for arr in (tile, groups, assignment):
        arr.flags.writeable = False
    return ShardingArgs(tile, assignment, groups, kind)


@dataclass(frozen=True)
class ShardingSpec:
    """A partition spec on a `Mesh`: one entry per tensor dim (None, an axis index or name, or a tuple of them).

    `minibatch=True` marks a per-host batch (as torch_xla's data loaders use it); it does
    not change the sharding. `tile_assignment`, `group_assignment`, `replication_groups`
    and `sharding_type` follow torch_xla's definitions exactly, including their edge cases:
    a 0-D spec `()` is REPLICATED; a spec that leaves a mesh axis unused is PARTIAL even
    when it has no None entry (`(0,)` on a 2-D mesh), and so is one with a None entry even
    if it uses every axis (`(("x", "y"), None)`, groups of one device).

    >>> from shardwise.spmd import Mesh
    >>> ShardingSpec(Mesh(range(8), (4, 2), ("x", "y")), ("y", "x")).tile_assignment
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    """

    mesh: Mesh
    partition_spec: tuple[PartitionEntry, ...]
    minibatch: bool = False
    _dims: NormalSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(
                f"ShardingSpec(mesh=...) takes a shardwise.spmd.Mesh, got {describe(self.mesh)}: convert a "
                f"DeviceMesh with Mesh.from_device_mesh(device_mesh)"
            )
        if not isinstance(self.minibatch, bool):
            raise TypeError(f"ShardingSpec(minibatch=...) must be a bool, got {self.minibatch!r}")
        spec: Any = self.partition_spec
        if not isinstance(spec, (list, tuple)):
            raise TypeError(
                f"ShardingSpec(partition_spec=...) takes one entry per tensor dim (a tuple such as (0, None)), got "
                f"{spec!r} ({type(spec).__name__})"
            )
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
        dims = normalize_partition_spec(spec, self.mesh.mesh_shape, self.mesh.axis_names, len(spec))
        object.__setattr__(self, "partition_spec", spec)
        object.__setattr__(self, "_dims", dims)

    # -- torch_xla's derived values ----------------------------------------------------
    @property
    def _args(self) -> ShardingArgs:
        return sharding_args(self.mesh, self._dims)

    @property
    def tile_assignment(self) -> list[Any]:
        """Device ids on the tile grid: one axis per split tensor dim, then one per unused mesh axis."""
        return self._args.tile_assignment.tolist()  # type: ignore[no-any-return]

    @property
    def group_assignment(self) -> list[Any]:
        """PARTIAL only (else `[]`): per tensor dim (1 where not split), the replication group holding each tile."""
        return self._args.group_assignment.tolist()  # type: ignore[no-any-return]

    @property
    def replication_groups(self) -> list[list[int]]:
        """PARTIAL only (else `[]`): for each group id, the devices that hold that same shard."""
        return self._args.replication_groups.tolist()  # type: ignore[no-any-return]

    @property
    def sharding_type(self) -> ShardingType:
        return self._args.sharding_type

    # -- the same layout, shardwise's way ----------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis: `Shard(d)` where an entry names it, else `Replicate()`."""
        return self._layout()[0]

    @property
    def shard_order(self) -> ShardOrder:
        """Split order for tensor dims split by several mesh axes not in axis order (`()` when none)."""
        return self._layout()[1]

    def _layout(self) -> tuple[tuple[Placement, ...], ShardOrder]:
        return to_placements(self.partition_spec, self.mesh.mesh_shape, self.mesh.axis_names, len(self._dims))

    def shard_indices(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """Device id -> the slices (one per tensor dim) of the piece it holds of a tensor of `global_shape`.

        Read off the tile assignment: a device's position along a split tensor dim's tile
        axis picks its piece. A tuple entry splits the dim by its axes one after another
        (major first), each split like `torch.chunk`, so uneven sizes match every other
        shardwise layout (trailing pieces may be smaller or empty). XLA instead pads every
        piece to one size; the two agree whenever the sizes divide.
        """
        shape = as_shape(global_shape, "shard_indices' global shape")
        if len(shape) != len(self._dims):
            raise ValueError(
                f"global shape {shape} has {len(shape)} dims but partition spec {self.partition_spec} has "
                f"{len(self._dims)} entries: give the shape of a tensor this spec applies to"
            )
        tile = self._args.tile_assignment
        out: dict[int, tuple[slice, ...]] = {}
        for pos in np.ndindex(*tile.shape):
            slices: list[slice] = []
            tiles = iter(pos)
            for d, ms in enumerate(self._dims):
                start, size = 0, shape[d]
                if ms:
                    index = next(tiles)
                    for m, n in zip(ms, np.unravel_index(index, [self.mesh.mesh_shape[m] for m in ms])):
                        offset, size = chunk_range(size, self.mesh.mesh_shape[m], int(n))
                        start += offset
                slices.append(slice(start, start + size))
            out[int(tile[pos])] = tuple(slices)
        return dict(sorted(out.items()))

    # -- tensors ---------------------------------------------------------------------
    def can_apply(self, t: torch.Tensor) -> bool:
        """Whether the spec fits `t`: one entry per tensor dim."""
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> DTensor:
        """`mark_sharding(t, self.mesh, self.partition_spec)`: shard `t` by this spec."""
        from ._mark import mark_sharding

        return mark_sharding(t, self.mesh, self.partition_spec)
