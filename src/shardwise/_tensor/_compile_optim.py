"""Adam, AdamW and SGD under `shardwise.compile`: the step count and the learning rate are
inputs of the graph rather than constants baked into it.

torch's Adam with `capturable=False` (its default) reads its step count into Python to form
the bias corrections `1 - beta ** step`, which a trace would bake in as constants; and a
learning rate read as a Python float is baked in too, so a schedule's new lr every step
would be a new signature, traced anew (one program more each step). While tracing, each
Adam/AdamW argument whose parameters are on the CPU steps on the capturable path instead,
with its lr a 0-dim float64 tensor passed in on every call: the replay computes both from
the current values. A fused Adam/AdamW reads its step count from the state tensor in its
kernel already; only its lr is made an input.

SGD turns a tensor lr back into a Python number on its for-loop and foreach paths
(`alpha=-lr`), which a trace would bake in; its fused kernel takes the lr as a tensor. So while
tracing, an SGD group on the CPU steps on the fused path with its lr a 0-dim float64 input:
the same update (weight decay, momentum, dampening, Nesterov, maximize) in one kernel.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["lr_inputs", "steps_as_tensors", "steps_in_float64"]

# the module torch.optim.adam (not an attribute of torch.optim): where Adam looks up its capturable device rule
_ADAM_MODULE = importlib.import_module("torch.optim.adam")


def _reads_step_count(group: dict[str, Any]) -> bool:
    """Whether an Adam/AdamW param group reads its step count into Python and its capturable
    path can stand in during a trace: neither `capturable` nor `differentiable` nor `fused`,
    and every parameter on the CPU, where the step count lives too (the path's device rule)."""
    return (not group["capturable"] and not group["differentiable"] and not group["fused"]
            and all(p.device.type == "cpu" for p in group["params"]))


def _lr_as_input(group: dict[str, Any]) -> bool:
    """Whether a group's float learning rate becomes an input of the trace: on the capturable
    path that stands in (`_reads_step_count`), and in a fused step, whose kernel takes the lr
    as a tensor and reads its step count from the state tensor itself."""
    if _reads_step_count(group):
        return True
    return (group["fused"] and not group["differentiable"] and not group["capturable"]
            and all(p.device.type == "cpu" for p in group["params"]))


def steps_in_float64(leaves: list[Any]) -> None:
    """Keep the step count of each traced Adam/AdamW in float64 (torch makes it float32 unless
    the default dtype is float64), so the bias corrections the capturable path computes from
    it round as eager's Python floats do, not to float32."""
    for leaf in leaves:
        if isinstance(leaf, torch.optim.Adam):
            for group in leaf.param_groups:
                if _reads_step_count(group):
                    for p in group["params"]:
                        state: dict[str, Any] = leaf.state.get(p) or {}
                        step = state.get("step")
                        if isinstance(step, torch.Tensor) and step.dtype != torch.float64:
                            state["step"] = step.to(torch.float64)


def _sgd_lr_as_input(group: dict[str, Any]) -> bool:
    """Whether an SGD group steps on the fused path while tracing, its lr an input: on the CPU,
    not `differentiable`, and not fused with a tensor lr already."""
    return not group["differentiable"] and all(p.device.type == "cpu" for p in group["params"])


def lr_inputs(leaves: list[Any]) -> dict[int, torch.Tensor]:
    """This call's learning rate of every Adam/AdamW/SGD group whose lr the trace takes as an
    input (see the module docstring), as a 0-dim float64 tensor, by `id` of the group: an input
    of the graph rather than a constant baked into it, so the new lr a schedule sets every step
    is a new value of the same signature (keyed by its value, each step was traced anew, one
    program more)."""
    lrs: dict[int, torch.Tensor] = {}
    for leaf in leaves:
        if isinstance(leaf, (torch.optim.Adam, torch.optim.SGD)):
            rule = _lr_as_input if isinstance(leaf, torch.optim.Adam) else _sgd_lr_as_input
            for group in leaf.param_groups:
                if rule(group) and not isinstance(group["lr"], torch.Tensor):
                    lrs[id(group)] = torch.tensor(group["lr"], dtype=torch.float64)
    return lrs


@contextlib.contextmanager
def steps_as_tensors(leaves: list[Any], lrs: dict[int, torch.Tensor]) -> Iterator[None]:
    """While tracing, step Adam and AdamW arguments on their `capturable` path and SGD on its
    fused one, their learning rates the tensors in `lrs` (inputs of the graph, see `lr_inputs`).

    With `capturable=False` torch's Adam turns its step count into a Python float and bakes
    the bias corrections `1 - beta ** step` in as constants; with `capturable=True` it computes
    them from the step tensor, so the graph recomputes them from the current count on every
    replay. The flags and the lr tensor are set only for the trace (the signature was taken before
    and sees the user's values), and torch's device rule for capturable steps is widened to the CPU.
    """
    # a group without state yet is taking its first step, which is never kept (see `_compile._FIRST_STEP`):
    # it steps as in eager, so the call gives eager's numbers
    groups = [group for leaf in leaves if isinstance(leaf, torch.optim.Adam)
              for group in leaf.param_groups
              if _lr_as_input(group) and all(leaf.state.get(p) for p in group["params"])]
    sgd = [(leaf, group) for leaf in leaves if isinstance(leaf, torch.optim.SGD)
           for group in leaf.param_groups if id(group) in lrs
           and (group["momentum"] == 0 or all(leaf.state.get(p) for p in group["params"]))]
    if not groups and not sgd:
        yield
        return
    capturable = [group for group in groups if _reads_step_count(group)]  # (a fused group only takes the lr)
    supported = _ADAM_MODULE._get_capturable_supported_devices

    def with_cpu(supports_xla: bool = True) -> list[str]:
        return [*supported(supports_xla), "cpu"]

    kept = {id(group): (group["lr"], group["fused"], group["foreach"]) for group in groups + [g for _, g in sgd]}
    for group in capturable:
        group["capturable"] = True
    for group in groups:
        if id(group) in lrs:
            group["lr"] = lrs[id(group)]
    for _, group in sgd:
        group.update(lr=lrs[id(group)], fused=True, foreach=False)
    setattr(_ADAM_MODULE, "_get_capturable_supported_devices", with_cpu)
    try:
        yield
    finally:
        setattr(_ADAM_MODULE, "_get_capturable_supported_devices", supported)
        for group in capturable:
            group["capturable"] = False
        for group in groups + [g for _, g in sgd]:
            group["lr"], group["fused"], group["foreach"] = kept[id(group)]
