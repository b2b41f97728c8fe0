"""torch's stages and schedules run on `DistributedPipe`: the glue, in one place.

A schedule of `shardwise.pipelining` builds one `DistributedPipe.from_stages` per schedule:
the engine's schedule value of the same name (`shardwise.pipeline`), a one-dim `("pp",)`
mesh over the stages' group, and each stage's module as a one-layer partition, `StageCall`.
The engine then runs its own actions (F, B, and the split backward's I and W) over its own
wire, as for any pipe.

What torch's API adds is carried beside the engine rather than through it, in `StepState`:
the engine cuts its input with `Tensor.chunk` and hands a stage one value, while torch cuts
every argument with `tensor_split` and passes `*args, **kwargs`. So the first stage's rank
gives the engine the micro-batch numbers (`torch.arange(m)`, one per micro-batch) and each
`StageCall` looks up its micro-batch's arguments itself: a stage runs its micro-batches'
forwards in the order the engine's schedule gives them (read from its `rank_order`), which
names the micro-batch of every call. The last stage keeps its outputs the same way, for
`step` to join and return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .. import _comm as comm
from .._mesh import DeviceMesh
from ..pipeline import DistributedPipe, Schedule
from ._chunks import split_microbatches
from ._stage import PipelineStage

__all__ = ["StageCall", "StepState", "build_pipe", "forward_order", "run_step"]


class StepState:
    """One step's micro-batches as each stage of this rank sees them: `inputs(i)` is micro-batch
    `i`'s (args, kwargs), cut when a stage first asks (inside the engine's step, so a
    batch that cannot be cut stops every stage, not this rank alone); `order[s]` the
    micro-batches of stage `s` in the order of their forwards; `outputs[i]` the last stage's
    output for micro-batch `i` (detached)."""

    def __init__(self, order: dict[int, list[int]]) -> None:
        self.order = order
        self.whole: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
        self.cut: Optional[list[tuple[tuple[Any, ...], dict[str, Any]]]] = None
        self.outputs: dict[int, Any] = {}
        self.done = {s: 0 for s in order}
        self.last = -1  # the micro-batch the last stage ran most recently

    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.whole, self.cut, self.outputs, self.last = (args, kwargs), None, {}, -1
        self.done = {s: 0 for s in self.order}

    def inputs(self, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.cut is None:
            self.cut = split_microbatches(*self.whole, self.microbatches)
        return self.cut[i]

    @property
    def microbatches(self) -> int:
        return len(next(iter(self.order.values())))

    def next(self, stage: int) -> int:
        """The micro-batch of stage `stage`'s next forward."""
        k = self.done[stage]
        self.done[stage] = k + 1
        return self.order[stage][k]


class StageCall(nn.Module):
    """A stage's module as the engine's one-layer partition: the first stage runs on its
    micro-batch's arguments, a later one on what the stage before sent (a tuple spread as
    positional arguments); every stage gets its micro-batch's keyword arguments."""

    def __init__(self, stage: PipelineStage, state: StepState) -> None:
        super().__init__()
        self.submod = stage.submod
        self.index, self.is_first, self.is_last = stage.stage_index, stage.is_first, stage.is_last
        self.state = state

    def forward(self, value: Any) -> Any:
        i = self.state.next(self.index)
        args, kwargs = self.state.inputs(i)
        if not self.is_first:
            args = value if isinstance(value, tuple) else (value,)
        out = self.submod(*args, **kwargs)
        out = tuple(out) if isinstance(out, list) else out
        if self.is_last:
            self.state.outputs[i] = pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)
            self.state.last = i
        return out


def build_pipe(stages: Sequence[PipelineStage], schedule: Schedule, state: StepState,
               loss_fn: Optional[Callable[..., Tensor]]) -> DistributedPipe:
    """The engine's pipe of this rank's `stages` under `schedule`: collective over every process
    (each builds its schedule at the same point of the program, as torch's own process groups
    are made), which makes the pipe's own group for its messages."""
    group, device = stages[0].group, stages[0].device
    size, world = dist.get_world_size(group), dist.get_world_size()
    ranks = list(range(size)) if group is None else [dist.get_global_rank(group, r) for r in range(size)]
    if size == world:
        mesh, rows = DeviceMesh(device.type, ranks, mesh_dim_names=("pp",)), None
    else:  # one pipeline of several (e.g. beside data parallelism): every one's ranks, to make each one's group
        rows = _pipelines(ranks)
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("pp",), _groups=(group,))
    partitions = {s.stage_index: nn.Sequential(StageCall(s, state)) for s in stages}
    return DistributedPipe.from_stages(partitions, mesh, schedule, device=device, loss_fn=loss_fn, p2p_rows=rows)


def _pipelines(ranks: list[int]) -> list[tuple[int, ...]]:
    """Every process's pipeline ranks (this one's: `ranks`), each pipeline once, in first-seen
    order; ValueError (on every process alike) unless they split the processes."""
    world = dist.get_world_size()
    sizes = comm.all_gather_ints([len(ranks)], dist.group.WORLD, world)
    width = max(n for (n,) in sizes)
    found = comm.all_gather_ints(ranks + [-1] * (width - len(ranks)), dist.group.WORLD, world)
    rows: list[tuple[int, ...]] = []
    for row in (tuple(r for r in got if r >= 0) for got in found):
        if row not in rows:
            rows.append(row)
    seen = sorted(r for row in rows for r in row)
    if seen != list(range(world)):
        raise ValueError(f"the stages' groups {[list(r) for r in rows]} must split the {world} processes, each in "
                         "one pipeline: give every process's stages the group of its own pipeline")
    return rows


def forward_order(schedule: Schedule, rank: int) -> dict[int, list[int]]:
    """Per stage of `rank`, the micro-batches of its forwards in the schedule's order."""
    order: dict[int, list[int]] = {s: [] for s in schedule.rank_stages(rank)}
    for a in schedule.rank_order(rank):
        if a.kind == "F":
            order[a.stage].append(a.microbatch)
    return order


def run_step(pipe: DistributedPipe, state: StepState, args: tuple[Any, ...], kwargs: dict[str, Any],
             train: bool) -> None:
    """One step of `pipe` on the whole batch `args`, `kwargs`: forward and backward (`train`) or
    forward only."""
    state.begin(args, kwargs)
    first = torch.arange(state.microbatches) if pipe.layout.holds(0) else None  # micro-batch i's input: its number
    if train:
        pipe.step(first)
    else:
        pipe(first)
