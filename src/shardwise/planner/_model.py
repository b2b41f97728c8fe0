"""The model as the planner sees it: a meta copy (no data copied), its repeated blocks, the
default loss, and the optimizer's steady state."""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["default_loss", "meta_copy", "repeated", "steady"]

Blocks = Any  # an nn.ModuleList or nn.Sequential


def steady(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Give the optimizer its state before the measured step (a step on zero gradients, meta
    tensors, no communication), so the step's peak is a steady-state step's, state included."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"AutoPlanner's default loss takes a tensor output or one with .loss / .logits, got "
                        f"{type(output).__name__}: pass loss_fn=")
    return logits.float().mean()


def repeated(module: nn.Module) -> Optional[tuple[str, Blocks]]:
    """The largest list (ModuleList or Sequential) of blocks of one type and parameter shapes."""
    best: Optional[tuple[str, Blocks]] = None
    for name, m in module.named_modules():
        if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2:
            kinds = {(type(c), tuple((n, tuple(p.shape)) for n, p in c.named_parameters())) for c in m}
            first = next(iter(m))
            if len(kinds) == 1 and any(True for _ in first.parameters()) and (best is None or len(m) > len(best[1])):
                best = (name, m)
    return best


def meta_copy(module: nn.Module, keep: Optional[int]) -> nn.Module:
    """`module` with meta parameters and buffers (no data copied), keeping only the first
    `keep` blocks of its repeated list when `keep` is given."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    out = copy.deepcopy(module, memo)
    if keep is not None:
        found = repeated(out)
        assert found is not None
        name, blocks = found
        parent_name, _, attr = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        setattr(parent, attr, type(blocks)(*list(blocks)[:keep]) if isinstance(blocks, nn.Sequential)
                else nn.ModuleList(list(blocks)[:keep]))
    return out
