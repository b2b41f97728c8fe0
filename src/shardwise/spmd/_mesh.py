"""Meshes of the partition-spec API: `Mesh`, `HybridMesh`, `get_1d_mesh` and the global mesh.

A `Mesh` is a value: a flat list of device ids (global ranks), the grid shape they fill in
row-major order, and optional axis names. It needs no processes, so sharding specs over it
(tile assignments, replication groups) are computed and tested on one machine. Only
`to_device_mesh()` turns it into a shardwise `DeviceMesh` with process groups, once per
mesh and device type. `HybridMesh` orders the ranks so that the inner (fast, within a
host) axes never cross a host: the analogue of ICI within a TPU slice and DCN between
slices, built the way JAX's `create_hybrid_device_mesh` tiles one block per host.

>>> mesh = Mesh([0, 1, 2, 3, 4, 5, 6, 7], (4, 2), ("x", "y"))
>>> mesh.get_logical_mesh().tolist()
[[0, 1], [2, 3], [4, 5], [6, 7]]
>>> list(mesh.shape().items())
[('x', 4), ('y', 2)]
>>> mesh.get_axis_name_idx("y"), mesh.size()
(1, 8)
>>> HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), hosts=2, local_world_size=2).get_logical_mesh().tolist()
[[0, 1], [2, 3]]
"""

from __future__ import annotations

import math
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from .._describe import describe
from .._mesh import AbstractMesh, DeviceMesh
from .._process import init_default_group

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "set_global_mesh", "get_global_mesh"]

DeviceIds = Union[npt.NDArray[Any], Sequence[int]]


