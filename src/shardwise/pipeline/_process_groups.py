"""A pipe's process groups: its messages', its tied parameters', and its dp and cp replicas'.

The groups a layout names are made by `shardwise._mesh` (the one module that makes
groups), collectively, in one order on every process: the point-to-point group of each
row of `layout.p2p_rows`, then one group per row of each tie's holders. They belong to the
pipe, which gives them back in `close()` (`_groups.destroy_groups`); the dp and cp groups
are its meshes', shared and kept. A dry run's pipe makes none: its mesh's labels stand in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .. import _comm as comm
from .._mesh import destroy_groups, new_groups
from .._mesh import DryGroup, DryMesh, simulated_rank
from ..parallel._context_parallel import cp_group
from ..parallel._cp_comm import CpGroup
from ._layout import PipeLayout
from ._ties import Tie

__all__ = ["PipeGroups", "make_groups"]


@dataclass
class PipeGroups:
    """This rank's groups of a pipe: `p2p` carries its messages (None for a pp of 1); `ties[k]`
    sums the copies of `layout.ties[k]` (None where this rank holds none, or they cross meshes)."""

    p2p: Any
    p2p_size: int
    dp: Any  # the stage mesh's dp group (None without a dp dim)
    dp_size: int
    cp: Optional[CpGroup]
    ties: tuple[Any, ...] = ()

    def close(self) -> None:
        """Give back the groups the pipe made (collective: every process calls it)."""
        destroy_groups([self.p2p, *self.ties])
        self.p2p, self.ties = None, tuple(None for _ in self.ties)


def make_groups(layout: PipeLayout) -> PipeGroups:
    """The groups of `layout` for this rank (after its stages are sharded: sharding makes its
    meshes' groups, in the same order everywhere)."""
    device_type = layout.stage_mesh.device_type
    p2p = _p2p_group(layout)
    ties = tuple(_tie_group(tie, device_type) for tie in layout.ties)
    mesh, dp_dim, cp_dim = layout.stage_mesh, layout.dp_dim, layout.cp_dim
    return PipeGroups(p2p, layout.p2p_size, mesh.get_group(dp_dim) if dp_dim is not None else None,
                      mesh.size(dp_dim) if dp_dim is not None else 1,
                      cp_group(mesh[cp_dim], "DistributedPipe") if cp_dim is not None else None, ties)


def _backend(device_type: str) -> Optional[str]:
    return "nccl" if device_type == "cuda" else None


def _p2p_group(layout: PipeLayout) -> Any:
    """This rank's point-to-point group. A member may return from `new_group` before its peers
    have finished connecting; one exchange makes sure they have, so that `close()` right away
    cannot cut a peer's connection short."""
    mesh, size = layout.mesh, layout.p2p_size
    if isinstance(mesh, DryMesh):  # a dry run: the slice's label, no process group
        if size == 1:
            return None
        group = mesh.get_group(mesh.mesh_dim_index(layout.pp_dim))
    elif layout.p2p_rows:
        group = new_groups(layout.p2p_rows, _backend(layout.stage_mesh.device_type), point_to_point=layout.staged)
    else:
        return None
    comm.all_gather_ints([0], group, size)  # every member connected before any send
    return group


def _tie_group(tie: Tie, device_type: str) -> Any:
    """The group of the holders' copies whose pieces line up with this rank's (None when this
    rank holds none of them, or their pieces do not line up: they are summed across meshes)."""
    if tie.across:
        return None
    if device_type == "meta":  # a dry run's pipe: the holders' label, no process group
        return next((DryGroup(((len(ranks),), ("pp",)), (0,), len(ranks)) for ranks in tie.rows
                     if simulated_rank() in ranks), None)
    return new_groups(tie.rows, _backend(device_type))
