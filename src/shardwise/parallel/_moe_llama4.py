"""Token dispatch for experts called on rows already spread over every expert (Llama 4's convention).

Llama 4's MoE block (`Llama4TextMoe`) does not hand its experts the routing. It repeats every
token once per expert, scales each copy by the router's score for that expert (the sigmoid of
the top-k logits; exactly 0 for an expert not chosen, sigmoid(-inf)), and calls
`experts(rows)` on those (num_experts * tokens, hidden) rows, expert-major (row `e * tokens +
t` is token `t` for expert `e`); it then sums the (num_experts, tokens, hidden) result over the
experts. The weight multiplies an expert's input, not its output, so each route carries its
own row.

Its experts are gated, without bias: `(up * act(gate)) @ down` with `gate | up = row @
gate_up`. For a zero row `up` is 0, so the output is exactly 0 and the parameters' gradients
(`row^T g` and `(up * act(gate))^T g`) are exactly 0; with `act(0) = 0` (SiLU) the row's own
gradient is exactly 0 too. The rows the router did not choose are zero rows, so leaving them
out changes nothing, in value or gradient, down to the bit; the rows dispatched are the non-zero
ones (a chosen route whose row is zero, a zero token or an underflowed score, is one of those
exact zeros). Finding them reads a mask on the host, and splitting the arrivals by expert (below)
reads their counts: two synchronisations per layer beside the dispatch's own.

Each chosen row travels as a token of its own, with one expert and weight 1, through
`dispatch_dropless` (`home * 1` and a sum of one term are exact), and comes back to its place
among zero rows. The module's own forward views its rows as (experts, rows per expert, hidden)
for one batched product, so it needs the same number of rows per expert; the routes reaching a
rank are uneven, so it runs once per local expert, on that expert's rows, with a one-expert
slice of the parameters: the module's own arithmetic on real rows only. (Padding to equal
counts would be exact too, by the zero-row argument, but computes the padding.) The capacity
form is refused: its capacity counts routes per token (`top_k`), which these experts are not
given.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from .._mesh import DeviceMesh
from .._tensor import DTensor
from ._cp_comm import CpGroup
from ._local_params import local_parameters
from ._moe_dispatch import EpRanks, RouteCounts, dispatch_dropless, gather_rows, take_rows

__all__ = ["dispatch_spread_experts", "spread_problems", "takes_spread_rows"]

_STACKS = ("gate_up_proj", "down_proj")


def takes_spread_rows(module: nn.Module) -> bool:
    """Whether the experts module is called as Llama 4's: `experts(hidden_states)`, one input of
    every token repeated for every expert (its forward takes a single positional input)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    kinds = [p.kind for p in params]
    return inspect.Parameter.VAR_POSITIONAL not in kinds and sum(k in positional for k in kinds) == 1


def spread_problems(module: nn.Module, capacity_factor: Optional[float]) -> list[str]:
    """Why token dispatch cannot run `module` (called on spread rows) exactly: empty if it can."""
    owner = type(module).__name__
    problems = []
    stacks = {n: p for n, p in module.named_parameters(recurse=False)}
    if sorted(stacks) != sorted(_STACKS) or any(p.ndim != 3 for p in stacks.values()):
        problems.append(f"ExpertParallel(tokens=\"split\") on {owner}, whose experts take every token spread over every "
                        f"expert: it sends only the non-zero rows, exact for gated experts without bias "
                        f"({' and '.join(_STACKS)}, 3-D, as Llama 4's); {owner} has {sorted(stacks)}: call its "
                        f"experts with the routing, experts(hidden_states, top_k_index, top_k_weights), or keep it plain")
    act = getattr(module, "act_fn", None)
    if not callable(act) or bool(act(torch.zeros(1, dtype=torch.float64)).ne(0).any()):
        problems.append(f"ExpertParallel(tokens=\"split\") on {owner}: the rows left out must have zero gradient, which "
                        f"needs act_fn(0) == 0 (SiLU, GELU, ReLU); {owner}.act_fn is {type(act).__name__}")
    if capacity_factor is not None:
        problems.append(f"ExpertParallel(tokens=\"split\", capacity_factor={capacity_factor}) on {owner}: a capacity "
                        f"counts each token's top_k routes, and {owner} is given rows spread over every expert, not "
                        f"the routing; use dropless dispatch (capacity_factor=None)")
    return problems


