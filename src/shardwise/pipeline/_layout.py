"""`PipeLayout`: where a `DistributedPipe`'s stages run and how they talk, as one frozen value.

Everything about a pipe that follows from its arguments alone is decided here, once, and
validated in one place (`plan_pipe`): the dims and meshes, the topology (the ranks of every
stage), the schedule (pure data), the skip routes, the channels of its messages, which rows
of ranks get a point-to-point group and which tied parameters are summed over which ranks.
What talks to processes (the stages' sharding, the process groups, the wire) is built from
this value afterwards (`_context`), and the step, its replay and the gradient code read it
rather than the pipe. ("Layout" here is the pipe's; a tensor's layout is its placements.)

`plan_stages` is the second way in, for stages built one by one (`shardwise.pipelining`'s
`PipelineStage`, as torch.distributed.pipelining builds them): one module per stage, the
schedule given as a value, over a one-dim `pp` mesh, with no skips, ties or checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._describe import describe
from .._mesh import DeviceMesh
from .._mesh import DryMesh, as_device_mesh
from ._arguments import check_arguments, check_staged
from ._channels import ChannelPlan
from ._pipe import as_given_by_torchgpipe
from ._schedule import (Schedule, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                        ScheduleLoopedBFS, ScheduleZBVZeroBubble)
from ._stage import split_module
from ._tensor_parallel import check_tp_plan
from ._ties import Tie, find_ties
from ._topology import Topology, stage_topology, uniform_topology
from .skip import SkipRoutes, inspect_skip_layout

__all__ = ["PipeLayout", "plan_pipe", "plan_stages"]


@dataclass(frozen=True, eq=False)
class PipeLayout:
    """A pipe's stages, ranks, meshes, schedule, channels and groups, seen from this rank."""

    mesh: Any  # as given: a DeviceMesh with a pp dim (a DryMesh in a dry run), or one DeviceMesh per stage
    stage_mesh: DeviceMesh  # this rank's stage's mesh (the mesh itself when there is one)
    pp_dim: str
    dp_dim: Optional[str]
    tp_dim: Optional[str]
    cp_dim: Optional[str]
    tp_mesh: Optional[DeviceMesh]  # this rank's stage's tensor-parallel sub-mesh
    zero_mesh: Optional[DeviceMesh]  # the (dp, tp) sub-mesh ZeRO-3 shards a stage over
    topology: Topology
    schedule: Schedule
    balance: tuple[int, ...]
    chunks: int
    checkpoint: str
    shard_parameters: bool
    bucket_cap_mb: float
    device: torch.device  # where this rank's stages live
    rank: int  # this rank's global rank
    skip_routes: SkipRoutes  # every partition's skip declarations
    channels: ChannelPlan
    p2p_rows: tuple[tuple[int, ...], ...]  # one point-to-point group per row, made by every process
    p2p_size: int  # the ranks of this rank's point-to-point group
    ties: tuple[Tie, ...]

    # derived values, read at every action of a step: computed once (a cached property of a
    # frozen value is a plain attribute after its first read)

    @functools.cached_property
    def num_stages(self) -> int:
        return len(self.balance)

    @functools.cached_property
    def pp_rank(self) -> int:
        return self.topology.pp_rank

    @functools.cached_property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this rank runs, in order."""
        return tuple(self.schedule.rank_stages(self.pp_rank))

    @property
    def staged(self) -> bool:
        """One mesh per stage (tp widths free): messages may cross to any rank of the next stage."""
        return not isinstance(self.mesh, DeviceMesh)

    def holds(self, stage: int) -> bool:
        return stage in self.local_stages


def plan_pipe(module: nn.Sequential, balance: Any, mesh: Any, *, pp_dim: str, dp_dim: Optional[str],
              tp_dim: Optional[str], cp_dim: Optional[str], tp_plan: Optional[Mapping[str, Any]],
              shard_parameters: bool, schedule: str, virtual_stages: Optional[int], chunks: Any, checkpoint: Any,
              device: Optional[torch.device | str], bucket_cap_mb: float) -> tuple[PipeLayout, list[nn.Sequential]]:
    """`DistributedPipe`'s arguments checked (every problem named, with its fix) and made its
    layout; with every stage's layers, not yet placed or sharded (ties are found by identity)."""
    chunks, checkpoint = as_given_by_torchgpipe(chunks, checkpoint)
    staged = isinstance(mesh, (list, tuple))
    mesh = mesh if staged else as_device_mesh(mesh)  # an AbstractMesh: a dry run's pipe
    if not isinstance(mesh, DeviceMesh) and not staged:
        raise TypeError(f"DistributedPipe runs over a DeviceMesh with a pp dim, or a list of one DeviceMesh per "
                        f"stage, got {describe(mesh)}: build one with shardwise.init_device_mesh(..., "
                        "mesh_dim_names=('pp',))")
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Iterable):
        raise TypeError(f"balance must be a list of layers per stage, got {describe(balance)}: e.g. [2, 2]")
    balance = list(balance)
    meshes = _meshes(mesh, pp_dim, dp_dim, tp_dim, cp_dim, tp_plan, schedule, virtual_stages, len(balance), chunks)
    topology, stage_mesh, dims, tp_mesh, zero_mesh = meshes
    if shard_parameters and dims[0] is None:
        raise ValueError("shard_parameters=True splits parameters over the data-parallel dim, but the mesh has "
                         "none: build it with a 'dp' dim (e.g. ('pp', 'dp', 'tp'), or ('dp', 'tp') stage meshes) "
                         "or pass dp_dim=")
    partitions = split_module(module, balance, chunks=chunks, checkpoint=checkpoint, allow_shared=True)
    check_tp_plan(tp_plan, partitions)
    pp = topology.pp
    plan: Schedule = (ScheduleGPipe(len(balance), chunks) if schedule == "gpipe" else
                      Schedule1F1B(len(balance), chunks) if schedule == "1f1b" else
                      ScheduleLoopedBFS(pp, len(balance) // pp, chunks) if schedule == "looped_bfs" else
                      ScheduleInterleavedZeroBubble(pp, len(balance) // pp, chunks) if schedule == "zero_bubble" else
                      ScheduleZBVZeroBubble(pp, chunks) if schedule == "zbv" else
                      ScheduleDualPipeV(pp, chunks) if schedule == "dualpipev" else
                      ScheduleInterleaved1F1B(pp, len(balance) // pp, chunks))
    stage_device = torch.device(device) if device is not None else _default_device(stage_mesh)
    skip_routes = inspect_skip_layout(partitions)
    ties = find_ties(partitions, plan.stage_rank, topology, shard_parameters)  # before sharding makes new objects
    where = [plan.stage_rank(s) for s in range(len(balance))]
    channels = ChannelPlan(len(balance), skip_routes, [topology.partner(p) for p in where],
                           rows=[topology.row(p) for p in where])
    p2p_rows, p2p_size = _p2p_rows(mesh, pp_dim, pp)
    dp, tp, cp = dims
    layout = PipeLayout(
        mesh=mesh, stage_mesh=stage_mesh, pp_dim=pp_dim, dp_dim=dp, tp_dim=tp, cp_dim=cp, tp_mesh=tp_mesh,
        zero_mesh=zero_mesh, topology=topology, schedule=plan, balance=tuple(balance), chunks=chunks,
        checkpoint=checkpoint, shard_parameters=shard_parameters, bucket_cap_mb=bucket_cap_mb, device=stage_device,
        rank=stage_mesh.get_rank(), skip_routes=skip_routes, channels=channels, p2p_rows=p2p_rows,
        p2p_size=p2p_size, ties=ties)
    return layout, partitions


def plan_stages(mesh: DeviceMesh, schedule: Schedule, device: torch.device,
                p2p_rows: Optional[Sequence[tuple[int, ...]]] = None) -> PipeLayout:
    """The layout of stages given one by one: stage `s` on the rank at pp index
    `schedule.stage_rank(s)` of `mesh` (one dim, `"pp"`, its size `schedule.num_ranks`), one
    module (a one-layer partition) per stage, no skips, no tied parameters, no checkpointing.
    `p2p_rows`: when `mesh` is one of several pipelines' (each over its own ranks), every
    pipeline's ranks, in one order on every process (each gets a group for its messages)."""
    if mesh.ndim != 1 or mesh.size(0) != schedule.num_ranks:
        raise ValueError(f"{schedule!r} runs on {schedule.num_ranks} ranks, but the mesh has shape "
                         f"{tuple(mesh.shape)}: build a one-dim ('pp',) mesh of {schedule.num_ranks} ranks")
    n = schedule.num_stages
    topology = uniform_topology(mesh, "pp", None, None)
    skip_routes = SkipRoutes(n, [])
    where = [schedule.stage_rank(s) for s in range(n)]
    channels = ChannelPlan(n, skip_routes, [topology.partner(p) for p in where], rows=[topology.row(p) for p in where])
    rows, p2p_size = _p2p_rows(mesh, "pp", topology.pp)
    if p2p_rows is not None and topology.pp > 1:
        rows = tuple(tuple(row) for row in p2p_rows)
        if tuple(mesh.mesh.tolist()) not in rows:
            raise ValueError(f"p2p_rows {[list(r) for r in rows]} must hold the mesh's ranks {mesh.mesh.tolist()}")
    return PipeLayout(
        mesh=mesh, stage_mesh=mesh, pp_dim="pp", dp_dim=None, tp_dim=None, cp_dim=None, tp_mesh=None, zero_mesh=None,
        topology=topology, schedule=schedule, balance=(1,) * n, chunks=schedule.num_microbatches, checkpoint="never",
        shard_parameters=False, bucket_cap_mb=25.0, device=device, rank=mesh.get_rank(), skip_routes=skip_routes,
        channels=channels, p2p_rows=rows, p2p_size=p2p_size, ties=())


Dims = tuple[Optional[str], Optional[str], Optional[str]]  # dp, tp, cp


def _meshes(mesh: Any, pp_dim: str, dp_dim: Optional[str], tp_dim: Optional[str], cp_dim: Optional[str],
            tp_plan: Optional[Mapping[str, Any]], schedule: str, virtual_stages: Optional[int], num_stages: int,
            chunks: int) -> tuple[Topology, DeviceMesh, Dims, Optional[DeviceMesh], Optional[DeviceMesh]]:
    """The topology, this rank's stage mesh, the (dp, tp, cp) dims, the tp and ZeRO-3 sub-meshes;
    every problem with the mesh and the schedule raised together."""
    if isinstance(mesh, DeviceMesh):
        dp_dim, tp_dim, cp_dim = check_arguments(mesh, pp_dim, dp_dim, tp_dim, cp_dim, tp_plan, schedule,
                                                  virtual_stages, num_stages, chunks)
        topology = uniform_topology(mesh, pp_dim, dp_dim, tp_dim, cp_dim)
        tp_mesh = mesh[tp_dim] if tp_dim is not None else None
        zero_mesh = mesh[tuple(d for d in (dp_dim, tp_dim) if d is not None)] if dp_dim is not None else None
        return topology, mesh, (dp_dim, tp_dim, cp_dim), tp_mesh, zero_mesh
    # one mesh per stage: (tp,) or (dp, tp), tp sizes free
    if cp_dim is not None:
        raise ValueError(f"cp_dim={cp_dim!r} needs one mesh with pp and cp dims (e.g. ('pp', 'cp') or "
                         "('pp', 'dp', 'cp', 'tp')), not a list of stage meshes")
    topology, stage_mesh, dp_dim, tp = stage_topology(mesh, dp_dim, tp_dim)
    check_staged(topology, tp_plan, schedule, virtual_stages, num_stages, chunks)
    tp_mesh = stage_mesh[tp] if stage_mesh.ndim == 2 else stage_mesh
    return topology, stage_mesh, (dp_dim, tp, None), tp_mesh, stage_mesh


def _p2p_rows(mesh: Any, pp_dim: str, pp: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The rows of ranks that get a point-to-point group (every process makes every row's, in
    order), and the size of this rank's: its pp slice of one mesh (none for a pp of 1, or in a
    dry run, whose mesh has its pp slices' labels); every process for stages of different
    widths, where a crossing may reach any rank of the next stage."""
    if not isinstance(mesh, DeviceMesh):
        return (tuple(range(dist.get_world_size())),), dist.get_world_size()
    if pp == 1 or isinstance(mesh, DryMesh):
        return (), pp
    pp_index = mesh.mesh_dim_index(pp_dim)
    return tuple(tuple(row) for row in mesh.mesh.movedim(pp_index, -1).reshape(-1, pp).tolist()), pp


def _default_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
