"""The policies `fully_shard` takes: mixed precision and offload, as frozen values checked once.

| `MixedPrecisionPolicy` field | what it changes |
|---|---|
| `param_dtype` | the dtype the unit gathers in and the forward computes with (the sharded parameters and the optimizer keep theirs) |
| `reduce_dtype` | the dtype gradients are reduce-scattered (and all-reduced) in; default `param_dtype` |
| `output_dtype` | floating outputs of the module's forward are cast to it |
| `cast_forward_inputs` | floating inputs of the module's forward are cast to `param_dtype` |

`OffloadPolicy()` keeps everything where the parameters are; `CPUOffloadPolicy` keeps the
sharded parameters, their gradients and so the optimizer step in host memory (pinned
when asked), gathering onto the mesh's device for compute. On a CPU mesh it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._describe import describe

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


def _check_dtype(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy({field}={value!r}): a torch.dtype or None, got {describe(value)}")
    if not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy({field}={value}): parameters and gradients are floating point, so "
            f"{field} must be a floating dtype (torch.bfloat16, torch.float16, torch.float32, torch.float64) or None"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in `param_dtype`, reduce gradients in `reduce_dtype`, step the original dtype.

    >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).reduce_dtype
    torch.float32
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy(cast_forward_inputs={self.cast_forward_inputs!r}): True or False")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: parameters, gradients and optimizer state stay on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients in host memory (pinned when `pin_memory`), so the
    optimizer steps on the CPU; each unit is copied to the device when gathered."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy(pin_memory={self.pin_memory!r}): True or False")
