"""The pipeline role of `AutoPlanner`: a mesh dim whose ranks hold consecutive stages of an `nn.Sequential`.

A pp candidate is ("pp",) on a 1-D mesh, and on a 2-D mesh the pp role on either dim with data
parallel ("dp") or ZeRO-3 ("zero") on the other: each pipeline takes that dim's share of the
batch, as `DistributedPipe(dp_dim=, shard_parameters=)` runs it. (pp beside tensor parallel,
`DistributedPipe(tp_plan=)`, is not planned: build that pipe by hand.)

A pipeline's step is not one rank's dry run: it depends on the stage boundaries, the number of
micro-batches and the schedule, and on what every stage does when. So a pp candidate is
`plan_pipeline`'s model of the step, on the pipeline's share of the batch, turned into the
same `StepCost` the other candidates have:

| StepCost | of the pp candidate |
|---|---|
| compute seconds | the modelled pipeline step, bubble included |
| comm seconds | the data dim's gradient reduction, and the messages from the neighbouring stages |
| peak bytes | the rank's stages' parameters, gradients, optimizer state and activations in flight |

- each message between stages costs the cost model's `latency` (as a collective does) in the
  pipeline's step, and its bytes (the activations forward, their gradients backward) at the
  point-to-point bandwidth (`p2p_bandwidth`, else the pp dim's) in its communication;
- the gradient reduction over "dp" is one all_reduce per stage; over "zero", per micro-batch,
  two all_gathers of the stage's parameters (forward and backward) and a reduce_scatter;
- the parameters count 2 + the optimizer's state per element (`param_scale`), divided over the
  data dim under "zero", which also holds the largest layer gathered whole.

The rank measured is the one whose stages hold the most parameters (the largest reduction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from torch import nn

from .._describe import describe
from ..pipeline import DistributedPipe
from ._cost import CostModel, StepCost
from ._pipeline import PipelinePlan, _profile, _rank_bytes, _stage_rank, plan_pipeline
from ._solve import MemoryBudgetError

__all__ = ["build_pipe", "check_pipeline", "measure_pipeline", "pipeline_roles"]

Roles = tuple[str, ...]
BESIDE = ("dp", "zero")  # the roles a pp dim may have beside it
PLANNED_ARGUMENTS = ("balance", "mesh", "pp_dim", "dp_dim", "shard_parameters", "schedule", "chunks")


def pipeline_roles(module: nn.Module, shape: tuple[int, ...]) -> list[Roles]:
    """The pp candidates for `module` on a mesh of `shape`: none unless it is an `nn.Sequential`
    with a layer for each stage (one per pp rank)."""
    if not isinstance(module, nn.Sequential):
        return []
    if len(shape) == 1:
        return [("pp",)] if len(module) >= shape[0] else []
    return [tuple("pp" if d == p else data for d in range(2))
            for p in range(2) if len(module) >= shape[p] for data in BESIDE]


def check_pipeline(module: nn.Module, roles: Roles, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """ValueError unless `roles` (with "pp") is a pipeline `module` can be cut into on `shape`."""
    if not isinstance(module, nn.Sequential):
        raise ValueError(f"roles {roles} cut the model into pipeline stages, which takes the nn.Sequential of its "
                         f"layers, got {describe(module)}: give the layers in order as an nn.Sequential (for a "
                         f"Hugging Face model, shardwise.pipeline.hf_sequential(model))")
    others = [r for r in roles if r != "pp"]
    if roles.count("pp") != 1 or any(r not in BESIDE for r in others):
        raise ValueError(f"roles {roles}: a pp dim goes beside a 'dp' or 'zero' dim only (pp with tensor parallel "
                         f"is not planned: build DistributedPipe(tp_plan=...) by hand), e.g. "
                         f"{tuple('pp' if d == 0 else 'dp' for d in range(len(shape)))}")
    p = roles.index("pp")
    if len(module) < shape[p]:
        raise ValueError(f"roles {roles} must give each of the {shape[p]} pipeline stages on mesh dim {names[p]!r} "
                         f"a layer, and the nn.Sequential has {len(module)}: use a pp dim of at most {len(module)} "
                         f"ranks, or cut the model into more layers")


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Where a pipeline runs: its `pp` stage ranks over mesh dim `pp_name`, `n` pipelines over
    `data_name` (None on a 1-D mesh), their parameters sharded over it (ZeRO-3) when `zero`."""

    pp: int
    pp_name: str
    n: int
    data_name: Optional[str]
    zero: bool

    @classmethod
    def of(cls, roles: Roles, shape: tuple[int, ...], names: tuple[str, ...]) -> _Dims:
        p = roles.index("pp")
        data = [d for d in range(len(roles)) if d != p]
        if not data:
            return cls(shape[p], names[p], 1, None, False)
        return cls(shape[p], names[p], shape[data[0]], names[data[0]], roles[data[0]] == "zero")


@dataclasses.dataclass(frozen=True)
class _Layers:
    """Per layer of one pipeline's share of the batch: forward FLOPs, parameter bytes, output bytes."""

    flops: list[float]
    params: list[int]
    sent: list[int]


