"""Redistribute a local piece from one layout to another: plan (cached, pure) then execute."""

from __future__ import annotations

import torch

from .._mesh import DeviceMesh
from .._redistribute import plan_redistribute
from .._redistribute._execute import execute_plan
from .._spec import DTensorSpec

__all__ = ["redistribute_local"]


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's piece of the same global tensor in layout `dst` (same mesh)."""
    if src.placements == dst.placements and src.shard_order == dst.shard_order:
        return local
    mesh = src.mesh
    assert isinstance(mesh, DeviceMesh)
    plan = plan_redistribute(
        mesh.shape,
        tuple(src.shape),
        src.dtype.itemsize,
        src.placements,
        dst.placements,
        src.shard_order,
        dst.shard_order,
        None,
        mesh._whole is not None,  # a sub-mesh without a group over all its ranks cannot exchange
    )
    coordinate = mesh._coordinate
    if coordinate is None:
        return local
    return execute_plan(local, plan, mesh._groups, coordinate, mesh._whole)
