"""Worker threads: one per device, running the partitions' tasks of each clock cycle.

Within a clock cycle the tasks of different partitions are independent, so each device
gets a thread and the devices compute at the same time (CUDA kernels are launched
asynchronously from each thread; the GIL is released while PyTorch computes). All CPU
devices share one worker: they are one device. A worker runs `Task.compute` and sends
back `(True, (task, batch))`, or `(False, exc_info)` when the task raised; it keeps
serving, so the pipeline can collect every result of the cycle and then re-raise the
first exception instead of waiting forever. Workers run with the caller's grad mode.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from queue import Queue
from types import TracebackType
from typing import Any, Optional, Union

import torch

from ._microbatch import Batch
from ._stream import AbstractStream, use_device, use_stream

__all__ = ["ExcInfo", "InQueue", "OutQueue", "Task", "spawn_workers"]

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
InQueue = Queue[Optional["Task"]]
OutQueue = Queue[tuple[bool, Any]]  # (True, (task, batch)) | (False, exc_info) | (False, None): done


class Task:
    """One partition on one micro-batch: `compute()` in a worker, then `finalize(batch)` in the caller."""

    def __init__(self, stream: AbstractStream, *, compute: Callable[[], Batch],
                 finalize: Optional[Callable[[Batch], None]]) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize

    def compute(self) -> Batch:
        with use_stream(self.stream):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream):
            self._finalize(batch)


def _worker(in_queue: InQueue, out_queue: OutQueue, device: torch.device,
            grad_mode: bool) -> None:
    torch.set_grad_enabled(grad_mode)
    with use_device(device):
        while True:
            task = in_queue.get()
            if task is None:
                break
            try:
                batch = task.compute()
            except Exception:
                out_queue.put((False, sys.exc_info()))
                continue
            out_queue.put((True, (task, batch)))
    out_queue.put((False, None))  # this worker is done


def _normalize(device: Union[torch.device, str]) -> torch.device:
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextmanager
def spawn_workers(devices: Sequence[torch.device]) -> Iterator[tuple[list[InQueue], list[OutQueue]]]:
    """Start one worker per distinct device; yield `(in_queues, out_queues)` aligned with `devices`."""
    workers: dict[torch.device, tuple[InQueue, OutQueue]] = {}
    in_queues: list[InQueue] = []
    out_queues: list[OutQueue] = []
    grad_mode = torch.is_grad_enabled()
    for device in devices:
        device = _normalize(device)
        if device not in workers:
            queues: tuple[InQueue, OutQueue] = (Queue(), Queue())
            thread = threading.Thread(target=_worker, args=(*queues, device, grad_mode), daemon=True,
                                      name=f"shardwise-pipe-{device}")
            thread.start()
            workers[device] = queues
        in_queues.append(workers[device][0])
        out_queues.append(workers[device][1])
    try:
        yield in_queues, out_queues
    finally:
        for in_queue, _ in workers.values():
            in_queue.put(None)
        for _, out_queue in workers.values():
            while True:  # drop results nobody collected (after an exception) until the worker is done
                ok, payload = out_queue.get()
                if not ok and payload is None:
                    break
