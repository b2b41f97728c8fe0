"""`PipelineStage`: one stage's module on this rank, as torch.distributed.pipelining names it.

A stage is a value until a schedule takes it: the module (run as it is, on `device`), its
index among `num_stages`, and the process group whose ranks hold the stages. The schedule
(`_schedules`) places the stages (stage `s` on the group's rank `s % size`, or in a V), checks
that this rank was given the right ones, and builds the pipe that runs them. Shapes need not
be declared: the engine's messages carry their own metadata, so `input_args` and
`output_args` (torch's static shapes) are accepted and not needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._describe import describe

__all__ = ["PipelineStage"]


class PipelineStage:
    """Stage `stage_index` of `num_stages`, running `submodule` on `device`; its neighbours are
    reached over `group` (default: every process). The signature is torch's; `dw_builder` is not
    supported (the engine splits a backward into its inputs' and weights' halves itself)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
                 input_args: Any = None, output_args: Any = None, output_grads: Any = None, input_grads: Any = None,
                 group: Optional[dist.ProcessGroup] = None, dw_builder: Optional[Callable[[], Callable[..., None]]] = None,
                 get_mesh: Any = None) -> None:
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage runs an nn.Module, got {describe(submodule)}")
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PipelineStage({name}=...) takes an int, got {describe(value)}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage(stage_index={stage_index}, num_stages={num_stages}): the index must be "
                             f"in [0, num_stages - 1] and num_stages >= 1")
        if dw_builder is not None:
            raise ValueError("PipelineStage(dw_builder=...) is not supported: shardwise splits each backward into "
                             "its inputs' and weights' gradients itself; leave dw_builder=None")
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage needs torch.distributed initialised: call "
                               "torch.distributed.init_process_group (or shardwise.init_device_mesh) first")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if self.group_size > num_stages:
            raise ValueError(f"PipelineStage(num_stages={num_stages}) on a group of {self.group_size} ranks: every "
                             f"rank needs a stage, so use at least {self.group_size} stages (or a smaller group)")
        self.input_args, self.output_args = input_args, output_args  # torch's static shapes: not needed here

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"device={str(self.device)!r}, group_rank={self.group_rank}, group_size={self.group_size})")
