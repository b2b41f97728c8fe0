"""The split form's wiring: an experts module whose tokens differ across ranks, made to dispatch its routes.

`ExpertParallel(tokens="split")` (and per-dim forms) places whole experts over the ep ranks
and then calls `dispatch_own_experts`: the module's forward is replaced by one that checks
the router's output, takes this rank's share of the rows where ranks hold the same tokens,
and runs the dispatch of `_moe_dispatch` around the module's own expert arithmetic, on the
local experts, with their gradients scaled on the way back (the capacity form's equal rows per
expert at fixed shapes, `_moe_batched`, so a traced step replays). `route_counts(module)` reads
what the last forward routed. The inputs both forms read, `(hidden_states, top_k_index,
top_k_weights)`, are parsed here too.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from .. import _comm as comm
from .._mesh import DeviceMesh
from .._tensor import DTensor
from ._cp_comm import CpGroup
from ._local_params import local_parameters
from ._moe_batched import batched_experts, runs_batched
from ._moe_dispatch import (EpRanks, RouteCounts, capacity_of, dispatch_capacity, dispatch_dropless, gather_rows,
                            take_rows)

__all__ = ["dispatch_own_experts", "route_counts"]


_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def _takes_three_inputs(module: nn.Module) -> bool:
    """Whether the module's forward takes (at least) three inputs: tokens, expert ids, weights."""
    try:
        kinds = [p.kind for p in inspect.signature(module.forward).parameters.values()]
    except (TypeError, ValueError):
        return True  # (cannot tell: the call will say)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Parameter.VAR_POSITIONAL in kinds or sum(k in positional for k in kinds) >= 3


def _three_inputs(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(hidden_states, top_k_index, top_k_weights), given by position or by name (taken out of kwargs)."""
    values = list(args[:3])
    for name in _INPUTS[len(values):]:
        if name not in kwargs:
            raise TypeError(f"ExpertParallel on {owner} expects experts(hidden_states, top_k_index, top_k_weights) "
                            f"(by position or name); {name!r} is missing")
        values.append(kwargs.pop(name))
    if len(args) > 3:
        raise TypeError(f"ExpertParallel on {owner} expects 3 inputs, got {len(args)} positional")
    return values[0], values[1], values[2]


def route_counts(module: nn.Module) -> RouteCounts:
    """What the last forward of an experts module under `ExpertParallel(tokens="split")` routed on
    this rank: routes sent, routes dropped (capacity form), routes kept per expert."""
    found = getattr(module, "_shardwise_route_counts", None)
    if not isinstance(found, RouteCounts):
        raise ValueError(f"{type(module).__name__} does not dispatch tokens: apply ExpertParallel(tokens=\"split\") "
                         f"to it first")
    return found


def dispatch_own_experts(module: nn.Module, names: list[str], mesh: DeviceMesh, capacity_factor: Optional[float],
                         rows: Optional[CpGroup], grad_scale: float) -> None:
    """Make `module` (its stacked parameters split by whole experts over 1-D `mesh`) take the
    routes of this rank's tokens (its share of the rows the ranks of `rows` hold alike), send
    each to its expert's owner and bring the results home; the experts' gradients are scaled by
    `grad_scale` (1 over the ranks whose tokens differ)."""
    total: int = getattr(module, "num_experts")
    owner = type(module).__name__
    ep = EpRanks.of(CpGroup(mesh.get_group(0), mesh.size(), mesh.get_local_rank(0), mesh.ranks_along(0), 0), total)
    device = next((getattr(module, n).device for n in names), torch.device("cpu"))
    stats = RouteCounts.ready(total, device)
    object.__setattr__(module, "_shardwise_route_counts", stats)
    agreed: set[int] = set()  # token counts every ep rank was found to hold
    forward = module.forward
    batched = capacity_factor is not None and runs_batched(module)  # equal rows per expert: one bmm each

    def run(routes: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        try:  # the module's own arithmetic, on its own experts, one route per row at weight 1
            setattr(module, "num_experts", ep.mine)
            with local_parameters(module, names, grad_scale=grad_scale):
                if batched:
                    by_expert = routes.view(ep.mine, -1, routes.shape[-1])  # (mine, ep * capacity, hidden)
                    return batched_experts(module, by_expert).reshape(routes.shape[0], -1)
                out: torch.Tensor = forward(routes, experts.unsqueeze(-1), routes.new_ones((routes.shape[0], 1)))
                if routes.shape[0] == 0:
                    # no route reached this rank: its experts' gradients are zeros, and backward
                    # still reaches the dispatch, whose transposed all_to_all every rank joins
                    out = out + (routes.sum() + sum(getattr(module, n).sum() for n in names)) * 0
        finally:
            setattr(module, "num_experts", total)
        return out

    def experts_forward(*args: Any, **kwargs: Any) -> Any:
        hidden_states, top_k_index, top_k_weights = _three_inputs(owner, args, kwargs)
        for name, value in zip(_INPUTS, (hidden_states, top_k_index, top_k_weights)):
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                raise TypeError(f"ExpertParallel(tokens=\"split\") on {owner}: {name} must be this rank's own plain "
                                f"tensor, got {type(value).__name__}; for tokens the same on every rank (tensor "
                                f"parallelism) use ExpertParallel(tokens=\"replicated\")")
        _check_routes(owner, hidden_states, top_k_index, top_k_weights, total)
        if rows is None:
            return routed(hidden_states, top_k_index, top_k_weights)
        mine = routed(take_rows(hidden_states, rows), take_rows(top_k_index, rows), take_rows(top_k_weights, rows))
        return gather_rows(mine, hidden_states.shape[0], rows)

    def routed(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if capacity_factor is None:
            return dispatch_dropless(run, hidden_states, top_k_index, top_k_weights, ep, stats)
        tokens = top_k_index.shape[0]
        if tokens not in agreed:  # once per token count: every rank must pad to the same capacity
            counts = [row[0] for row in comm.all_gather_ints([tokens], ep.group.group, ep.group.size)]
            if len(set(counts)) != 1:
                raise ValueError(f"ExpertParallel(tokens=\"split\", capacity_factor={capacity_factor}) on {owner}: the "
                                 f"ep ranks {list(ep.group.ranks)} hold {counts} tokens; a capacity needs the same "
                                 f"number on every rank (equal local batches), else use dropless dispatch "
                                 f"(capacity_factor=None)")
            agreed.add(tokens)
        capacity = capacity_of(capacity_factor, tokens, top_k_index.shape[-1], total)
        return dispatch_capacity(run, hidden_states, top_k_index, top_k_weights, ep, capacity, stats)

    module.forward = experts_forward


def _check_routes(owner: str, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, total: int) -> None:
    if x.ndim != 2 or index.ndim != 2 or tuple(weights.shape) != tuple(index.shape) or index.shape[0] != x.shape[0]:
        raise ValueError(f"ExpertParallel(tokens=\"split\") on {owner} reads hidden_states (tokens, hidden), "
                         f"top_k_index and top_k_weights (tokens, top_k); got {tuple(x.shape)}, {tuple(index.shape)}, "
                         f"{tuple(weights.shape)}: give it the router's output as the model computes it")
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ExpertParallel(tokens=\"split\") on {owner}: top_k_index must hold expert ids (int64), "
                         f"got {index.dtype}")
    if index.shape[-1] > total:
        raise ValueError(f"ExpertParallel on {owner}: top_k={index.shape[-1]} is above the {total} experts: a route "
                         f"per expert at most; lower num_experts_per_tok")
