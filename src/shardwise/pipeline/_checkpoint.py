"""Activation checkpointing for pipeline partitions: `Checkpoint` and `Recompute`, with RNG replay.

A checkpointed partition runs its forward under `no_grad`, keeping only its input; in
backward it runs again with grad and backpropagates through that second run. Unlike
`torch.utils.checkpoint`, the work is split in two autograd functions, as torchgpipe
does: `Checkpoint` is the node the gradient flows through, and `Recompute` (an identity
on a phony, joined to the output) is the node whose *backward* re-runs the forward.
Autograd reaches `Recompute` as soon as the output's gradient is being computed, before
`Checkpoint` needs the result, which leaves room to overlap recomputation with the
gradient copy from the next partition.

The recomputation sees the same random numbers: the CPU generator (and the CUDA
generator of the input's device) is saved before the first run and restored, under
`torch.random.fork_rng`, around the second, so dropout masks match. Python's and
NumPy's generators are not replayed. Under context parallelism the recomputation runs its
attention context-parallel again, as the first run did. `is_checkpointing()` / `is_recomputing()` tell a
layer which run it is in (thread-local), so side effects such as batch-norm statistics
happen once.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> x = torch.ones(1, 2, requires_grad=True)
>>> y = checkpoint(lambda t: layer(t), x)
>>> y.sum().backward(); x.grad.shape
torch.Size([1, 2])
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional, Union

import torch
from torch import Tensor

from ..parallel._context_parallel import CpSession, cp_mode_on, current_cp_attention
from ._dependency import fork, get_phony, join
from ._microbatch import Batch, BatchValue

__all__ = ["is_checkpointing", "is_recomputing"]

Function = Callable[[BatchValue], BatchValue]
# What a forward run leaves for its recomputation: (output, input leaves) of the second run.
Recomputed = tuple[BatchValue, tuple[Any, ...]]
RNGStates = tuple[Tensor, Optional[Tensor]]


class _Phase(threading.local):
    checkpointing = False
    recomputing = False


_phase = _Phase()


def is_checkpointing() -> bool:
    """True inside the first (no-grad) run of a checkpointed partition, in this thread."""
    return _phase.checkpointing


def is_recomputing() -> bool:
    """True inside the recomputation of a checkpointed partition (during backward)."""
    return _phase.recomputing


@contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_phase, name)
    setattr(_phase, name, True)
    try:
        yield
    finally:
        setattr(_phase, name, previous)


def _save_rng(device: torch.device) -> RNGStates:
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda_state


@contextmanager
def _replay_rng(device: torch.device, states: RNGStates) -> Iterator[None]:
    cpu_state, cuda_state = states
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


class _Context:
    """What the two functions of one checkpointed partition run share."""

    def __init__(self, function: Function, batch: Batch) -> None:
        self.function = function
        self.atomic = batch.atomic
        self.device = batch.get_device()
        self.rng: Optional[RNGStates] = None
        self.recomputed: deque[Recomputed] = deque(maxlen=1)
        # context-parallel attention is a torch function mode, and autograd's engine runs backward
        # without the caller's modes: the recomputation re-enters the one its first run had
        self.cp = current_cp_attention()

    def call(self, values: tuple[Any, ...]) -> BatchValue:
        return self.function(values[0] if self.atomic else values)


def _split(values: tuple[Any, ...]) -> tuple[tuple[Tensor, ...], Callable[[tuple[Tensor, ...]], tuple[Any, ...]]]:
    """Tensors of a batch (for save_for_backward) and a function putting them back in place."""
    slots = [i for i, v in enumerate(values) if isinstance(v, Tensor)]

    def rebuild(tensors: tuple[Tensor, ...]) -> tuple[Any, ...]:
        out = list(values)
        for i, t in zip(slots, tensors):
            out[i] = t
        return tuple(out)

    return tuple(values[i] for i in slots), rebuild


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, shared: _Context, *values: Any) -> Any:
        ctx.shared = shared
        shared.rng = _save_rng(shared.device)
        tensors, ctx.rebuild = _split(values)
        ctx.save_for_backward(*tensors)
        with torch.no_grad(), _flag("checkpointing"):
            output = shared.call(values)
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Any:
        shared: _Context = ctx.shared
        output, leaves = shared.recomputed.pop()
        outputs = output if isinstance(output, tuple) else (output,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grad_values = tuple(v.grad if isinstance(v, Tensor) else None for v in leaves)
        return (None, None) + grad_values


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, shared: _Context, *values: Any) -> Tensor:
        ctx.shared = shared
        tensors, ctx.rebuild = _split(values)
        ctx.save_for_backward(*tensors)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> Any:
        shared: _Context = ctx.shared
        tensors = tuple(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        leaves = ctx.rebuild(tensors)
        assert shared.rng is not None  # Checkpoint.forward ran first
        with (_replay_rng(shared.device, shared.rng), torch.enable_grad(), _flag("recomputing"),
              CpSession(shared.cp) if shared.cp is not None and not cp_mode_on() else nullcontext()):
            output = shared.call(leaves)
        shared.recomputed.append((output, leaves))
        return (None, None) + (None,) * len(leaves)


class Checkpointing:
    """Checkpoint one partition on one micro-batch: `checkpoint()` now, `recompute(output)` after.

    `checkpoint()` runs `function` without keeping activations and returns its output;
    `recompute(output)` attaches the recomputation to that output's backward. They are
    separate so the pipeline can hand the output to the copy stream in between.
    """

    def __init__(self, function: Function, batch: Batch) -> None:
        self.batch = batch
        self.shared = _Context(function, batch)

    def checkpoint(self) -> Batch:
        # A phony requiring grad keeps Checkpoint in the graph even when no input requires grad
        # (the partition's parameters still need their gradients).
        phony = get_phony(self.shared.device, requires_grad=True)
        output = Checkpoint.apply(phony, self.shared, *self.batch.values)  # type: ignore[no-untyped-call]
        if isinstance(output, tuple):  # only floating tensors carry gradients
            output = tuple(o.detach() if isinstance(o, Tensor) and not o.is_floating_point() else o
                           for o in output)
        return Batch(output)

    def recompute(self, batch: Batch) -> None:
        k = batch.find_tensor_idx()
        batch[k], phony = fork(batch[k])
        phony = Recompute.apply(phony, self.shared, *self.batch.values)  # type: ignore[no-untyped-call]
        batch[k] = join(batch[k], phony)


def checkpoint(function: Callable[[Any], Any], input: Union[Tensor, tuple[Any, ...]]) -> Any:
    """Run `function(input)` checkpointed (recomputed in backward), outside a pipeline."""
    chk = Checkpointing(function, Batch(input))
    output = chk.checkpoint()
    chk.recompute(output)
    return output.value
