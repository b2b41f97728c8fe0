"""Streams and the two autograd functions that move a micro-batch between devices: `Copy`, `Wait`.

On CUDA a partition computes on its device's current stream while activations are
copied on separate *copy streams*, so copies overlap compute; `Wait` makes one stream
wait for another at the exact points the data is handed over, in forward and in
backward. `record_stream` tells the caching allocator that a tensor is in use on a
second stream, so its memory is not reused too early. On CPU every stream is the
`CPU_STREAM` sentinel and all of this reduces to `tensor.to(device)`, so the whole
engine runs (and is tested) on `devices=["cpu", "cpu"]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
from torch import Tensor

from .._describe import describe

__all__ = [
    "CPU_STREAM",
    "AbstractStream",
    "Copy",
    "as_device",
    "Wait",
    "current_stream",
    "get_device",
    "new_stream",
    "record_stream",
    "use_device",
    "use_stream",
    "wait_stream",
]


class _CPUStream:
    """The stream of CPU work: there is only one, and waiting on it is a no-op."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPU_STREAM"


CPU_STREAM = _CPUStream()
AbstractStream = Union[_CPUStream, "torch.cuda.Stream"]


def new_stream(device: torch.device) -> AbstractStream:
    """A fresh stream on `device` (the CPU sentinel on CPU)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def as_device(value: object, what: str) -> torch.device:
    """`value` (a torch.device, a device name such as "cpu" or "cuda:1", or a CUDA index) as a
    device this process has; TypeError / ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise TypeError(f"{what} must be a torch.device, a device name or a CUDA index, got {describe(value)}: "
                        "e.g. 'cpu' or 'cuda:0'")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{what} = {value!r} is not a device ({exc}): e.g. 'cpu' or 'cuda:0'") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ValueError(f"{what} = {value!r} names {device}, but this process sees {count} CUDA device(s): "
                         "use one of those, or 'cpu'")
    return device


def get_device(stream: AbstractStream) -> torch.device:
    """The device a stream (or the CPU sentinel) belongs to."""
    return stream.device


@contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make `device` the current CUDA device inside the block (nothing on CPU)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    if isinstance(stream, _CPUStream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Work queued on `source` from now on waits for the work queued so far on `target`."""
    if isinstance(source, _CPUStream) or isinstance(target, _CPUStream):
        return  # CPU work is synchronous; a CUDA -> CPU copy already synchronises.
    source.wait_stream(target)


def record_stream(tensor: Tensor, stream: AbstractStream) -> None:
    """Keep `tensor`'s memory from being reused until the work queued on `stream` is done."""
    if isinstance(stream, _CPUStream) or not tensor.is_cuda:
        return
    # Record on a tensor spanning the whole storage: recording a view with a storage
    # offset is not enough to protect the storage (pytorch#27366).
    whole = tensor.new_empty([0]).set_(tensor.untyped_storage())
    whole.record_stream(stream)


def _move(values: tuple[Any, ...], source: AbstractStream, target: AbstractStream) -> tuple[Any, ...]:
    target_device = get_device(target)
    out_stream = current_stream(target_device)
    moved = []
    with use_stream(source), use_stream(target):
        for value in values:
            if not isinstance(value, Tensor):
                moved.append(value)
                continue
            copied = value.to(target_device, non_blocking=True)
            if copied is value:
                copied = value.detach()  # same device: no copy, but never hand an input back
            record_stream(value, source)
            record_stream(copied, out_stream)
            moved.append(copied)
    return tuple(moved)


class Copy(torch.autograd.Function):
    """Copy values from `prev_stream`'s device to `next_stream`'s; gradients go the other way."""

    @staticmethod
    def forward(ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *values: Any) -> Any:
        ctx.prev_stream, ctx.next_stream = prev_stream, next_stream
        return _move(values, prev_stream, next_stream)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Any:
        back = _move(grads, ctx.next_stream, ctx.prev_stream)
        return (None, None) + back


class Wait(torch.autograd.Function):
    """`next_stream` waits for `prev_stream` in forward; the reverse in backward."""

    @staticmethod
    def forward(ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *values: Any) -> Any:
        ctx.prev_stream, ctx.next_stream = prev_stream, next_stream
        wait_stream(next_stream, prev_stream)
        return tuple(v.detach() if isinstance(v, Tensor) else v for v in values)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Any:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None) + grads
