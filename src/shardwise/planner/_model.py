"""The model as the planner sees it: a meta copy (no data copied), its repeated blocks, its
experts modules, a plan cut to the blocks kept, the default loss, and the optimizer's steady state."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from .._mesh import AbstractMesh
from ..parallel import ExpertParallel, ShardingPlan

__all__ = ["cut_plan", "default_loss", "experts_modules", "meta_copy", "repeated", "steady"]

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
    """`output.loss` when the model returns one, else the squared error of its output (`.logits`,
    or the first element of a tuple) against a zero target. Not the mean: a linear loss never
    needs a pending sum (`Partial`) reduced, so tensor parallel would look free."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"AutoPlanner's default loss takes a tensor output or one with .loss / .logits, got "
                        f"{type(output).__name__}: pass loss_fn=")
    return logits.float().square().mean()


def experts_modules(module: nn.Module, ranks: int) -> list[str]:
    """Paths of the experts modules under `module` that `ExpertParallel(tokens="split")` takes
    over `ranks` ranks: stacked experts, called with the routes, at least one per rank."""
    style, mesh = ExpertParallel(tokens="split"), AbstractMesh((ranks,), ("ep",))
    return [path for path, m in module.named_modules()
            if isinstance(getattr(m, "num_experts", None), int) and not style.validate(m, mesh)]


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


def cut_plan(plan: ShardingPlan, prefix: str, layers: int, keep: int) -> Optional[ShardingPlan]:
    """`plan` for the model whose repeated list `prefix` keeps its first `keep` of `layers`
    blocks: the entries that name a block by index (`blocks.3.q`) kept for the blocks left,
    patterns (`blocks.*.q`) and the rest as they are. None when the plan does not treat every
    block alike (then only the whole model measures it)."""
    head = prefix + "."

    def index(key: str) -> str:
        """The block a key names ("*" for none: outside the list, or a pattern over every block)."""
        return key[len(head):].partition(".")[0] if key.startswith(head) else "*"

    def cut(entries: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        blocks: dict[str, dict[str, Any]] = {}
        for key, value in entries.items():
            if index(key) != "*":
                blocks.setdefault(index(key), {})[key[len(head) + len(index(key)):]] = value
        every = {str(i) for i in range(layers)}
        if blocks and (set(blocks) != every or any(b != blocks["0"] for b in blocks.values())):
            return None  # some blocks only, blocks planned differently, or a pattern over some (blocks.1?.q)
        kept = {"*"} | {str(i) for i in range(keep)}
        return {key: value for key, value in entries.items() if index(key) in kept}

    entries = cut(plan.plan)
    outputs = None if plan.output_plan is None else cut(plan.output_plan)
    local = None if plan.return_local_tensor is None else cut(dict.fromkeys(plan.return_local_tensor))
    if entries is None or (plan.output_plan is not None and outputs is None) or \
            (plan.return_local_tensor is not None and local is None):
        return None
    return ShardingPlan(entries, output_plan=outputs, return_local_tensor=None if local is None else list(local))
