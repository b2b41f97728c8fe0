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
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from .. import _comm as comm
from .._layout import chunk_range
from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Partial, Placement, Replicate, Shard
from .._tensor import DTensor
from ._distribute import place_parameter
from .._tensor import FINGERPRINT_WIDTH, fingerprint, register, same_fingerprint
from ._cp_comm import CpGroup
from ._local_params import local_parameters
from ._moe_llama4 import dispatch_spread_experts, spread_problems, takes_spread_rows
from ._moe_split import _INPUTS, _takes_three_inputs, _three_inputs, dispatch_own_experts, route_counts
from ._replicate import _Registered
from ._style import ParallelStyle

__all__ = ["ExpertParallel", "route_counts"]  # (route_counts: `_moe_split`)


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

    `tokens` says where the tokens are:
    - `"replicated"` (default): every rank of the mesh holds the same tokens (tensor
      parallelism); each runs its experts on the routes that reach them and one all-reduce
      sums the results.
    - `"split"`: each rank holds its own tokens (the mesh's ranks are data-parallel ranks, as
      ep borrowing dp or dp x cp); each route goes to its expert's owner by one all_to_all and
      its result comes back by another (`_moe_dispatch`). Dropless, unless `capacity_factor`
      is given: then every expert takes `ceil(capacity_factor * tokens * top_k / num_experts)`
      routes from each rank and drops the rest (counted in `route_counts(module)`). Every ep
      rank must then hold the same number of tokens: checked (one small all_gather) the first
      time each count is met; a rank meeting a new count alone while the others do not is a
      collective mismatch, which ends in a `CollectiveError` (at worst the collective timeout).
      Llama 4's experts, called on every token spread over every expert and scaled by its
      score (`experts(rows)`), send only the rows the router chose (`_moe_llama4`; dropless).
    - `"sequence"`: each rank holds its own piece of every sequence (context parallelism):
      dispatched as `"split"`, but the ranks' gradients are shares of one loss, summed, not
      averaged (an expert's gradient is not scaled).
    - one of those per mesh dim, e.g. `("split", "replicated")` on a (dp, tp) mesh: ep spans
      every rank of the mesh; the tp ranks, which hold the same tokens, each dispatch their
      share of the rows and gather the results after.

    >>> ExpertParallel()
    ExpertParallel(src_data_rank=0, tokens='replicated', capacity_factor=None)
    """

    src_data_rank: Optional[int] = 0
    tokens: Union[str, tuple[str, ...]] = "replicated"
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        given = (self.tokens,) if isinstance(self.tokens, str) else self.tokens
        if not isinstance(given, tuple) or not given or any(t not in _TOKENS for t in given):
            raise ValueError(f"ExpertParallel(tokens={self.tokens!r}): one of {_TOKENS}, or one per mesh dim (\"split\" "
                             f"where each rank holds its own tokens, \"replicated\" where ranks hold the same ones)")
        factor = self.capacity_factor
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise ValueError(f"ExpertParallel(capacity_factor={factor!r}): a number > 0 (1.0: an even share of "
                                 f"the routes per expert), or None for dropless dispatch")
            if not self.dispatches:
                raise ValueError(f"ExpertParallel(capacity_factor={factor!r}) pads the token dispatch: it needs "
                                 f"tokens=\"split\" (replicated tokens are never dispatched)")

    @property
    def dispatches(self) -> bool:
        """Whether tokens differ somewhere on the mesh, so routes travel by all_to_all."""
        given = (self.tokens,) if isinstance(self.tokens, str) else self.tokens
        return "split" in given or "sequence" in given

    @property
    def spans_mesh_dims(self) -> bool:
        """Whether it says its tokens per mesh dim (then `parallelize_module` takes an n-D mesh)."""
        return self.dispatches and not isinstance(self.tokens, str)

    def _token_dims(self, ndim: int) -> tuple[str, ...]:
        return (self.tokens,) * ndim if isinstance(self.tokens, str) else self.tokens

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        names = expert_parameters(module)
        if not names:
            problems.append(f"ExpertParallel shards a module whose parameters stack `num_experts` experts along dim 0 "
                            f"(as HF's MixtralExperts); {type(module).__name__} has no such parameters")
        elif not problems and device_mesh.size() > getattr(module, "num_experts"):
            problems.append(f"ExpertParallel splits whole experts: {getattr(module, 'num_experts')} experts cannot "
                            f"cover {device_mesh.size()} ranks; use a smaller mesh dim for experts")
        if not problems and takes_spread_rows(module):  # Llama 4's experts(rows)
            problems += spread_problems(module, self.capacity_factor) if self.dispatches else [
                f"ExpertParallel(tokens=\"replicated\") on {type(module).__name__}: its experts take rows spread over "
                f"every expert (Llama 4), which only token dispatch runs: ExpertParallel(tokens=\"split\") over "
                f"data-parallel ranks, or (\"split\", \"replicated\") on a (dp, tp) mesh"]
        elif not problems and self.dispatches and not _takes_three_inputs(module):
            problems.append(f"ExpertParallel(tokens={self.tokens!r}) dispatches the routes an experts module is called "
                            f"with, experts(hidden_states, top_k_index, top_k_weights) (Mixtral, Qwen3-MoE, "
                            f"DeepSeek-V3, GPT-OSS), or rows spread over every expert (Llama 4); "
                            f"{type(module).__name__}.forward takes other inputs")
        if not problems and self.dispatches:
            dims = self._token_dims(device_mesh.ndim)
            if len(dims) != device_mesh.ndim:
                problems.append(f"ExpertParallel(tokens={self.tokens!r}) names {len(dims)} mesh dims; the mesh "
                                f"{device_mesh.shape} has {device_mesh.ndim}: say \"split\" or \"replicated\" per dim")
            elif dims.count("replicated") > 1:
                problems.append(f"ExpertParallel(tokens={self.tokens!r}): at most one mesh dim of replicated tokens "
                                f"(tensor parallelism's); flatten the others into it")
            elif device_mesh.ndim > 1 and device_mesh.mesh_dim_names is None:
                problems.append(f"ExpertParallel(tokens={self.tokens!r}) on a {device_mesh.ndim}-D mesh needs its dims "
                                f"named (mesh_dim_names=): ep spans them flattened")
        return problems

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        return {name: (Shard(0),) * (device_mesh.ndim if self.dispatches else 1) for name in expert_parameters(module)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.dispatches:
            for name in expert_parameters(module):
                place_parameter(module, name, (Shard(0),), device_mesh, src_data_rank=self.src_data_rank,
                                where=f"{type(module).__name__}.{name}")
            run_own_experts(module, device_mesh, 0)
            return module
        dims = self._token_dims(device_mesh.ndim)
        names = device_mesh.mesh_dim_names or ("ep",)
        ep_mesh = device_mesh if device_mesh.ndim == 1 else device_mesh._flatten("_".join(names))
        for name in expert_parameters(module):  # whole experts over every rank of the mesh, row-major
            place_parameter(module, name, (Shard(0),), ep_mesh, src_data_rank=self.src_data_rank,
                            where=f"{type(module).__name__}.{name}")
        rows = None
        if "replicated" in dims:  # those ranks hold the same tokens: each dispatches its share of the rows
            d = dims.index("replicated")
            rows = CpGroup(device_mesh.get_group(d), device_mesh.size(d), device_mesh.get_local_rank(d),
                           device_mesh.ranks_along(d), d)
        differ = math.prod(s for s, t in zip(device_mesh.shape, dims) if t == "split")  # data-parallel replicas
        if takes_spread_rows(module):
            dispatch_spread_experts(module, ep_mesh, rows, 1.0 / differ)
        else:
            dispatch_own_experts(module, expert_parameters(module), ep_mesh, self.capacity_factor, rows, 1.0 / differ)
        placed = [(f"{type(module).__name__}.{n}", module, n) for n in expert_parameters(module)]
        how = f"avg (1/{differ} on the way back)" if "split" in dims else "sum (shares of one loss)"
        registered = _Registered(ep_mesh, placed, "ExpertParallel",
                                 f"{how}: each expert's routes arrive from every ep rank")
        register(registered)
        object.__setattr__(module, "_shardwise_reducer", registered)  # (the registry holds it weakly)
        return module


_TOKENS = ("replicated", "split", "sequence")


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
    checked: list[bool] = []  # the first call's tokens were found alike on every rank

    def experts_forward(*args: Any, **kwargs: Any) -> Any:
        hidden_states, top_k_index, top_k_weights = _three_inputs(type(module).__name__, args, kwargs)
        plain = not isinstance(hidden_states, DTensor)
        if plain and not checked:
            _check_replicated(type(module).__name__, hidden_states, top_k_index, mesh, mesh_dim)
            checked.append(True)
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


def _check_replicated(owner: str, x: Any, index: Any, mesh: DeviceMesh, mesh_dim: int) -> None:
    """ValueError on every rank when the plain tokens given to the replicated form differ across
    `mesh_dim` (each rank holding its own batch): fingerprints of the first call, gathered once."""
    if not isinstance(x, torch.Tensor) or x.is_meta or mesh.size(mesh_dim) == 1:
        return
    mine = fingerprint(x) + (fingerprint(index) if isinstance(index, torch.Tensor) else [])
    rows = comm.all_gather_ints(mine, mesh.get_group(mesh_dim), mesh.size(mesh_dim))
    w = FINGERPRINT_WIDTH
    if any(not all(same_fingerprint(row[k:k + w], rows[0][k:k + w]) for k in range(0, len(mine), w)) for row in rows):
        counts = [row[1] for row in rows]  # (a fingerprint starts with the number of dims, then the shape)
        raise ValueError(
            f"ExpertParallel(tokens=\"replicated\") on {owner}: the ranks {list(mesh.ranks_along(mesh_dim))} hold "
            f"different tokens ({counts} of them); this form needs the same tokens on every rank (tensor "
            f"parallelism). Where each rank holds its own batch, use ExpertParallel(tokens=\"split\") on the ep mesh")


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
