"""The runtime local implementations run with: coordinates, seeds and reductions on real ranks.

An op rule's local implementation (`_ops._local`) asks the processes for three things only;
this is where the tensor layer answers them, on the DTensor's `DeviceMesh`, through the
comm door.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _comm as comm
from .._mesh import AbstractMesh, DeviceMesh
from . import _random

__all__ = ["RUNTIME"]


def _device_mesh(mesh: AbstractMesh, what: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} needs a DTensor on a DeviceMesh, got a spec on {mesh!r}")
    return mesh


class _Ranks:
    """`_ops.Runtime` on real process groups."""

    def coordinate(self, mesh: AbstractMesh) -> Optional[tuple[int, ...]]:
        found = _device_mesh(mesh, "a local computation").get_coordinate()
        return None if found is None else tuple(found)

    def seed(self, mesh: AbstractMesh, generator: Optional[torch.Generator]) -> int:
        if generator is not None:
            return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator).item())
        return _random.next_seed(_device_mesh(mesh, "random ops"))

    def all_reduce(self, t: torch.Tensor, mesh: AbstractMesh, mesh_dim: int, op: str) -> torch.Tensor:
        real = _device_mesh(mesh, "a local reduction")
        return comm.all_reduce(t, real.get_group(mesh_dim), real.size(mesh_dim), op, (mesh_dim,))


RUNTIME = _Ranks()
