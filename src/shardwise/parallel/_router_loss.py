"""`global_router_loss`: a MoE model's auxiliary load-balancing loss over the global batch, not each rank's.

Mixtral, Qwen3-MoE, GPT-OSS and most of transformers' MoE models add `router_aux_loss_coef *
num_experts * sum_e f_e * P_e` to their loss when `output_router_logits` is on: `f_e` the
fraction of the routes that go to expert e, `P_e` the mean router probability of e, over the
tokens of the batch. Under data parallelism each rank sees its own tokens, so its `f` and `P`
are its batch's, and the average of the ranks' losses is not the global batch's loss (a
mean of products is not the product of means).

The fractions `f` carry no gradient: summing each rank's route counts and token counts over
the ranks whose tokens differ (one all_reduce per forward) gives the global `f`. The
probabilities do carry the gradient: each rank keeps its own `P_r`, so its loss is
`E * sum_e f_e * P_r,e`, and data parallelism's average of the ranks' gradients is then the
gradient of `E * sum_e f_e * mean_r P_r,e`, the global batch's loss, as is the average of the
values (equal token counts per rank).

transformers computes the loss in a function of the model's module
(`load_balancing_loss_func`), called by the model's forward; `global_router_loss(model, mesh)`
puts the global form in its place for the duration of each forward of `model` (and puts the
model's own back after it, also when the forward raises).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn

from .. import _comm as comm
from .._describe import describe
from .._mesh import DeviceMesh

__all__ = ["global_router_loss"]

_NAME = "load_balancing_loss_func"


def global_router_loss(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Make `model`'s auxiliary load-balancing loss the global batch's: route and token counts
    summed over 1-D `mesh` (the ranks whose tokens differ: mesh["dp"] or the ep mesh), each
    rank's router probabilities its own (see the module docstring). Returns `model`."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"global_router_loss(mesh={describe(mesh)}): the 1-D mesh of the ranks whose tokens differ "
                         f"(mesh['dp'] or the ep mesh)")
    home = sys.modules.get(type(model).__module__)
    own = getattr(home, _NAME, None)
    if not callable(own):
        raise ValueError(f"{type(model).__name__}'s module {type(model).__module__} has no {_NAME}: "
                         f"global_router_loss replaces the auxiliary loss transformers' MoE models compute")
    group, size = mesh.get_group(0), mesh.size()

    def global_form(gate_logits: Any, num_experts: Optional[int] = None, top_k: int = 2,
                    attention_mask: Optional[torch.Tensor] = None) -> Any:
        if not isinstance(gate_logits, tuple) or not gate_logits or num_experts is None:
            return own(gate_logits, num_experts, top_k, attention_mask)
        return _global_loss(gate_logits, num_experts, top_k, attention_mask, group, size)

    def swap_in(module: nn.Module, args: Any) -> None:
        setattr(home, _NAME, global_form)

    def swap_out(module: nn.Module, args: Any, output: Any) -> None:
        setattr(home, _NAME, own)

    model.register_forward_pre_hook(swap_in)
    model.register_forward_hook(swap_out, always_call=True)
    return model


def _global_loss(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                 attention_mask: Optional[torch.Tensor], group: Any, size: int) -> torch.Tensor:
    device = gate_logits[0].device
    routes = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        counted = torch.ones_like(chosen, dtype=torch.float32) if mask is None else mask.repeat_interleave(top_k)
        routes = routes + torch.zeros_like(routes).scatter_add_(0, chosen, counted)
        kept = weights.float() if mask is None else weights.float() * mask.unsqueeze(-1)
        probs = probs + kept.sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    mine = rows.detach().clone()
    counts = torch.cat([routes.detach(), rows.detach().reshape(1)])
    if size > 1:
        record = comm.AllReduce(group=group, size=size, shape=tuple(counts.shape), dtype=counts.dtype, op="sum")
        counts = comm.run(record, counts.contiguous())
    fraction = counts[:-1] / counts[-1]  # the global batch's share of the routes per expert
    return torch.sum(fraction * (probs / mine)) * num_experts
