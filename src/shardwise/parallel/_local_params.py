"""Running a module's own forward on the local pieces of its DTensor parameters.

Some styles keep a module's parameters as DTensors (so the optimizer, checkpoints and data
parallel see their layout) but run the module's forward on plain local tensors: the experts
of a mixture-of-experts layer, each rank's own; a norm over per-head activations whose heads
are split. `local_parameters(module, names)` swaps each named parameter for its local piece
for the duration of a block and always puts the parameter back.

A parameter is read where the module reads it: data parallel puts a module's compute view
of its parameters (the piece it computes with, a DTensor on the tensor-parallel sub-mesh)
in `module.__dict__` for the duration of the forward, where attribute lookup finds it before
`_parameters`; the swap replaces what the forward would read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn

from .._placement import Placement
from .._tensor import DTensor, scale_grad

__all__ = ["local_parameters"]


@contextlib.contextmanager
def local_parameters(module: nn.Module, names: Sequence[str],
                     grad_placements: Optional[Sequence[Placement]] = None, grad_scale: float = 1.0) -> Iterator[None]:
    """Inside the block, `module.<name>` is the local piece of that DTensor parameter (its
    gradient flows back as `grad_placements`, default the parameter's own layout, times
    `grad_scale`)."""
    held: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for name in names:
            slots: dict[str, Any] = module.__dict__ if name in module.__dict__ else module._parameters
            value = slots[name]
            if not isinstance(value, DTensor):
                raise TypeError(f"local_parameters: {type(module).__name__}.{name} is {type(value).__name__}, "
                                f"not a DTensor")
            held.append((slots, name, value))
            piece: torch.Tensor = value.to_local(grad_placements=grad_placements)
            if grad_scale != 1.0:
                piece = scale_grad(piece, grad_scale)
            slots[name] = piece
        yield
    finally:
        for slots, name, value in reversed(held):
            slots[name] = value