@contextlib.contextmanager
def _one_expert(module: nn.Module, j: int) -> Iterator[None]:
    """Inside the block, the module's (local) stacks read only expert `j`'s slice (one expert)."""
    held: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for name in _STACKS:
            slots: dict[str, Any] = module.__dict__ if name in module.__dict__ else module._parameters
            held.append((slots, name, slots[name]))
            slots[name] = slots[name][j:j + 1]
        yield
    finally:
        for slots, name, value in reversed(held):
            slots[name] = value


def dispatch_spread_experts(module: nn.Module, mesh: DeviceMesh, rows: Optional[CpGroup], grad_scale: float) -> None:
    """Make `module` (Llama 4's experts, its stacks split by whole experts over 1-D `mesh`) send
    the non-zero rows of its (num_experts * tokens, hidden) input to their experts' owners and
    bring the results back to their rows; where the ranks of `rows` hold the same tokens each
    sends its share of those rows. The experts' gradients are scaled by `grad_scale`."""
    total: int = getattr(module, "num_experts")
    owner = type(module).__name__
    ep = EpRanks.of(CpGroup(mesh.get_group(0), mesh.size(), mesh.get_local_rank(0), mesh.ranks_along(0), 0), total)
    stats = RouteCounts()
    object.__setattr__(module, "_shardwise_route_counts", stats)
    forward = module.forward

    def run(routes: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(experts, minlength=ep.mine).tolist()  # routes are sorted by local expert
        pieces, start = [], 0
        with local_parameters(module, list(_STACKS), grad_scale=grad_scale):
            for j, count in enumerate(counts):
                if count:
                    with _one_expert(module, j):
                        pieces.append(forward(routes[start:start + count]))  # (count, hidden)
                start += count
            if not pieces:  # no route here: zero gradients, and backward still joins the dispatch
                held = (getattr(module, n).sum() for n in _STACKS)
                return routes * 0 + sum(held, routes.sum()) * 0
        return torch.cat(pieces)

    def experts_forward(*args: Any, **kwargs: Any) -> Any:
        x = _one_input(owner, args, kwargs)
        if x.ndim != 2 or x.shape[0] % total:
            raise ValueError(f"ExpertParallel(tokens=\"split\") on {owner} reads rows spread over its {total} experts, "
                             f"(num_experts * tokens, hidden); got {tuple(x.shape)}: call it as Llama4TextMoe does")
        tokens = x.shape[0] // total
        chosen = x.ne(0).any(-1).nonzero().squeeze(-1)  # (routes,): the rows the router chose; host read
        expert = torch.div(chosen, tokens, rounding_mode="floor").unsqueeze(-1)  # (routes, 1)
        routes = x[chosen]  # (routes, hidden), each a route of its own at weight 1
        if rows is None:
            out = dispatch_dropless(run, routes, expert, routes.new_ones(expert.shape), ep, stats)
        else:
            mine = take_rows(routes, rows)
            part = dispatch_dropless(run, mine, take_rows(expert, rows), mine.new_ones((mine.shape[0], 1)), ep, stats)
            out = gather_rows(part, routes.shape[0], rows)
        return x.new_zeros(x.shape).index_copy(0, chosen, out)  # the others: the zeros their experts give

    module.forward = experts_forward


def _one_input(owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The experts' one input (by position or as `hidden_states`), this rank's own plain tensor."""
    if len(args) + len(kwargs) != 1 or (kwargs and "hidden_states" not in kwargs):
        raise TypeError(f"ExpertParallel on {owner} expects experts(hidden_states), got {len(args)} positional and "
                        f"{sorted(kwargs)} by name")
    x = args[0] if args else kwargs["hidden_states"]
    if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
        raise TypeError(f"ExpertParallel(tokens=\"split\") on {owner}: hidden_states must be this rank's own plain "
                        f"tensor, got {type(x).__name__}")
    return x
