"""`explain_redistribute`: the plan for a layout change, as text, without running it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from ._describe import as_shape
from ._layout import ShardOrderLike, contiguous_strides, normalize_placements, normalize_shard_order
from ._mesh import AbstractMesh, DeviceMesh
from ._placement import Placement
from ._redistribute import RedistributePlan, plan_redistribute
from ._spec import DTensorSpec, TensorMeta
from ._tensor import plan_cross, ranks_of

__all__ = ["explain_redistribute", "plan_for"]


def plan_for(
    mesh: AbstractMesh,
    shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    *,
    dtype: torch.dtype = torch.float32,
    src_shard_order: ShardOrderLike = None,
    dst_shard_order: ShardOrderLike = None,
    bandwidth: Optional[Sequence[float]] = None,
) -> RedistributePlan:
    """The cheapest plan from `src` to `dst` for a tensor of `shape` on `mesh` (pure)."""
    if not isinstance(mesh, AbstractMesh):
        raise TypeError(f"mesh must be an AbstractMesh or a DeviceMesh, got {mesh!r}: e.g. AbstractMesh((2, 4))")
    shape = as_shape(shape, "shape (the global shape)")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}: e.g. torch.float32")
    ndim = len(shape)
    s = normalize_placements(src, mesh.ndim, ndim, what="src placements")
    d = normalize_placements(dst, mesh.ndim, ndim, what="dst placements")
    if bandwidth is not None and (
        not isinstance(bandwidth, (tuple, list)) or len(bandwidth) != mesh.ndim
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < math.inf for b in bandwidth)
    ):
        shown = tuple(bandwidth) if isinstance(bandwidth, list) else bandwidth
        raise ValueError(
            f"bandwidth {shown!r} needs one positive, finite number per mesh dim ({mesh.ndim}): the relative "
            f"bandwidth of each mesh dim, e.g. {(1.0,) * mesh.ndim}"
        )
    return plan_redistribute(
        tuple(mesh.shape),
        tuple(shape),
        dtype.itemsize,
        s,
        d,
        normalize_shard_order(s, src_shard_order, ndim),
        normalize_shard_order(d, dst_shard_order, ndim),
        None if bandwidth is None else tuple(float(b) for b in bandwidth),
    )


def explain_redistribute(
    mesh: Union[AbstractMesh, Sequence[int], Any],
    shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    *,
    dst_mesh: Any = None,
    **kwargs: Any,
) -> str:
    """Human-readable plan: each collective, its mesh dim and bytes received per rank.

    >>> from shardwise import Shard, Replicate
    >>> print(explain_redistribute((2, 2), (8, 8), [Shard(0), Shard(1)], [Replicate(), Replicate()]))
    redistribute (8, 8) on mesh (2, 2): (S(0), S(1)) -> (R, R)
      1. mesh dim 0: S(0) -> R by all_gather (64 B)  -> (R, S(1))
      2. mesh dim 1: S(1) -> R by all_gather (128 B)  -> (R, R)
      total: 192 B received per rank

    With `dst_mesh`, a move to another mesh: `mesh` and `dst_mesh` are then grids of ranks
    (nested lists, tensors, or DeviceMeshes), and each rank's bytes are shown against the
    lower bound (its target piece less what it holds):

    >>> print(explain_redistribute([0, 1, 2, 3], (8, 4), [Shard(0)], [Replicate()], dst_mesh=[2, 3]))
    redistribute (S(0)) on mesh (4,) of ranks [0, 1, 2, 3] -> (R) on mesh (2,) of ranks [2, 3] of a [8, 4] tensor
      crossing (S(0)) -> (R):
      rank 0: receives 0 B (lower bound 0 B), sends 64 B
      rank 1: receives 0 B (lower bound 0 B), sends 64 B
      rank 2: receives 96 B from ranks 0, 1, 3 (lower bound 96 B), sends 32 B
      rank 3: receives 96 B from ranks 0, 1, 2 (lower bound 96 B), sends 32 B
      total: 192 B moved in 6 messages; busiest rank receives 96 B
    """
    if dst_mesh is not None:
        return _explain_cross(mesh, shape, src, dst, dst_mesh, **kwargs)
    if not isinstance(mesh, AbstractMesh):
        mesh = AbstractMesh(mesh)
    return plan_for(mesh, shape, src, dst, **kwargs).explain()


def _grid(mesh: Any, what: str) -> tuple[AbstractMesh, tuple[int, ...]]:
    """(the abstract mesh, its ranks row-major) of a DeviceMesh or a grid of ranks."""
    if isinstance(mesh, DeviceMesh):
        return AbstractMesh(tuple(mesh.shape), mesh.mesh_dim_names), ranks_of(mesh)
    try:
        grid = torch.as_tensor(mesh, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{what} must be a DeviceMesh or a grid of ranks (e.g. [[0, 1], [2, 3]]), got {mesh!r}") from exc
    grid = grid.reshape(1) if grid.ndim == 0 else grid
    return AbstractMesh(tuple(grid.shape)), tuple(grid.flatten().tolist())


def _explain_cross(mesh: Any, shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement],
                   dst_mesh: Any, *, dtype: torch.dtype = torch.float32, src_shard_order: ShardOrderLike = None,
                   dst_shard_order: ShardOrderLike = None) -> str:
    (a, a_ranks), (b, b_ranks) = _grid(mesh, "mesh"), _grid(dst_mesh, "dst_mesh")
    shape = as_shape(shape, "shape (the global shape)")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}: e.g. torch.float32")
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    specs = []
    for m, placements, order, what in ((a, src, src_shard_order, "src"), (b, dst, dst_shard_order, "dst")):
        pl = normalize_placements(placements, m.ndim, len(shape), what=f"{what} placements")
        specs.append(DTensorSpec(m, pl, meta, normalize_shard_order(pl, order, len(shape))))
    return plan_cross(specs[0], a_ranks, specs[1], b_ranks).explain()
