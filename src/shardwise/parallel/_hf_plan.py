"""`HFPlanner`: a Hugging Face model's own tensor-parallel plan, applied on a shardwise mesh.

transformers models carry a plan (`model.tp_plan`: the class's `_tp_plan`, e.g. the LM head,
plus the config's `base_model_tp_plan` under the base model's prefix) that maps module and
parameter patterns to style names. `from_pretrained(tp_plan="auto")` applies it through
torch's DTensor on torch's mesh; `HFPlanner` reads the same plan and gives the shardwise
styles with the same layouts:

| transformers style | on | shardwise |
|---|---|---|
| colwise | Linear | `ColwiseParallel()` |
| rowwise | Linear | `RowwiseParallel()` |
| colwise_gather_output, colwise_rep | Linear | `ColwiseParallel(output_layouts=Replicate())` |
| rowwise_split_input, rowwise_rep | Linear | `RowwiseParallel(input_layouts=Replicate())` |
| embedding_rowwise | Embedding | `RowwiseParallel()` (vocab split, ids replicated) |
| embedding_colwise | Embedding | `ColwiseParallel(output_layouts=Replicate())` |
| packed_colwise | Linear | `FusedColwiseParallel(parts=2)` (local outputs: each rank's gate and up) |
| colwise, rowwise, packed_colwise, packed_rowwise | a parameter | its layout: S(-2), S(-1) (a bias R), `_StridedShard(-2, 2)`, `_StridedShard(-1, 2)` |
| replicated_with_grad_allreduce | any module | `ReplicateParallel()` |
| sequence_parallel | a norm | `SequenceParallel(use_local_output=True)` |
| all_reduce | any module | `PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())` |
| moe_tp_experts | an experts module | each rank computes its slice of every expert (the parameters' own entries split them), outputs summed |
| replicate | anything | left plain: every rank holds all of it |

MoE models carry a second plan for expert parallelism (`model.ep_plan`, the config's
`base_model_ep_plan`); `HFPlanner(plan="ep")` reads it, for the ep mesh dim:

| transformers style | on | shardwise |
|---|---|---|
| ep_dispatch_experts | an experts module | `ExpertParallel(tokens="split")`: whole experts per rank, routes by all_to_all |
| grouped_gemm | an expert stack | (its module's style splits it by whole experts) |

Llama 4 carries no expert-parallel plan (transformers sees nothing to dispatch in experts called
on every token spread over every expert); `ExpertParallel(tokens="split")` dispatches them all
the same (`_moe_llama4`), and the error for the missing plan names the entry that does it:
`HFPlanner({"model.layers.*.feed_forward.experts": "ep_dispatch_experts"}, plan="ep")`.

Like transformers (and `parallelize_module`), what the plan does not name stays plain: apply
it with `parallelize_module(model, mesh, HFPlanner())`. A pattern that matches nothing in the
model (a plan written for a larger family) is left out, as transformers skips it; a style
name shardwise does not know is a ValueError naming it and the key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Partial, Placement, Replicate, Shard, _StridedShard
from .._tensor import DTensor
from ._experts import ExpertParallel, _summed_back
from ._moe_split import _takes_three_inputs, _three_inputs
from ._local_params import local_parameters
from ._plan import PlanEntry, Sharder, ShardingPlan, ShardingPlanner, match
from ._prepare import PrepareModuleOutput
from ._replicate import ReplicateParallel
from ._style import ColwiseParallel, FusedColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["HFPlanner"]

_MODULE_STYLES: dict[str, Callable[[], Sharder]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": functools.partial(ColwiseParallel, output_layouts=Replicate()),
    "colwise_rep": functools.partial(ColwiseParallel, output_layouts=Replicate()),
    "rowwise_split_input": functools.partial(RowwiseParallel, input_layouts=Replicate()),
    "rowwise_rep": functools.partial(RowwiseParallel, input_layouts=Replicate()),
    "embedding_rowwise": RowwiseParallel,
    "embedding_colwise": functools.partial(ColwiseParallel, output_layouts=Replicate()),
    "packed_colwise": functools.partial(FusedColwiseParallel, parts=2),
    "replicated_with_grad_allreduce": ReplicateParallel,
    "sequence_parallel": functools.partial(SequenceParallel, use_local_output=True),
    "all_reduce": functools.partial(PrepareModuleOutput, output_layouts=Partial(), desired_output_layouts=Replicate()),
}


_OTHER_STYLES = ("moe_tp_experts", "ep_dispatch_experts", "grouped_gemm", "replicate")


def _param_layout(style: str, name: str, ndim: int) -> Optional[tuple[Placement, ...]]:
    """The layout transformers' `style` gives a parameter of `ndim` dims (None: not a parameter style)."""
    if style == "colwise":
        return (Shard(ndim - 2 if ndim >= 2 else -1),)
    if style == "rowwise":
        return (Replicate(),) if name.endswith("bias") or ndim == 1 else (Shard(-1),)
    if style == "packed_colwise":
        return (Shard(-1),) if ndim == 1 else (_StridedShard(ndim - 2, split_factor=2),)
    if style == "packed_rowwise":
        return (Replicate(),) if ndim == 1 else (_StridedShard(ndim - 1, split_factor=2),)
    return None


