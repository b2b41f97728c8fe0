"""Flattened mesh dims: several dims of a mesh seen as one, as torch's private `DeviceMesh._flatten` gives.

torchtitan shards parameters over the product of its data-parallel and context-parallel dims
(`mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`) and reads the flattened dim back by name
from the whole mesh (`mesh["dp_shard_cp"]`, `mesh["dp_replicate", "dp_shard_cp"]`). Here a
flattened dim is recorded on the mesh the sub-mesh was sliced from (its root): the dims it
merges, in order, contiguous or not. Its process groups, one per slice of the root, are made
when `_flatten` is called, by every process in the same order (group creation is
collective), and found again by every later lookup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ._groups import group_for

__all__ = ["flatten", "resolve_names"]


def flatten(mesh: Any, name: Optional[str]) -> Any:
    """`mesh` (a DeviceMesh or a sub-mesh of one) as a 1-D mesh named `name` over its ranks in
    row-major order; the name is then a dim of its root mesh too."""
    root, dims = mesh._sliced_from or (mesh, tuple(range(mesh.ndim)))
    if name is None:
        if mesh.mesh_dim_names is None:
            raise ValueError("_flatten of a mesh without dim names needs mesh_dim_name=: e.g. _flatten('dp')")
        name = "_".join(mesh.mesh_dim_names)
    if not isinstance(name, str) or not name:
        raise TypeError(f"mesh_dim_name must be a non-empty str, got {name!r}")
    known = root._flattened.get(name)
    if (root.mesh_dim_names and name in root.mesh_dim_names) or (known is not None and known != dims):
        raise ValueError(f"cannot flatten {mesh.mesh_dim_names} into {name!r}: the mesh already has a dim of that name "
                         f"({'a mesh dim' if known is None else 'flattened from dims ' + str(known)}); choose another name")
    backend = "nccl" if mesh.device_type == "cuda" else None
    for row in _rows(root._grid, dims):  # every process makes every slice's group, in one order
        group_for(tuple(row), backend)
    root._flattened[name] = dims
    return resolve_names(root, (name,))


def _rows(grid: torch.Tensor, dims: Sequence[int]) -> list[list[int]]:
    """Every slice of `grid` along `dims` (merged, in that order), as a list of ranks."""
    others = [d for d in range(grid.ndim) if d not in dims]
    size = math.prod(grid.shape[d] for d in dims)
    rows: list[list[int]] = grid.permute(*others, *dims).reshape(-1, size).tolist()
    return rows


def resolve_names(mesh: Any, names: tuple[str, ...]) -> Any:
    """The sub-mesh of `mesh` over `names`, some of them flattened dims: each flattened name is
    one dim of the sub-mesh, over its dims' ranks row-major, with the group made by `_flatten`."""
    expanded: list[tuple[str, tuple[int, ...]]] = []
    for n in names:
        if mesh.mesh_dim_names is not None and n in mesh.mesh_dim_names:
            expanded.append((n, (mesh.mesh_dim_names.index(n),)))
        elif n in mesh._flattened:
            expanded.append((n, mesh._flattened[n]))
        else:
            flat = f" and flattened dims {sorted(mesh._flattened)}" if mesh._flattened else ""
            raise ValueError(f"mesh dim {n!r} is not a dim of this mesh (dim names: {mesh.mesh_dim_names}{flat})")
    used = [d for _, dims in expanded for d in dims]
    if len(set(used)) != len(used):
        raise ValueError(f"sub-mesh names {names} cover a mesh dim twice: {dict(expanded)}")
    coordinate = mesh._require_member()
    index: list[Any] = [slice(None) if d in used else c for d, c in enumerate(coordinate)]
    kept = sorted(used)
    sub = mesh._grid[tuple(index)].permute([kept.index(d) for d in used])
    sub = sub.reshape([math.prod(mesh.shape[d] for d in dims) for _, dims in expanded])
    backend = "nccl" if mesh.device_type == "cuda" else None
    groups = []
    for i, (_, dims) in enumerate(expanded):
        if len(dims) == 1:
            groups.append(mesh._groups[dims[0]])
        else:
            mine = [c if d not in dims else slice(None) for d, c in enumerate(coordinate)]
            ranks = mesh._grid[tuple(mine)].permute([sorted(dims).index(d) for d in dims]).reshape(-1)
            groups.append(group_for(tuple(ranks.tolist()), backend))  # made by `_flatten`: a lookup
    made = type(mesh)(mesh.device_type, sub, mesh_dim_names=tuple(n for n, _ in expanded), _groups=tuple(groups))
    made._sliced_from = (mesh, tuple(used))
    return made
