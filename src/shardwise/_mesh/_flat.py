"""Flattened and split mesh dims: several dims of a mesh seen as one (`_flatten`), or one dim
seen as several (`unflatten`), as torch's private `DeviceMesh._flatten` / `_unflatten` give.

torchtitan shards parameters over the product of its data-parallel and context-parallel dims
(`mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`) and reads the flattened dim back by name
from the whole mesh (`mesh["dp_shard_cp"]`, `mesh["dp_replicate", "dp_shard_cp"]`). Here a
flattened dim is recorded on the mesh the sub-mesh was sliced from (its root): the dims it
merges, in order, contiguous or not. Its process groups, one per slice of the root, are made
when `_flatten` is called, by every process in the same order (group creation is
collective), and found again by every later lookup.

Splitting goes the other way: `mesh.unflatten("dp_shard", (2, 2), ("dp_shard_mod_ep", "ep"))`
is the same ranks as a mesh with one more dim, the new dims' groups made over every copy of
the mesh in the world (so every process makes the same groups in the same order), the other
dims' groups shared. Expert parallelism borrows data-parallel ranks this way. A sub-mesh is
split through its root: the root gains the dims, the result is sliced from it, and a later
`_flatten` of the result's dims reaches every copy, as on any sub-mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ._groups import group_for

__all__ = ["flatten", "resolve_names", "unflatten"]


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


def unflatten(mesh: Any, dim: Any, sizes: Sequence[int], names: Sequence[str]) -> Any:
    """`mesh` with dim `dim` split into dims of `sizes` named `names` (row-major over its
    ranks); collective when the new dims need process groups (call it on every process)."""
    i = mesh.mesh_dim_index(dim)
    sizes, names = _checked_split(mesh, i, sizes, names)
    root, root_dims = mesh._sliced_from or (mesh, tuple(range(mesh.ndim)))
    if len(root_dims) != mesh.ndim:
        raise ValueError(f"cannot split dim {mesh.mesh_dim_names[i] if mesh.mesh_dim_names else i!r} of {mesh!r}: it "
                         f"is a flattened dim; split a dim of the mesh it was flattened from instead")
    if root.mesh_dim_names is None and root.ndim > 1:
        raise ValueError(f"cannot split a dim of {root!r}: it has no dim names; create it with mesh_dim_names=")
    r = root_dims[i]
    others = set(root.mesh_dim_names or ()) - {(root.mesh_dim_names or ("",))[r]}
    clash = sorted(set(names) & (others | set(root._flattened)))
    if clash:
        raise ValueError(f"cannot split into {tuple(names)}: {clash} already name dims of the mesh "
                         f"{root.mesh_dim_names}; choose other names")
    whole = _split_root(root, r, sizes, names)
    if root is mesh:
        return whole
    kept = [whole.mesh_dim_names[d + (len(sizes) - 1 if d > r else 0)] for d in root_dims]
    at = root_dims.index(r)
    picked = kept[:at] + list(names) + kept[at + 1:]
    return whole[tuple(picked)]


def _checked_split(mesh: Any, i: int, sizes: Sequence[int], names: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    sizes, names = tuple(sizes), tuple(names)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise TypeError(f"split sizes must be ints >= 1, got {sizes}")
    if any(not isinstance(n, str) or not n for n in names):
        raise TypeError(f"split dim names must be non-empty strs, got {names}")
    if len(sizes) != len(names) or not sizes:
        raise ValueError(f"unflatten needs one name per size: got sizes {sizes} and names {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"split dim names {names} repeat a name")
    if math.prod(sizes) != mesh.shape[i]:
        raise ValueError(f"cannot split mesh dim {i} of size {mesh.shape[i]} into sizes {sizes} (product "
                         f"{math.prod(sizes)}): the sizes must multiply to {mesh.shape[i]}")
    return sizes, names


def _split_root(root: Any, r: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """The root mesh with its dim `r` split: the other dims keep their groups, the new ones get
    theirs (every slice's, made by every process in one order)."""
    shape = root.shape[:r] + sizes + root.shape[r + 1:]
    old = root.mesh_dim_names or ("",)
    new_names = old[:r] + names + old[r + 1:]
    grid = root._grid.reshape(shape)
    me = None if root._coordinate is None else int(root._grid[tuple(root._coordinate)])
    backend = "nccl" if root.device_type == "cuda" else None
    groups: list[Any] = []
    for d in range(len(shape)):
        if d < r or d >= r + len(sizes):
            groups.append(root._groups[d if d < r else d - len(sizes) + 1])
            continue
        mine = None
        for row in grid.movedim(d, -1).reshape(-1, shape[d]).tolist():
            group = group_for(tuple(row), backend)
            if me in row:
                mine = group
        groups.append(mine)
    made = type(root)(root.device_type, grid, mesh_dim_names=new_names, _groups=tuple(groups))
    made._whole = root._whole  # the same ranks in the same order
    for name, dims in root._flattened.items():  # flattened dims that do not merge the split dim
        if r not in dims:
            made._flattened[name] = tuple(d if d < r else d + len(sizes) - 1 for d in dims)
    return made
