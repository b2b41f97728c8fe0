"""The capacity form's experts at fixed shapes: each local expert's rows in one batched matmul.

Under `ExpertParallel(tokens="split", capacity_factor=...)` every local expert receives exactly
`ep * capacity` rows, laid together by expert. transformers' eager experts loop would find
them again with `nonzero` and `torch.where` per expert, shapes a trace cannot hold, so
`shardwise.compile` would run the step eagerly. Experts that transformers lets swap their
kernel (`@use_experts_implementation`: `has_gate`, `has_bias`, `is_transposed`,
`_apply_gate`, `act_fn`, an optional post-expert norm) are run here as one `bmm` per
projection over the stack of local experts, each row at weight 1: the arithmetic of
transformers' own batched kernel (gate and up, the model's gate function, down, biases
added after each product), with no value read on the host.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["batched_experts", "runs_batched"]

_INTERFACE = ("has_gate", "has_bias", "is_transposed", "_apply_gate")


def runs_batched(module: nn.Module) -> bool:
    """Whether the experts module describes its arithmetic as transformers' experts interface does."""
    return all(hasattr(module, a) for a in _INTERFACE) and hasattr(module, "down_proj")


def batched_experts(module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (experts, n, hidden), expert `e`'s n rows at `rows[e]`, through the module's local
    experts (its stacked parameters, as many as `rows` has experts): (experts, n, hidden)."""
    up = "gate_up_proj" if getattr(module, "has_gate") else "up_proj"
    biased = bool(getattr(module, "has_bias"))
    transposed = bool(getattr(module, "is_transposed"))
    h = _linear(rows, getattr(module, up), getattr(module, f"{up}_bias") if biased else None, transposed)
    h = module._apply_gate(h) if getattr(module, "has_gate") else module.act_fn(h)  # type: ignore[operator]
    out = _linear(h, getattr(module, "down_proj"), getattr(module, "down_proj_bias") if biased else None, transposed)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)  # type: ignore[operator]
    return out


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    """x (E, n, in) times each expert's weight: (E, in, out) when `transposed`, else (E, out, in)."""
    y = torch.bmm(x, weight if transposed else weight.transpose(1, 2))  # (E, n, out)
    return y if bias is None else y + bias.unsqueeze(1)
