"""The single-process GPipe engine: clock cycles of partition tasks on per-device workers.

Clock cycle `k` runs micro-batch `i` on partition `j` for every `i + j == k`
(`clock_cycles`), so the partitions fill, run together, and drain. Each cycle has two
steps. `fence` wires what autograd cannot infer and moves data: a phony edge from
micro-batch `i` to `i-1` on the same partition (so backward, too, runs in pipeline
order: `i` before `i-1`), the skip copies into partition `j` (straight from the
stashing partition, in source order), then the activation copy from partition `j-1`.
`compute` hands each task to its device's worker (checkpointed or not), then collects
the results in schedule order, attaching each checkpointed task's recomputation to its
output. A task that raises stops the pipeline at the end of its cycle: the other results
of the cycle are collected (no worker is left blocked) and the first exception is
re-raised with its traceback; no later cycle starts.

    fence for (i, j):
      out(i-1, j) --fork--+                       (micro-batch i-1, already past partition j)
                          | phony
      out(i, j-1) -------join--> skip copies --> Copy --> Wait --> compute(i, j) --> out(i, j)

    Backward of out(i-1, j) needs the phony's gradient, which arrives only once the backward
    of compute(i, j) has reached its input: B(i, j) runs before B(i-1, j).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional, cast

import torch
from torch import nn

from ._checkpoint import Checkpointing, is_recomputing
from ._dependency import depend
from ._microbatch import Batch, BatchValue
from ._schedule import clock_cycles
from ._stream import AbstractStream, Copy, Wait, current_stream, use_device
from ._timeline import Timeline, current_timeline
from ._worker import ExcInfo, InQueue, OutQueue, Task, spawn_workers
from .skip import SkipRoutes, SkipTrackerThroughPortals, use_skip_tracker

__all__ = ["Pipeline"]


def _copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    batch[:] = Copy.apply(prev_stream, next_stream, *batch.values)  # type: ignore[no-untyped-call]


def _wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    if prev_stream is next_stream or all(not isinstance(s, torch.cuda.Stream) for s in (prev_stream, next_stream)):
        return
    batch[:] = Wait.apply(prev_stream, next_stream, *batch.values)  # type: ignore[no-untyped-call]


class Pipeline:
    """Runs `partitions` (partition `j` on `devices[j]`) over micro-batches, in place."""

    def __init__(self, partitions: Sequence[nn.Sequential], devices: Sequence[torch.device],
                 copy_streams: Sequence[Sequence[AbstractStream]], skip_routes: SkipRoutes,
                 checkpoint_stop: int) -> None:
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.skip_routes = skip_routes
        self.checkpoint_stop = checkpoint_stop

    def run(self, batches: list[Batch]) -> None:
        """Run every micro-batch through every partition; `batches[i]` becomes `i`'s output."""
        trackers = [SkipTrackerThroughPortals(self.skip_routes) for _ in batches]
        with spawn_workers(self.devices) as (in_queues, out_queues):
            for schedule in clock_cycles(len(batches), len(self.partitions)):
                self.fence(batches, schedule, trackers)
                self.compute(batches, schedule, trackers, in_queues, out_queues)

    def fence(self, batches: list[Batch], schedule: list[tuple[int, int]],
              trackers: list[SkipTrackerThroughPortals]) -> None:
        for i, j in schedule:
            if i != 0:
                # batches[i-1] still holds partition j's output of micro-batch i-1 here.
                depend(batches[i - 1], batches[i])
            next_stream = self.copy_streams[j][i]
            for prev_j, ns, name in self.skip_routes.copy_policy(j):
                trackers[i].copy(batches[i], self.copy_streams[prev_j][i], next_stream, ns, name)
            if j != 0:
                _copy(batches[i], self.copy_streams[j - 1][i], next_stream)

    def compute(self, batches: list[Batch], schedule: list[tuple[int, int]],
                trackers: list[SkipTrackerThroughPortals], in_queues: Sequence[InQueue],
                out_queues: Sequence[OutQueue]) -> None:
        n = len(self.partitions)
        streams = [current_stream(d) for d in self.devices]
        timeline = current_timeline()
        for i, j in schedule:
            batch = batches[i]
            if j != 0:
                _wait(batch, self.copy_streams[j][i], streams[j])
            function = _Call(self.partitions[j], trackers[i], timeline, j, i)
            if i < self.checkpoint_stop:
                chk = Checkpointing(function, batch)
                task = Task(streams[j], compute=chk.checkpoint, finalize=chk.recompute)
            else:
                task = Task(streams[j], compute=functools.partial(batch.call, function), finalize=None)
            in_queues[j].put(task)

        exc_info: Optional[ExcInfo] = None
        for i, j in schedule:
            ok, payload = out_queues[j].get()
            if exc_info is not None:
                continue  # drain the cycle; keep the first exception
            if not ok:
                exc_info = cast(ExcInfo, payload)
                continue
            task, batch = cast(tuple[Task, Batch], payload)
            if j != n - 1:
                _wait(batch, streams[j], self.copy_streams[j][i])
            with use_device(self.devices[j]):
                task.finalize(batch)
            batches[i] = batch
        if exc_info is not None:
            raise exc_info[1].with_traceback(exc_info[2])


class _Call:
    """Partition `j` on micro-batch `i` with its skip tracker installed (in forward and recompute);
    the forward run (not the recomputation) is recorded in the active timeline, row `j`."""

    def __init__(self, partition: nn.Sequential, tracker: SkipTrackerThroughPortals,
                 timeline: Optional[Timeline], j: int, i: int) -> None:
        self.partition, self.tracker, self.timeline, self.j, self.i = partition, tracker, timeline, j, i

    def __call__(self, input: BatchValue) -> BatchValue:
        with use_skip_tracker(self.tracker):
            if self.timeline is None or is_recomputing():
                return cast(BatchValue, self.partition(input))
            with self.timeline.span(self.j, self.j, self.i, "F"):
                return cast(BatchValue, self.partition(input))
