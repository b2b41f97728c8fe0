"""Redistribute a local piece from one layout to another: plan (cached, pure) then execute."""

from __future__ import annotations

from typing import Optional

import torch

from .._mesh import DeviceMesh
from .._redistribute import plan_redistribute
from .._comm import Started
from .._comm import start as comm_start
from .._redistribute import RedistributePlan
from .._redistribute._execute import Call, execute_plan, single_collective
from .._spec import DTensorSpec

__all__ = ["collective_for", "redistribute_local", "start_redistribute"]


def _plan(src: DTensorSpec, dst: DTensorSpec) -> tuple[DeviceMesh, RedistributePlan]:
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
    return mesh, plan


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's piece of the same global tensor in layout `dst` (same mesh)."""
    if src.placements == dst.placements and src.shard_order == dst.shard_order:
        return local
    mesh, plan = _plan(src, dst)
    coordinate = mesh._coordinate
    if coordinate is None:
        return local
    return execute_plan(local, plan, mesh._groups, coordinate, mesh._whole)


def collective_for(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> Optional[Call]:
    """The one `_comm` collective (name, arguments) that moves `local` from `src` to `dst`,
    or None when the move is not exactly one collective."""
    mesh, plan = _plan(src, dst)
    coordinate = mesh._coordinate
    if coordinate is None:
        return None
    return single_collective(local, plan, mesh._groups, coordinate, mesh._whole)


def start_redistribute(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> Optional[Started]:
    """Issue a redistribute that is one collective without waiting for it (None otherwise)."""
    call = collective_for(local, src, dst)
    return None if call is None else comm_start(call[0], *call[1])
