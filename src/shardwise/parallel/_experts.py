"""`ExpertParallel`: a mixture-of-experts layer's experts split over the mesh.

A Hugging Face MoE block (Mixtral, Qwen-MoE, ...) keeps its experts as one module whose
parameters stack every expert along dim 0 (`gate_up_proj` (experts, 2 * inter, hidden),
`down_proj` (experts, hidden, inter)), called as `experts(hidden_states, top_k_index,
top_k_weights)` with every token and the experts the router chose for it. Under
`ExpertParallel` each rank holds a contiguous range of whole experts (`Shard(0)` of those
parameters, uneven as `torch.chunk`), and runs the module's own forward, with its local
pieces, for every token routed to one of its experts: the other routes are marked with the
"not here" index `local_experts`, with weight 0, that HF's expert kernels skip. Each
rank's output is then its experts' share of every token's sum, and one all-reduce makes it
the whole (the same collective a row-parallel linear ends with). Gradients: each rank's
gradient for the tokens and routing weights covers its experts only, so they are summed over
the mesh on the way back; each expert's parameters get their gradient where they live. The
routing weights' gradient is summed as it leaves the experts: each route is taken on one rank
only, so the sum is exact, and the router's backward then runs on the whole gradient. Left as
a pending sum on DTensors, each rank would run that backward (in float32, as transformers'
routers compute even in a float64 model) on its own term, and the terms would be summed after
float32 rounding: Mixtral in float64 under the Megatron plan ended 9e-10 (2 ranks) and 7.5e-9
(4 ranks) from one process after 5 AdamW steps, 1e-16 once summed here.

The tokens must be the same on every rank (as tensor parallelism keeps activations). A
plain output is returned for a plain input (torch-style plans), a replicated DTensor for a
DTensor input (the planner's plans).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._layout import chunk_range
from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Partial, Placement, Replicate, Shard
from .._tensor import DTensor
from ._distribute import place_parameter
from ._local_params import local_parameters
from ._style import ParallelStyle

__all__ = ["ExpertParallel"]


def expert_parameters(module: nn.Module) -> list[str]:
    """Names of the module's own parameters that stack its `num_experts` experts along dim 0
    (one or more stacks of matrices, and any per-expert biases)."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return []
    stacked = [(name, p) for name, p in module.named_parameters(recurse=False) if p.ndim >= 2 and p.shape[0] == n]
    # at least one stack of matrices (a router's (experts, hidden) weight alone is not experts);
    # per-expert biases (experts, out) go with them
    return [name for name, _ in stacked] if any(p.ndim >= 3 for _, p in stacked) else []


@dataclass(frozen=True, kw_only=True)
class ExpertParallel(ParallelStyle):
    """Split an experts module (`num_experts` experts stacked along dim 0 of its parameters,
    called as `experts(hidden_states, top_k_index, top_k_weights)`) by whole experts.

    >>> ExpertParallel()
    ExpertParallel(src_data_rank=0)
    """

    src_data_rank: Optional[int] = 0

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        names = expert_parameters(module)
        if not names:
            problems.append(f"ExpertParallel shards a module whose parameters stack `num_experts` experts along dim 0 "
                            f"(as HF's MixtralExperts); {type(module).__name__} has no such parameters")
        elif not problems and device_mesh.size() > getattr(module, "num_experts"):
            problems.append(f"ExpertParallel splits whole experts: {getattr(module, 'num_experts')} experts cannot "
                            f"cover {device_mesh.size()} ranks; use a smaller mesh dim for experts")
        return problems

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        return {name: (Shard(0),) for name in expert_parameters(module)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = expert_parameters(module)
        for name in names:
            place_parameter(module, name, (Shard(0),), device_mesh, src_data_rank=self.src_data_rank,
                            where=f"{type(module).__name__}.{name}")
        total: int = getattr(module, "num_experts")
        coordinate = device_mesh.get_coordinate()
        assert coordinate is not None, "ExpertParallel is applied on the ranks of its mesh"
        first, count = chunk_range(total, device_mesh.size(), coordinate[0])
        stop = first + count
        forward = module.forward

        def experts_forward(*args: Any, **kwargs: Any) -> Any:
            hidden_states, top_k_index, top_k_weights = _three_inputs(type(module).__name__, args, kwargs)
            plain = not isinstance(hidden_states, DTensor)
            tokens = _summed_back(hidden_states, device_mesh)
            weights = _summed_back(top_k_weights, device_mesh)  # exact: one term per route
            index = top_k_index.full_tensor() if isinstance(top_k_index, DTensor) else top_k_index
            here = (index >= first) & (index < stop)
            local_index = torch.where(here, index - first, torch.full_like(index, stop - first))
            if isinstance(weights, torch.Tensor):  # routes to other ranks' experts weigh nothing here
                weights = torch.where(here, weights, torch.zeros_like(weights))
            split = getattr(module, "_is_expert_parallel", None)
            try:
                setattr(module, "num_experts", stop - first)
                if split is not None:  # HF's kernels mask the "not here" routes only when told
                    setattr(module, "_is_expert_parallel", True)
                with local_parameters(module, names):  # each rank's whole experts
                    out = forward(tokens, local_index, weights, **kwargs)
            finally:
                setattr(module, "num_experts", total)
                if split is not None:
                    setattr(module, "_is_expert_parallel", split)
            whole = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False).redistribute(
                placements=(Replicate(),))
            return whole.to_local() if plain else whole

        module.forward = experts_forward
        return module


_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


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


def _summed_back(x: Any, mesh: DeviceMesh) -> Any:
    """`x` (the same on every rank) as a plain tensor whose gradient, a share per rank, is
    summed over the mesh on its way back, at once: what runs before `x` (for the routing
    weights, the router's float32 backward) sees the whole gradient, never a pending sum."""
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        x = x.redistribute(placements=(Replicate(),)).to_local()
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
