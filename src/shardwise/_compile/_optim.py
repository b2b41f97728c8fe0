"""SGD, Adam and AdamW under `shardwise.compile`: traced on their fused kernels, the learning
rate an input of the graph rather than a constant baked into it.

On its for-loop and foreach paths, torch's Adam (with `capturable=False`, its default) reads
its step count into Python to form the bias corrections `1 - beta ** step`, and SGD turns a
tensor lr back into a Python number (`alpha=-lr`); a trace would bake both in as constants, and
a learning rate read as a Python float is baked in too, so a schedule's new lr every step
would be a new signature, traced anew (one program more each step). Their fused kernels
(`_fused_adam_`, `_fused_adamw_`, `_fused_sgd_`) read the step count from the state tensor and
take the lr as a tensor. So while tracing, each SGD/Adam/AdamW group on the CPU steps on its
fused path, with its lr a 0-dim float64 tensor passed in on every call: the same update
(weight decay, amsgrad, maximize, momentum, dampening, Nesterov) in one kernel per group, which
the replay runs with the current step count and lr. Fused and for-loop/foreach steps round
alike up to the order of operations (a few ulps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["lr_inputs", "fused_for_trace"]

_TRACED = (torch.optim.Adam, torch.optim.SGD)  # (AdamW is an Adam)


def _lr_as_input(group: dict[str, Any]) -> bool:
    """Whether a group steps on its fused path while tracing, its lr an input: real floating
    parameters on the CPU (the fused kernels' dtypes: a complex one has none), not
    `differentiable` (no fused kernel), not `capturable` (its graph computes all from tensors)."""
    return (not group["differentiable"] and not group.get("capturable", False)
            and all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"]))


def lr_inputs(leaves: list[Any]) -> dict[int, torch.Tensor]:
    """This call's learning rate of every SGD/Adam/AdamW group whose lr the trace takes as an
    input (see the module docstring), as a 0-dim float64 tensor, by `id` of the group: an input
    of the graph rather than a constant baked into it, so the new lr a schedule sets every step
    is a new value of the same signature (keyed by its value, each step was traced anew, one
    program more)."""
    return {id(group): torch.tensor(group["lr"], dtype=torch.float64)
            for leaf in leaves if isinstance(leaf, _TRACED)
            for group in leaf.param_groups
            if _lr_as_input(group) and not isinstance(group["lr"], torch.Tensor)}


@contextlib.contextmanager
def fused_for_trace(leaves: list[Any], lrs: dict[int, torch.Tensor]) -> Iterator[None]:
    """While tracing, step the SGD/Adam/AdamW groups in `lrs` on their fused path, their
    learning rates the tensors there (inputs of the graph, see `lr_inputs`). The flags and the
    lr are set only for the trace: the signature was taken before and sees the user's values."""
    # a group without state yet is taking its first step, which is never kept (see `_function._FIRST_STEP`):
    # it steps as in eager, so the call gives eager's numbers (SGD without momentum keeps no state)
    groups = [group for leaf in leaves if isinstance(leaf, _TRACED)
              for group in leaf.param_groups if id(group) in lrs
              and (group.get("momentum", 1) == 0 or all(leaf.state.get(p) for p in group["params"]))]
    kept = [(group, group["lr"], group["fused"], group["foreach"]) for group in groups]
    for group in groups:
        group.update(lr=lrs[id(group)], fused=True, foreach=False)
    try:
        yield
    finally:
        for group, lr, fused, foreach in kept:
            group.update(lr=lr, fused=fused, foreach=foreach)