def measure_pipeline(module: nn.Sequential, roles: Roles, shape: tuple[int, ...], names: tuple[str, ...],
                     inputs: Sequence[Any], cost: CostModel, memory_budget: Optional[int],
                     state_factor: float) -> tuple[StepCost, PipelinePlan]:
    """The modelled step of `module` under `roles` (see the module docstring) and the pipeline
    behind it; `inputs` is one pipeline's share of the batch. Where no pipeline fits
    `memory_budget`, the leanest (its cost says by how much)."""
    dims = _Dims.of(roles, shape, names)
    first = inputs[0] if len(inputs) == 1 else tuple(inputs)
    flops, params, _, sent = _profile(module, first)
    layers = _Layers(flops, params, sent)
    sharded = dims.zero and dims.n > 1
    kept = (2.0 + state_factor) / (dims.n if sharded else 1)  # parameters, gradients, optimizer state
    gathered = max(layers.params) if sharded else 0  # ZeRO-3: the largest layer gathered whole (about two units)
    budget = None if memory_budget is None else memory_budget - gathered
    try:
        plan = plan_pipeline(module, dims.pp, first, memory_budget=budget, cost=cost, param_scale=kept,
                             overhead=cost.latency)
    except MemoryBudgetError:  # the leanest, to show how close it comes
        free = plan_pipeline(module, dims.pp, first, cost=cost, param_scale=kept, overhead=cost.latency)
        plan = dataclasses.replace(min(free.candidates, key=lambda c: _rank_bytes(c, dims.pp)),
                                   candidates=free.candidates)
    return _step_cost(plan, cost, dims, layers, state_factor), plan


def _step_cost(plan: PipelinePlan, cost: CostModel, dims: _Dims, layers: _Layers, state_factor: float) -> StepCost:
    """`plan` as one rank's `StepCost`: the rank whose stages hold the most parameters."""
    bounds = [sum(plan.balance[:s]) for s in range(len(plan.balance) + 1)]
    stage_params = [sum(layers.params[bounds[s]:bounds[s + 1]]) for s in range(len(plan.balance))]
    where = _stage_rank(plan.schedule, dims.pp)
    rank = max(range(dims.pp), key=lambda r: sum(b for s, b in enumerate(stage_params) if where(s) == r))
    mine = [s for s in range(len(plan.balance)) if where(s) == rank]
    n, sharded = dims.n, dims.zero and dims.n > 1
    collectives: list[int] = []  # bytes received by each collective over the data dim
    messages: list[int] = []  # bytes received from the neighbouring stages
    for s in mine:
        if n > 1 and not sharded:  # one all_reduce of the stage's gradients
            collectives.append(2 * (n - 1) * stage_params[s] // n)
        elif sharded:  # per micro-batch: gathered for the forward and the backward, gradients reduce-scattered
            collectives += [(n - 1) * stage_params[s] // n] * (3 * plan.chunks)
        if s > 0 and where(s - 1) != rank:  # the previous stage's activations
            messages.append(layers.sent[bounds[s] - 1])
        if s + 1 < len(plan.balance) and where(s + 1) != rank:  # the gradients of this stage's output
            messages.append(layers.sent[bounds[s + 1] - 1])
    p2p = cost.p2p_bandwidth or cost.bandwidth_of([dims.pp_name])
    over = [dims.data_name] if dims.data_name else []
    comm = sum(cost.collective_seconds(b, over) for b in collectives) + sum(messages) / p2p
    held = sum(stage_params[s] for s in mine) / (n if sharded else 1)
    gathered = max(layers.params) if sharded else 0
    peak = _rank_bytes(plan, dims.pp) + gathered
    peaks = {"parameters": int(held) + gathered, "gradients": int(held), "optimizer": int(held * state_factor)}
    peaks["activations"] = max(0, peak - sum(peaks.values()))
    flops = 3 * sum(sum(layers.flops[bounds[s]:bounds[s + 1]]) for s in mine)  # a backward: two forwards
    return StepCost(plan.step, comm, int(flops), sum(collectives) + sum(messages), len(collectives), peak, peaks)


def build_pipe(module: nn.Sequential, mesh: Any, names: tuple[str, ...], roles: Roles, plan: PipelinePlan,
               **kwargs: Any) -> DistributedPipe:
    """`plan` as a `DistributedPipe` over the pp dim of `mesh`, data parallel (ZeRO-3 for
    "zero") over the other; `kwargs` (loss_fn, checkpoint, ...) go to the pipe."""
    fixed = sorted(k for k in kwargs if k in PLANNED_ARGUMENTS)
    if fixed:
        raise TypeError(f"apply({', '.join(f'{k}=' for k in fixed)}): the plan sets the pipeline's balance, dims, "
                        f"schedule and micro-batches; for another pipeline build DistributedPipe yourself "
                        f"(planner.report.chosen.pipeline has the plan's)")
    dims = _Dims.of(roles, tuple(mesh.shape), names)
    return DistributedPipe(module, list(plan.balance), mesh, pp_dim=dims.pp_name, dp_dim=dims.data_name,
                           shard_parameters=dims.zero, schedule=plan.schedule, chunks=plan.chunks, **kwargs)