def hf_tp_plan(model: nn.Module, kind: str = "tp") -> dict[str, str]:
    """The model's whole tensor-parallel (`kind="tp"`) or expert-parallel (`"ep"`) plan, by
    transformers' names (empty if it has none)."""
    plan = getattr(model, f"{kind}_plan", None)  # transformers >= 5: the class's plan and its base model's, prefixed
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    found: dict[str, str] = dict(getattr(type(model), f"_{kind}_plan", None) or {})
    config = getattr(model, "config", None)
    base = getattr(config, f"base_model_{kind}_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    found.update({(f"{prefix}.{k}" if inner else k): v for k, v in base.items()})
    return found


@dataclass(frozen=True)
class HFPlanner(ShardingPlanner):
    """The plan a Hugging Face model carries (`model.tp_plan`), as shardwise styles and layouts.

    `overrides` replace or add entries (transformers' style names or shardwise `Sharder`s /
    layouts), e.g. `HFPlanner({"lm_head": "colwise"})` to keep the logits split for
    `loss_parallel`.

    >>> HFPlanner().build_plan(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    ValueError: Linear carries no tensor-parallel plan (model.tp_plan / config.base_model_tp_plan): HFPlanner reads a Hugging Face model's own plan; give it entries through HFPlanner({...}) or use MegatronPlanner()
    """

    overrides: Optional[Mapping[str, Union[str, Sharder, PlanEntry]]] = None
    plan: str = "tp"

    def __post_init__(self) -> None:
        if self.plan not in ("tp", "ep"):
            raise ValueError(f"HFPlanner(plan={self.plan!r}): \"tp\" (the model's tensor-parallel plan, for the tp mesh) "
                             f"or \"ep\" (its expert-parallel plan, for the ep mesh)")

    def build_plan(self, module: nn.Module) -> ShardingPlan:
        entries: dict[str, Any] = {**hf_tp_plan(module, self.plan), **dict(self.overrides or {})}
        if not entries:
            what = "tensor-parallel" if self.plan == "tp" else "expert-parallel"
            raise ValueError(
                f"{type(module).__name__} carries no {what} plan (model.{self.plan}_plan / "
                f"config.base_model_{self.plan}_plan): HFPlanner reads a Hugging Face model's own plan; give it entries "
                f"through HFPlanner({{...}}) or use MegatronPlanner(){_experts_hint(module, self.plan)}"
            )
        modules = [name for name, _ in module.named_modules()]
        params = dict(module.named_parameters(remove_duplicate=False))
        plan: dict[str, Any] = {}
        problems: list[str] = []
        for key, style in entries.items():
            if not isinstance(style, str):
                plan[key] = style
                continue
            param_hits = [n for n in params if match(key, n)]
            module_hits = [n for n in modules if match(key, n)]
            if style in ("replicate", "grouped_gemm") or not (param_hits or module_hits):
                continue  # every rank keeps all of it / its experts module splits it / not in this model
            if param_hits:
                layouts = {_param_layout(style, n, params[n].ndim) for n in param_hits}
                if None in layouts or len(layouts) != 1:
                    problems.append(f"{key!r}: {style!r} on a parameter: shardwise gives parameters colwise, rowwise, "
                                    f"packed_colwise and packed_rowwise")
                else:
                    plan[key] = layouts.pop()
            elif style == "moe_tp_experts":
                plan[key] = _ExpertSlices()
            elif style == "ep_dispatch_experts":
                plan[key] = ExpertParallel(tokens="split")
            elif style in _MODULE_STYLES:
                plan[key] = _MODULE_STYLES[style]()
            else:
                problems.append(f"{key!r}: transformers' style {style!r} has no shardwise counterpart (known: "
                                f"{', '.join(sorted([*_MODULE_STYLES, *_OTHER_STYLES]))})")
        if problems:
            raise ValueError(f"HFPlanner cannot apply {type(module).__name__}'s tensor-parallel plan:\n"
                             + "\n".join(f"  - {p}" for p in problems))
        return ShardingPlan(plan)


def _experts_hint(model: nn.Module, plan: str) -> str:
    """For an expert-parallel plan a model lacks (Llama 4's: transformers sees nothing to dispatch in
    experts called on every token spread over every expert), the entries that dispatch the experts
    its tensor-parallel plan names."""
    if plan != "ep":
        return ""
    modules = [name for name, _ in model.named_modules()]
    keys = [k for k, v in hf_tp_plan(model, "tp").items() if v == "moe_tp_experts" and any(match(k, n) for n in modules)]
    if not keys:
        return ""
    return f"; its experts dispatch with HFPlanner({{{keys[0]!r}: 'ep_dispatch_experts'}}, plan='ep')"


def _summed(out: torch.Tensor, mesh: DeviceMesh, given: Any) -> Any:
    """Every rank's term `out` summed over `mesh`: a replicated DTensor if the tokens were `given`
    as one, else its local tensor."""
    whole = DTensor.from_local(out, mesh, (Partial(),), run_check=False).redistribute(placements=(Replicate(),))
    return whole if isinstance(given, DTensor) else whole.to_local()


@dataclass(frozen=True, kw_only=True)
class _ExpertSlices(ParallelStyle):
    """transformers' "moe_tp_experts": an experts module whose parameters the plan splits inside
    every expert (gate|up by columns part by part, down by rows) runs its own forward on every
    token with its local slices; each rank's output is a term of every token's sum, and the
    gradients of the tokens and routing weights a term of theirs, summed over the mesh."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = [n for n, p in module._parameters.items() if isinstance(p, DTensor)]
        forward = module.forward
        routed = _takes_three_inputs(module)

        def sliced_forward(*args: Any, **kwargs: Any) -> Any:
            if not routed:  # Llama 4's: every token once per expert, already weighted by the router
                given = args[0] if args else kwargs.pop("hidden_states")
                with local_parameters(module, names):
                    out = forward(_summed_back(given, device_mesh), *args[1:], **kwargs)
                return _summed(out, device_mesh, given)
            hidden_states, top_k_index, top_k_weights = _three_inputs(type(module).__name__, args, kwargs)
            tokens = _summed_back(hidden_states, device_mesh)
            if isinstance(top_k_weights, torch.Tensor) and isinstance(hidden_states, torch.Tensor):
                # each rank's term of the routing weights' gradient is a partial dot product: kept in the
                # tokens' dtype until summed, it is rounded to the router's float32 once, as in one process
                # (the experts' product promotes the weights anyway: the forward is unchanged)
                top_k_weights = top_k_weights.to(torch.promote_types(top_k_weights.dtype, hidden_states.dtype))
            weights = _summed_back(top_k_weights, device_mesh)
            index = top_k_index.full_tensor() if isinstance(top_k_index, DTensor) else top_k_index
            with local_parameters(module, names):
                return _summed(forward(tokens, index, weights, **kwargs), device_mesh, hidden_states)

        module.forward = sliced_forward
        return module

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        if not any(p.ndim >= 3 for p in module.parameters(recurse=False)):
            problems.append(f"moe_tp_experts applies to an experts module (3-D stacked expert weights); "
                            f"{type(module).__name__} has none")
        return problems

