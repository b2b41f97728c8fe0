"""torch.distributed.pipelining's public API on shardwise's pipeline engine: a program
written for it runs after changing its imports to `shardwise.pipelining`.

`PipelineStage` holds one stage's module on this rank; `pipeline(module, mb_args,
split_spec=...)` (or `pipe_split()` marks in `forward`) cuts a module whose forward runs its
children in order into stage modules; the schedules (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`, `ScheduleInterleavedZeroBubble`,
`ScheduleZBVZeroBubble`, `ScheduleDualPipeV`) take torch's arguments and run on the engine
of `shardwise.pipeline.DistributedPipe` (the names are torch's; see `_schedules` for the
few differences). On two processes (``torchrun --nproc-per-node=2 train.py``)::

    stage = PipelineStage(blocks[rank], rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.mse_loss)
    if rank == 0:
        schedule.step(x)
    else:
        losses = []
        out = schedule.step(target=y, losses=losses)  # the joined outputs; losses: one per micro-batch
"""

from ._schedules import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                         ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble)
from ._split import Pipe, SplitPoint, build_stage, pipe_split, pipeline
from ._stage import PipelineStage

__all__ = ["Pipe", "PipelineStage", "Schedule1F1B",
           "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "SplitPoint", "build_stage", "pipe_split", "pipeline"]
