"""`explain_redistribute`: the plan for a layout change, as text, without running it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch

from ._describe import as_shape
from ._layout import ShardOrderLike, normalize_placements, normalize_shard_order
from ._mesh import AbstractMesh
from ._placement import Placement
from ._redistribute import RedistributePlan, plan_redistribute

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
    mesh: Union[AbstractMesh, Sequence[int]],
    shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    **kwargs: object,
) -> str:
    """Human-readable plan: each collective, its mesh dim and bytes received per rank.

    >>> from shardwise import Shard, Replicate
    >>> print(explain_redistribute((2, 2), (8, 8), [Shard(0), Shard(1)], [Replicate(), Replicate()]))
    redistribute (8, 8) on mesh (2, 2): (S(0), S(1)) -> (R, R)
      1. mesh dim 0: S(0) -> R by all_gather (64 B)  -> (R, S(1))
      2. mesh dim 1: S(1) -> R by all_gather (128 B)  -> (R, R)
      total: 192 B received per rank
    """
    if not isinstance(mesh, AbstractMesh):
        mesh = AbstractMesh(mesh)
    return plan_for(mesh, shape, src, dst, **kwargs).explain()  # type: ignore[arg-type]