class Mesh:
    """A logical grid of device ids (global ranks) with optional axis names; an immutable value.

    `device_ids` is a flat list reshaped row-major into `mesh_shape`; every id in
    `[0, len(device_ids))` appears exactly once. Equal meshes compare and hash equal, so
    sharding arguments are cached per (mesh, partition spec).

    >>> m = Mesh(range(4), (2, 2))
    >>> list(m.shape().items()), m.get_axis_name_idx("x")
    ([(0, 2), (1, 2)], None)
    >>> m == eval(repr(m))
    True
    """

    __slots__ = ("_ids", "_mesh_shape", "_axis_names", "_hash")

    _ids: tuple[int, ...]
    _mesh_shape: tuple[int, ...]
    _axis_names: Optional[tuple[str, ...]]
    _hash: int

    def __init__(
        self, device_ids: DeviceIds, mesh_shape: Sequence[int], axis_names: Optional[Sequence[str]] = None
    ) -> None:
        ids, shape, names = _check_mesh(device_ids, mesh_shape, axis_names)
        object.__setattr__(self, "_ids", ids)
        object.__setattr__(self, "_mesh_shape", shape)
        object.__setattr__(self, "_axis_names", names)
        object.__setattr__(self, "_hash", hash((ids, shape, names)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: build a new one instead of setting {name!r}")

    # -- the value -------------------------------------------------------------------
    @property
    def device_ids(self) -> npt.NDArray[np.int64]:
        """The flat device ids, in the order they fill the grid (a read-only array)."""
        out = np.array(self._ids, dtype=np.int64)
        out.flags.writeable = False
        return out

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self._mesh_shape

    @property
    def axis_names(self) -> Optional[tuple[str, ...]]:
        return self._axis_names

    def size(self) -> int:
        """The number of devices."""
        return len(self._ids)

    def shape(self) -> OrderedDict[Union[str, int], int]:
        """Axis name (or index when the axes have no names) -> axis size, in axis order."""
        keys: Sequence[Union[str, int]] = self._axis_names or range(len(self._mesh_shape))
        return OrderedDict(zip(keys, self._mesh_shape))

    def get_logical_mesh(self) -> npt.NDArray[np.int64]:
        """The device ids as an array of shape `mesh_shape` (a fresh copy)."""
        return np.array(self._ids, dtype=np.int64).reshape(self._mesh_shape)

    def get_axis_name_idx(self, name: str) -> Optional[int]:
        """The index of the axis called `name`, or None if no axis has that name."""
        if not self._axis_names or name not in self._axis_names:
            return None
        return self._axis_names.index(name)

    def abstract(self) -> AbstractMesh:
        """Shape and names only: what the planning layers take."""
        return AbstractMesh(self._mesh_shape, self._axis_names)

    # -- processes -------------------------------------------------------------------
    def to_device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The shardwise `DeviceMesh` over the running processes: device id = global rank.

        Collective on first use (every rank must call it, with equal meshes); later calls
        return the same `DeviceMesh`, so process groups are created once. Initializes the
        default process group from torchrun's environment if needed. The mesh must span
        every process.
        """
        if not dist.is_initialized():
            init_default_group(device_type, self.size())
        world = dist.get_world_size()
        if world != self.size():
            raise ValueError(
                f"{self!r} has {self.size()} devices but the world has {world} processes: a Mesh spans every "
                f"process (device id = global rank), so give it {world} device ids"
            )
        key = (self, device_type, id(dist.group.WORLD))
        found = _DEVICE_MESHES.get(key)
        if found is None:
            grid = torch.tensor(self.get_logical_mesh().tolist(), dtype=torch.int64)
            found = DeviceMesh(device_type, grid, mesh_dim_names=self._axis_names)
            _DEVICE_MESHES[key] = found
        return found

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> Mesh:
        """The `Mesh` of a shardwise `DeviceMesh` spanning every process (its grid of ranks and dim names)."""
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"from_device_mesh takes a shardwise DeviceMesh, got {describe(device_mesh)}")
        ranks = device_mesh.mesh.flatten().tolist()
        world = dist.get_world_size()
        if len(ranks) != world:
            raise ValueError(
                f"{device_mesh!r} holds ranks {ranks}, {len(ranks)} of the world's {world} processes: a Mesh spans "
                f"every process, so convert the full mesh (not a sub-mesh)"
            )
        mesh = Mesh(ranks, device_mesh.shape, device_mesh.mesh_dim_names)
        _DEVICE_MESHES.setdefault((mesh, device_mesh.device_type, id(dist.group.WORLD)), device_mesh)
        return mesh

    # -- value semantics -------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (self._ids, self._mesh_shape, self._axis_names) == (other._ids, other._mesh_shape, other._axis_names)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", {self._axis_names!r}" if self._axis_names is not None else ""
        return f"Mesh({list(self._ids)!r}, {self._mesh_shape!r}{names})"


# (mesh, device type, identity of the default group) -> its DeviceMesh.
_DEVICE_MESHES: dict[tuple[Mesh, str, int], DeviceMesh] = {}


def _check_mesh(
    device_ids: DeviceIds, mesh_shape: Sequence[int], axis_names: Optional[Sequence[str]]
) -> tuple[tuple[int, ...], tuple[int, ...], Optional[tuple[str, ...]]]:
    """Every Mesh rule, checked at once; one ValueError (TypeError for wrong kinds) listing them all."""
    try:
        arr = np.asarray(list(device_ids) if isinstance(device_ids, Iterable) else device_ids)
    except (ValueError, TypeError):  # ragged or nested: not a flat list
        arr = np.asarray([None])
    if isinstance(device_ids, (str, bytes)) or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(
            f"device_ids must be a flat list of int device ids, got {device_ids!r}: pass e.g. "
            f"np.arange(n) or a reshaped array's .flatten()"
        )
    if isinstance(mesh_shape, (int, str, bytes)) or not isinstance(mesh_shape, Iterable) or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in mesh_shape
    ):
        raise TypeError(f"mesh_shape must be a tuple of ints, got {mesh_shape!r}: write e.g. (4, 2)")
    if axis_names is not None and (
        isinstance(axis_names, str) or not isinstance(axis_names, Sequence) or not all(isinstance(n, str) for n in axis_names)
    ):
        raise TypeError(f"axis_names must be a tuple of str (one per mesh axis), got {axis_names!r}: write e.g. ('x',)")
    ids = tuple(int(i) for i in arr.tolist())
    shape = tuple(int(s) for s in mesh_shape)
    names = None if axis_names is None else tuple(axis_names)
    problems: list[str] = []
    if not shape or any(s < 1 for s in shape):
        problems.append(f"mesh_shape {shape} must have at least one axis, every size >= 1")
    if names is not None and len(names) != len(shape):
        problems.append(
            f"axis_names {names} has {len(names)} names for the {len(shape)}-D mesh_shape {shape}: give one per axis"
        )
    if names is not None and len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        problems.append(f"axis_names {names} repeats {dups}: every axis needs its own name")
    if math.prod(shape) != len(ids):
        problems.append(
            f"mesh_shape {shape} holds {math.prod(shape)} devices but device_ids {list(ids)} has {len(ids)}: the "
            f"product of mesh_shape must equal the number of device ids"
        )
    dup_ids = sorted(i for i, n in Counter(ids).items() if n > 1)
    if dup_ids:
        problems.append(f"device_ids {list(ids)} repeats {dup_ids}: every device appears once")
    bad = sorted({i for i in ids if not 0 <= i < len(ids)})
    if bad:
        problems.append(
            f"device_ids {list(ids)} has ids {bad} outside [0, {len(ids)}): a mesh of {len(ids)} devices uses the "
            f"ids 0..{len(ids) - 1} in some order"
        )
    if problems:
        raise ValueError("invalid Mesh:\n" + "\n".join(f"  - {p}" for p in problems))
    return ids, shape, names


def _launched_world_size() -> Optional[int]:
    """The number of processes, if known (the default group, or the launcher's WORLD_SIZE)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else None


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


class HybridMesh(Mesh):
    """A mesh whose inner (ICI) axes stay within one host and outer (DCN) axes span hosts.

    `mesh_shape` is the elementwise product `ici_mesh_shape * dcn_mesh_shape`. Host `h`
    owns the global ranks `[h * L, (h + 1) * L)` (`L` ranks per host, as torchrun assigns
    them); each host's ranks fill an `ici_mesh_shape` block in row-major order, and the
    blocks are tiled along `dcn_mesh_shape` in host order. So an axis whose dcn size is 1
    never crosses a host. Order axes by increasing traffic (e.g. `(data, fsdp, tensor)`).

    The host layout comes from `hosts=` / `local_world_size=`, else the launcher's
    environment (`LOCAL_WORLD_SIZE`, with `WORLD_SIZE` or the default group for the
    number of processes; `RANK`, `LOCAL_RANK` and `GROUP_RANK`/`NODE_RANK`, when set, must
    agree with that rank order); a running group with no host information is one host.
    With no processes and nothing given, the shapes define it (`prod(ici)` ranks per host).

    >>> m = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("dp", "tp"),
    ...                hosts=2, local_world_size=2)
    >>> m.get_logical_mesh().tolist(), dict(m.shape())
    ([[0, 1], [2, 3]], {'dp': 2, 'tp': 2})
    """

    __slots__ = ("_ici", "_dcn", "_hosts", "_local")

    _ici: tuple[int, ...]
    _dcn: tuple[int, ...]
    _hosts: int
    _local: int

    def __init__(
        self,
        *,
        ici_mesh_shape: Sequence[int],
        dcn_mesh_shape: Optional[Sequence[int]] = None,
        axis_names: Optional[Sequence[str]] = None,
        hosts: Optional[int] = None,
        local_world_size: Optional[int] = None,
    ) -> None:
        ici = _shape_arg("ici_mesh_shape", ici_mesh_shape)
        dcn = (1,) * len(ici) if dcn_mesh_shape is None else _shape_arg("dcn_mesh_shape", dcn_mesh_shape)
        if len(ici) != len(dcn):
            raise ValueError(
                f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} have different ranks: give both one size per axis "
                f"(1 where an axis does not span that network)"
            )
        n_hosts, local = _host_layout(ici, dcn, hosts, local_world_size)
        problems = []
        if math.prod(ici) != local:
            problems.append(
                f"ici_mesh_shape {ici} holds {math.prod(ici)} ranks but each host runs {local}: the product of "
                f"ici_mesh_shape must equal the ranks per host"
            )
        if math.prod(dcn) != n_hosts:
            hint = " (give dcn_mesh_shape for a multi-host mesh)" if dcn_mesh_shape is None else ""
            problems.append(
                f"dcn_mesh_shape {dcn} spans {math.prod(dcn)} host(s) but there are {n_hosts}: the product of "
                f"dcn_mesh_shape must equal the number of hosts{hint}"
            )
        if problems:
            raise ValueError("invalid HybridMesh:\n" + "\n".join(f"  - {p}" for p in problems))
        grid = _hybrid_grid(ici, dcn)
        super().__init__(grid.flatten().tolist(), grid.shape, axis_names)
        object.__setattr__(self, "_ici", ici)
        object.__setattr__(self, "_dcn", dcn)
        object.__setattr__(self, "_hosts", n_hosts)
        object.__setattr__(self, "_local", local)

    @property
    def ici_mesh_shape(self) -> tuple[int, ...]:
        return self._ici

    @property
    def dcn_mesh_shape(self) -> tuple[int, ...]:
        return self._dcn

    @property
    def hosts(self) -> int:
        return self._hosts

    @property
    def local_world_size(self) -> int:
        return self._local

    def __repr__(self) -> str:
        names = f", axis_names={self.axis_names!r}" if self.axis_names is not None else ""
        return (
            f"HybridMesh(ici_mesh_shape={self.ici_mesh_shape!r}, dcn_mesh_shape={self.dcn_mesh_shape!r}{names}, "
            f"hosts={self.hosts}, local_world_size={self.local_world_size})"
        )


def _shape_arg(what: str, shape: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(shape, (Sequence, np.ndarray)) or isinstance(shape, (str, bytes)) or not len(shape) or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1 for s in shape
    ):
        raise ValueError(f"{what} must be a non-empty tuple of positive ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def _host_layout(
    ici: tuple[int, ...], dcn: tuple[int, ...], hosts: Optional[int], local: Optional[int]
) -> tuple[int, int]:
    """(number of hosts, ranks per host) from the arguments, the launcher's environment or the shapes."""
    for what, value in (("hosts", hosts), ("local_world_size", local)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    if hosts is not None and local is not None:
        return hosts, local  # given: a pure value (to_device_mesh checks it against the world)
    world = _launched_world_size()
    if local is None and hosts is None:
        local = _env_int("LOCAL_WORLD_SIZE")
        if local is None:
            # A running group that says nothing about hosts is one host; with no processes
            # either, the shapes define the layout.
            return (math.prod(dcn), math.prod(ici)) if world is None else (1, world)
    if local is None:
        local = math.prod(ici) if world is None or hosts is None else max(world // hosts, 1)
    if hosts is None:
        hosts = math.prod(dcn) if world is None else max(world // local, 1)
    if world is not None and hosts * local != world:
        raise ValueError(
            f"{hosts} host(s) x {local} ranks per host is {hosts * local} ranks but the world has {world} processes: "
            f"every host must run the same number of ranks (hosts= and local_world_size= must multiply to the world size)"
        )
    _check_rank_order(local)
    return hosts, local


def _check_rank_order(local: int) -> None:
    """The layout assumes host h runs ranks [h * local, (h + 1) * local); the launcher's env must agree."""
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    node = _env_int("GROUP_RANK") if os.environ.get("GROUP_RANK") else _env_int("NODE_RANK")
    if rank is not None and local_rank is not None and node is not None and rank != node * local + local_rank:
        raise ValueError(
            f"this process is RANK={rank}, LOCAL_RANK={local_rank} on host {node} with {local} ranks per host, but "
            f"HybridMesh assumes host h runs ranks [h * {local}, (h + 1) * {local}): launch with torchrun (same "
            f"--nproc-per-node on every host) or pass hosts= and local_world_size= explicitly"
        )


def _hybrid_grid(ici: tuple[int, ...], dcn: tuple[int, ...]) -> npt.NDArray[np.int64]:
    """Ranks in mesh shape ici * dcn: one ici-shaped block of host h's ranks per dcn position h."""
    shape = tuple(i * d for i, d in zip(ici, dcn))
    coords = np.indices(shape).reshape(len(shape), -1)  # (ndim, n): every mesh position
    ici_arr = np.array(ici).reshape(-1, 1)
    host = np.ravel_multi_index(tuple(coords // ici_arr), dcn)  # which block, row-major over dcn
    local = np.ravel_multi_index(tuple(coords % ici_arr), ici)  # where in the block, row-major over ici
    grid: npt.NDArray[np.int64] = (host * math.prod(ici) + local).astype(np.int64).reshape(shape)
    return grid


def get_1d_mesh(axis_name: Optional[str] = None) -> Mesh:
    """A 1-D mesh over every process, in rank order (one process when none was launched)."""
    n = _launched_world_size() or 1
    return Mesh(list(range(n)), (n,), None if axis_name is None else (axis_name,))


_GLOBAL_MESH: Optional[Mesh] = None


def set_global_mesh(mesh: Optional[Mesh]) -> None:
    """Make `mesh` the process's default mesh (used where an API takes `mesh=None`); None unsets it."""
    global _GLOBAL_MESH
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"set_global_mesh takes a shardwise.spmd.Mesh, got {describe(mesh)}: convert a DeviceMesh with "
            f"Mesh.from_device_mesh(device_mesh)"
        )
    _GLOBAL_MESH = mesh


def get_global_mesh() -> Optional[Mesh]:
    """The mesh set by `set_global_mesh`, or None."""
    return _GLOBAL_MESH
