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

A plan that lays those parameters out itself, `Shard(0)` along one mesh dim
(`{"model.layers.*.mlp.experts.gate_up_proj": (Shard(0),), ...}`), asks for the same split,
and `shard_module` runs such a module the same way (`experts_split_by_layout`). Op by op,
transformers' eager loop would take `gate_up_proj[e]` from a stack split along that very
dim, gathering every expert it visits (Mixtral, 2 layers of 4 experts: 107 collectives a
step on 2 ranks, 131 on 4, against 16 and 40 here), and would hand the tokens back a
gradient split over the hidden dim, whose float32 RMSNorm backward then summed its rows
rank by rank (3e-8 relative, 2e-8 off one process after 4 AdamW steps in float64).
"""

from __future__ import annotations

import inspect
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
        for name in expert_parameters(module):
            place_parameter(module, name, (Shard(0),), device_mesh, src_data_rank=self.src_data_rank,
                            where=f"{type(module).__name__}.{name}")
        run_own_experts(module, device_mesh, 0)
        return module


def run_own_experts(module: nn.Module, mesh: DeviceMesh, mesh_dim: int) -> None:
    """Make `module` (an experts module whose stacked parameters are already split by whole
    experts along `mesh_dim`, `Shard(0)` there and replicated on any other mesh dim) run each
    rank's own experts on the routes they take, with one all-reduce over `mesh_dim` after."""
    names = expert_parameters(module)
    total: int = getattr(module, "num_experts")
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "experts are split over the mesh of the ranks that run them"
    first, count = chunk_range(total, mesh.size(mesh_dim), coordinate[mesh_dim])
    stop = first + count
    summed = tuple(Partial() if m == mesh_dim else Replicate() for m in range(mesh.ndim))
    forward = module.forward

    def experts_forward(*args: Any, **kwargs: Any) -> Any:
        hidden_states, top_k_index, top_k_weights = _three_inputs(type(module).__name__, args, kwargs)
        plain = not isinstance(hidden_states, DTensor)
        tokens = _summed_back(hidden_states, mesh, mesh_dim)
        weights = _summed_back(top_k_weights, mesh, mesh_dim)  # exact: one term per route
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
        whole = DTensor.from_local(out, mesh, summed, run_check=False).redistribute(
            placements=(Replicate(),) * mesh.ndim)
        return whole.to_local() if plain else whole

    module.forward = experts_forward


def experts_split_by_layout(model: nn.Module, layouts: Mapping[str, tuple[Placement, ...]]
                            ) -> list[tuple[str, int]]:
    """(path, mesh dim) of each experts module of `model` whose stacked parameters `layouts`
    (parameter name -> placements, as a resolved plan gives them) all split by whole experts
    along one mesh dim (`Shard(0)` there, `Replicate()` on the others), and whose forward takes
    the routed tokens `(hidden_states, top_k_index, top_k_weights)`: such a module runs as
    under `ExpertParallel` (`run_own_experts`). Run op by op instead, transformers' loop over
    experts would select each expert's slice of a stack split over that very dim, one gather
    per expert per pass, and leave the tokens' gradient split over the hidden dim, where a
    float32 norm's backward would sum it rank by rank."""
    found = []
    for path, module in model.named_modules():
        names = expert_parameters(module)
        given = {layouts.get(f"{path}.{n}" if path else n) for n in names}
        if not names or len(given) != 1 or not _takes_routed_tokens(module):
            continue
        placements = given.pop()
        split = [m for m, p in enumerate(placements or ()) if type(p) is Shard and p.dim == 0]
        if placements and len(split) == 1 and all(p == Replicate() for m, p in enumerate(placements) if m != split[0]):
            found.append((path, split[0]))
    return found


def _takes_routed_tokens(module: nn.Module) -> bool:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(names[:3]) == _INPUTS


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


def _summed_back(x: Any, mesh: DeviceMesh, mesh_dim: int = 0) -> Any:
    """`x` (the same on every rank) as a plain tensor whose gradient, a share per rank of
    `mesh_dim`, is summed over that mesh dim on its way back, at once: what runs before `x`
    (for the routing weights, the router's float32 backward; for the tokens, a float32 norm's)
    sees the whole gradient, never a pending sum nor one split over the hidden dim."""
    if not isinstance(x, torch.Tensor):
        return x
    whole = (Replicate(),) * mesh.ndim
    if isinstance(x, DTensor):
        x = x.redistribute(placements=whole).to_local()
    summed = tuple(Partial() if m == mesh_dim else Replicate() for m in range(mesh.ndim))
    return DTensor.from_local(x, mesh, whole, run_check=False).to_local(grad_placements=summed)
