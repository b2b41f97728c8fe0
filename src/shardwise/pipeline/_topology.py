"""Where a pipeline's stages run: one (dp, tp) grid of global ranks per pp index.

A `DistributedPipe` runs either over one mesh with a pp dim (every stage on a grid of the
same shape: the uniform (pp, dp, tp) mesh) or over a list of stage meshes, one per pp
index, each a (tp,) or (dp, tp) DeviceMesh of its own ranks, whose tp sizes may differ
(consecutive stages of different widths; their boundaries cross by the cross-mesh
planner). Both become a `Topology`: `grids[p][d]` is the tp row of ranks of pp index `p`
in data-parallel replica `d`, and this rank's place in it.

>>> t = Topology(grids=(((0, 1, 2, 3),), ((4, 5),)), pp_rank=1, dp_index=0, tp_index=1)
>>> t.row(0), t.partner(0), t.uniform
((0, 1, 2, 3), 1, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .._describe import describe
from .._mesh import DeviceMesh

__all__ = ["Topology", "stage_topology", "uniform_topology"]

Grid = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Topology:
    """`grids[p][d]`: the ranks (tp order) of pp index `p`, data-parallel replica `d`;
    this rank is at (`pp_rank`, `dp_index`, `tp_index`)."""

    grids: tuple[Grid, ...]
    pp_rank: int
    dp_index: int
    tp_index: int

    @property
    def pp(self) -> int:
        return len(self.grids)

    @property
    def uniform(self) -> bool:
        """Whether every pp index has tp rows of one size (every rank has a partner in every stage)."""
        return len({len(grid[0]) for grid in self.grids}) == 1

    def row(self, p: int) -> tuple[int, ...]:
        """The tp row of pp index `p` in this rank's data-parallel replica."""
        return self.grids[p][self.dp_index]

    def partner(self, p: int) -> int:
        """The rank of pp index `p` with this rank's (dp, tp) coordinate (when the rows' sizes match)."""
        row = self.row(p)
        return row[self.tp_index % len(row)]


def uniform_topology(mesh: DeviceMesh, pp_dim: str, dp_dim: Optional[str], tp_dim: Optional[str],
                     cp_dim: Optional[str] = None) -> Topology:
    """The topology of a mesh with a pp dim (and optionally dp, cp and tp dims). A cp dim is
    a replica dim as dp is (each cp rank runs the pipeline on its piece of the sequence):
    the replicas are the (dp, cp) coordinates, row-major."""
    replicas = [mesh.mesh_dim_index(d) for d in (dp_dim, cp_dim) if d is not None]
    pp, tp = mesh.mesh_dim_index(pp_dim), (mesh.mesh_dim_index(tp_dim) if tp_dim is not None else None)
    grid = mesh.mesh.permute([pp, *replicas, *([tp] if tp is not None else [])])
    grid = grid.reshape(mesh.shape[pp], -1, mesh.shape[tp] if tp is not None else 1)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "a rank outside the mesh builds no pipe over it"
    replica = 0
    for d in replicas:
        replica = replica * mesh.shape[d] + coordinate[d]
    return Topology(tuple(tuple(tuple(row) for row in g) for g in grid.tolist()), coordinate[pp], replica,
                    coordinate[tp] if tp is not None else 0)


def stage_topology(meshes: Sequence[Any], dp_dim: Optional[str], tp_dim: Optional[str]
                   ) -> tuple[Topology, DeviceMesh, Optional[str], str]:
    """The topology of one stage mesh per pp index, this rank's stage mesh, and the dp and tp
    dim names; every problem with the meshes raised together as one ValueError."""
    bad = [m for m in meshes if not isinstance(m, DeviceMesh)]
    if bad or not meshes:
        raise TypeError(f"DistributedPipe runs over a DeviceMesh with a pp dim, or a list of one DeviceMesh per "
                        f"stage (each (tp,) or (dp, tp)), got {describe(bad[0] if bad else meshes)}")
    dp_dim, tp_dim = dp_dim or "dp", tp_dim or "tp"
    problems: list[str] = []
    grids: list[Grid] = []
    seen: dict[int, int] = {}
    for p, mesh in enumerate(meshes):
        names = mesh.mesh_dim_names or ((tp_dim,) if mesh.ndim == 1 else None)
        if names is None or tp_dim not in names or not set(names) <= {dp_dim, tp_dim}:
            problems.append(f"stage mesh {p} ({describe_mesh(mesh)}) must be a ({tp_dim!r},) or ({dp_dim!r}, "
                            f"{tp_dim!r}) mesh: a stage of one rank per replica is a tp mesh of size 1 (e.g. "
                            f"DeviceMesh('cpu', [[4], [5]], mesh_dim_names=({dp_dim!r}, {tp_dim!r})))")
            continue
        order = [names.index(dp_dim)] if dp_dim in names else []
        grid = mesh.mesh.permute(order + [names.index(tp_dim)])
        rows = grid.tolist() if dp_dim in names else [grid.tolist()]
        grids.append(tuple(tuple(row) for row in rows))
        for rank in mesh.mesh.flatten().tolist():
            if rank in seen:
                problems.append(f"rank {rank} is in stage meshes {seen[rank]} and {p}: the stages' meshes must not "
                                "overlap (interleaved schedules put several stages on one mesh by themselves)")
            seen.setdefault(rank, p)
    if problems:
        raise ValueError(_together(problems))
    dps = [len(g) for g in grids]
    if len(set(dps)) > 1:
        problems.append(f"the stage meshes have {dps} data-parallel replicas: every stage needs the same number "
                        f"(each replica runs its own pipeline through one row of every stage)")
    types = sorted({m.device_type for m in meshes})
    if len(types) > 1:
        problems.append(f"the stage meshes are on device types {types}: put every stage on one kind of device")
    missing = [r for r in range(dist.get_world_size()) if r not in seen]
    if missing:
        problems.append(f"ranks {missing} are in none of the stage meshes {[m.mesh.tolist() for m in meshes]}: "
                        "every process builds the pipe and runs one of its stages; add them to a stage mesh")
    if problems:
        raise ValueError(_together(problems))
    me = dist.get_rank()
    p = seen[me]
    d, t = next((d, row.index(me)) for d, row in enumerate(grids[p]) if me in row)
    return Topology(tuple(grids), p, d, t), meshes[p], dp_dim if dp_dim in (meshes[p].mesh_dim_names or ()) else None, tp_dim


def describe_mesh(mesh: DeviceMesh) -> str:
    names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"shape {tuple(mesh.shape)}{names}, ranks {mesh.mesh.tolist()}"


def _together(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems with the stage meshes:\n" + "\n".join(f"  - {p}" for p in problems)
