"""Stages under `fully_shard` (dp x pp), as torch's schedules run them: one reduction per step.

A schedule runs one backward pass per micro-batch and stage. Left to themselves, the units
of a stage module under `fully_shard` would reduce-scatter their gradients, and reshard,
after every one of those passes. So, as torch's schedules do, a training step runs them with
gradient sync and the reshard after backward off (each unit sums its unsharded gradients
over the micro-batches and stays gathered), then turns both back on and has every unit
reduce its sum once (`shardwise.fsdp`'s post-backward, run at the end of the step): one
reduce_scatter per unit per step, and with `reshard_after_forward=False` (torchtitan's policy
under pp) one all_gather per unit per step. The units stay the registered reducers of their
parameters; this only says when they reduce. As under torch, both settings are True after a
step (whatever they were before it); after a step that raised, call `reset_iter_state()` on
the stage module before the next one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from ..fsdp import FSDPModule, reduce_accumulated

__all__ = ["one_reduction_per_step"]


@contextmanager
def one_reduction_per_step(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Around a training step of stage modules `modules`: the backwards inside sum, the end reduces."""
    sharded = [m for m in modules if any(isinstance(sub, FSDPModule) for sub in m.modules())]
    wrapped = [sub for m in sharded for sub in m.modules() if isinstance(sub, FSDPModule)]
    _sync(wrapped, False)
    try:
        yield
    finally:
        _sync(wrapped, True)
    for m in sharded:
        reduce_accumulated(m)


def _sync(wrapped: Sequence[FSDPModule], on: bool) -> None:
    for module in wrapped:  # (each FSDP module for its own state: a stage module need not be one itself)
        module.set_requires_gradient_sync(on, recurse=False)
        module.set_reshard_after_backward(on, recurse=False)
