"""Partition specs <-> placements: the two ways of writing one layout, converted without loss.

A *partition spec* names, per tensor dim, the mesh dims that split it: `None` (not split),
one mesh dim (its index or its name), or a tuple of mesh dims (split by the first, each
piece split again by the next: major to minor). *Placements* name, per mesh dim, what it
does to the tensor, plus a split order where several mesh dims split one tensor dim. So
`(("dp", "tp"), None)` is `(Shard(0), Shard(0))` in the default order (dp outer) and
`(("tp", "dp"), None)` the same placements with `shard_order={0: (1, 0)}`; a mesh dim no
entry names is `Replicate()` (partial replication). `Partial` has no partition spec.

>>> from shardwise import Shard, Replicate
>>> to_placements((("y", "x"), None), (4, 2), ("x", "y"), 2)
((Shard(dim=0), Shard(dim=0)), ((0, (1, 0)),))
>>> from_placements((Shard(0), Shard(0)), ((0, (1, 0)),), ("x", "y"), 2)
(('y', 'x'), None)
>>> from_placements((Replicate(), Shard(1)), (), None, 2)
(None, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

from ._layout import ShardOrder, normalize_shard_order, split_orders
from ._placement import Partial, Placement, Replicate, Shard

__all__ = ["MeshAxis", "PartitionEntry", "PartitionSpecLike", "normalize_partition_spec", "to_placements",
           "from_placements"]

MeshAxis = Union[int, str]
PartitionEntry = Union[None, MeshAxis, tuple[MeshAxis, ...]]
PartitionSpecLike = Sequence[PartitionEntry]


def normalize_partition_spec(
    spec: PartitionSpecLike,
    mesh_shape: Sequence[int],
    mesh_names: Optional[Sequence[str]],
    tensor_ndim: int,
    *,
    exact_length: bool = True,
) -> tuple[tuple[int, ...], ...]:
    """Per tensor dim, the mesh dims (indices, major to minor) that split it; `()` = not split.

    Every rule checked in one place: the spec is a sequence; its length equals the tensor's
    rank (or, with `exact_length=False`, is at most it: missing trailing entries are None);
    each entry is None, a mesh dim index or name, or a flat tuple of them; each mesh dim
    appears at most once.
    """
    if isinstance(spec, (str, int)) or spec is None or not isinstance(spec, Sequence):
        raise TypeError(
            f"a partition spec is a tuple with one entry per tensor dim (None, a mesh dim index or name, or a "
            f"tuple of them), got {spec!r}"
        )
    spec = tuple(spec)
    if len(spec) != tensor_ndim and (exact_length or len(spec) > tensor_ndim):
        rule = "exactly one" if exact_length else "at most one"
        raise ValueError(
            f"partition spec {spec} has {len(spec)} entries for a {tensor_ndim}-D tensor: give {rule} entry per "
            f"tensor dim (None where a dim is not split)"
        )
    names = tuple(mesh_names) if mesh_names else ()
    out: list[tuple[int, ...]] = []
    used: dict[int, int] = {}
    for d, entry in enumerate(spec + (None,) * (tensor_ndim - len(spec))):
        if entry is None:
            out.append(())
            continue
        group = entry if isinstance(entry, tuple) else (entry,)
        dims: list[int] = []
        for axis in group:
            m = _axis_index(axis, spec, mesh_shape, names)
            if m in used:
                raise ValueError(
                    f"partition spec {spec} uses mesh dim {_label(m, names)} for tensor dims {used[m]} and {d}: "
                    f"a mesh dim splits at most one tensor dim"
                )
            used[m] = d
            dims.append(m)
        out.append(tuple(dims))
    return tuple(out)


def _axis_index(axis: object, spec: tuple[object, ...], mesh_shape: Sequence[int], names: tuple[str, ...]) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, str)):
        kind = "a nested tuple" if isinstance(axis, tuple) else f"{axis!r} ({type(axis).__name__})"
        raise TypeError(
            f"partition spec {spec} has {kind} inside an entry: an entry is None, a mesh dim index or name, or a "
            f"flat tuple of those"
        )
    if isinstance(axis, str):
        if axis not in names:
            have = f"the mesh's dims are {names}" if names else "the mesh has no dim names (create it with mesh_dim_names=)"
            raise ValueError(f"partition spec {spec} names mesh dim {axis!r}, which does not exist: {have}")
        return names.index(axis)
    if not 0 <= axis < len(mesh_shape):
        raise ValueError(
            f"partition spec {spec} names mesh dim {axis}, out of range for a {len(mesh_shape)}-D mesh: "
            f"use an index in [0, {len(mesh_shape) - 1}] or a dim name"
        )
    return axis


def _label(m: int, names: tuple[str, ...]) -> str:
    return repr(names[m]) if names else str(m)


def to_placements(
    spec: PartitionSpecLike,
    mesh_shape: Sequence[int],
    mesh_names: Optional[Sequence[str]],
    tensor_ndim: int,
    *,
    exact_length: bool = True,
) -> tuple[tuple[Placement, ...], ShardOrder]:
    """Placements (one per mesh dim) and canonical split order of a partition spec."""
    dims = normalize_partition_spec(spec, mesh_shape, mesh_names, tensor_ndim, exact_length=exact_length)
    placements: list[Placement] = [Replicate()] * len(mesh_shape)
    order: dict[int, tuple[int, ...]] = {}
    for d, ms in enumerate(dims):
        for m in ms:
            placements[m] = Shard(d)
        if ms:
            order[d] = ms
    pl = tuple(placements)
    return pl, normalize_shard_order(pl, order, tensor_ndim)


def from_placements(
    placements: Sequence[Placement],
    shard_order: ShardOrder,
    mesh_names: Optional[Sequence[str]],
    tensor_ndim: int,
) -> tuple[PartitionEntry, ...]:
    """The partition spec of a layout: mesh dims by name when the mesh has names, else by index."""
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"placements {tuple(str(q) for q in placements)} hold a pending reduction {p} on mesh dim {m}, which "
                f"a partition spec cannot express: redistribute it to Replicate() or Shard(d) first"
            )
    names = tuple(mesh_names) if mesh_names else ()
    orders = split_orders(placements, shard_order)
    entries: list[PartitionEntry] = []
    for d in range(tensor_ndim):
        ms = orders.get(d, ())
        axes: tuple[MeshAxis, ...] = tuple(names[m] for m in ms) if names else tuple(ms)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(entries)
