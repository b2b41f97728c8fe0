"""`StepContext`: what a step of a pipe works with on this rank, built once from its layout.

The step (`_step`, `_execute`) and its replay under `shardwise.compile` (`_replay`) take this
value instead of the pipe: the layout (pure data), this rank's stages, the process groups,
the wire that carries the messages, the guard that ends every step, and the gradient sums
that follow a training step (`_gradients`: registered reducers). `DistributedPipe` owns one
and hands it on; nothing here reaches back into the pipe, so the pipeline's modules import
one another in one direction only.

`place_stages` is the other half of building a pipe: this rank's stages moved to its
device and sharded over their tp sub-mesh (and over dp under ZeRO-3), before any group of
the pipe's own is made (the sharding makes its meshes' groups, in the same order everywhere).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

from torch import nn

from ..parallel import data_parallel
from ._gradients import PipeGradients, pipe_gradients
from ._guard import StepGuard
from ._layout import PipeLayout
from ._process_groups import PipeGroups, make_groups
from ._stage import PipelineStage
from ._tensor_parallel import shard_stage
from ._wire import Wire

__all__ = ["StepContext", "place_stages", "step_context"]


@dataclass(frozen=True, eq=False)
class StepContext:
    """A pipe's step on this rank: `stages[j]` runs stage `j` (its layers: `partitions[str(j)]`)."""

    layout: PipeLayout
    stages: dict[int, PipelineStage]
    partitions: nn.ModuleDict
    groups: PipeGroups
    wire: Wire
    guard: StepGuard
    gradients: PipeGradients

    def close(self) -> None:
        """The pipe's groups given back and its reducers unregistered (collective)."""
        self.gradients.release()
        self.groups.close()


def place_stages(layout: PipeLayout, partitions: Sequence[nn.Sequential],
                 tp_plan: Optional[Mapping[str, Any]]) -> dict[int, nn.Sequential]:
    """This rank's stages of `partitions`, on its device and sharded as the layout says."""
    # a stage built on meta stays there (split and sharded as it is) until `pipe.to_empty(device=...)`
    mine = {j: partitions[j] if _on_meta(partitions[j]) else partitions[j].to(layout.device)
            for j in layout.local_stages}
    for part in mine.values():  # each stage's layers sharded over its tp sub-mesh (and over dp: ZeRO-3)
        shard_stage(part, layout.tp_mesh, tp_plan)
        if layout.shard_parameters:
            assert layout.zero_mesh is not None  # the layout required a dp dim
            data_parallel(part, layout.zero_mesh, dp_dim=layout.dp_dim, shard_parameters=True,
                          bucket_cap_mb=layout.bucket_cap_mb)
    return mine


def step_context(layout: PipeLayout, partitions: nn.ModuleDict) -> StepContext:
    """The context of this rank's stages `partitions` (placed already): its groups made now, its
    gradient reducers registered (ValueError, naming both, when a parameter has one already)."""
    stages = {int(j): PipelineStage(cast(nn.Sequential, part), int(j), layout.num_stages, layout.rank)
              for j, part in partitions.items()}
    groups = make_groups(layout)
    wire = Wire(groups.p2p, layout.device, len(layout.channels.channels), tp_mesh=layout.tp_mesh)
    guard = StepGuard(layout, wire, groups)
    gradients = pipe_gradients(layout, groups, wire, guard, partitions)
    try:
        gradients.register()
    except ValueError:  # (every rank of an SPMD program is refused alike)
        groups.close()
        raise
    return StepContext(layout, stages, partitions, groups, wire, guard, gradients)


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))
