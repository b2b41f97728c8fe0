"""The pipeline a planner chooses: stage boundaries, micro-batches and schedule, by a modelled step.

`plan_pipeline(module, pp, example_inputs)` models one training step of `module` (the
`nn.Sequential` a `DistributedPipe` cuts) on `pp` pipeline ranks, without running it:

- per layer, the forward's FLOPs on the global batch (torch's FLOP counter over meta
  tensors: nothing is computed or allocated) at `cost.flops_per_second`, and its memory:
  parameters times `param_scale` (their gradients and optimizer state) and the activations
  it saves for backward (seen through saved-tensor hooks);
- a micro-batch's forward on a stage costs its layers' FLOPs over `chunks`, plus
  `overhead` seconds (host time and the message to the next stage); a backward costs two
  forwards, and each of its halves (I, W) one;
- the boundaries: the cut whose slowest stage is fastest (`balance_cost`: every cut tried),
  and the even split, for each number of stages the schedules need (one per rank, or two);
- each (boundaries, schedule, micro-batches) candidate's step time is its schedule run on
  that model (`step_seconds`: each rank runs its actions in order, each as soon as what it
  needs has finished), and its stages' memory their parameters plus their activations times
  the most micro-batches the schedule keeps between a forward and its (weight) backward.

The plan is the fastest candidate that fits `memory_budget`; `report()` shows it beside the
others: each stage's layers, time and memory, and the modelled bubble.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .._describe import describe
from ..pipeline import (Action, Batch, Schedule, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                        ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, balance_cost,
                        check)
from ._cost import CostModel
from ._solve import MemoryBudgetError

__all__ = ["PipelinePlan", "plan_pipeline", "step_seconds"]

SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved", "zbv", "dualpipev")
_TWO_PER_RANK = ("interleaved", "zbv", "dualpipev")


@dataclass(frozen=True)
class PipelinePlan:
    """One candidate: `balance` (layers per stage), `schedule` (a `DistributedPipe` name) and
    `chunks`; per stage its forward seconds per micro-batch and its peak bytes; the modelled
    step and its bubble (the idle fraction of the ranks' time)."""

    balance: tuple[int, ...]
    schedule: str
    chunks: int
    stage_seconds: tuple[float, ...]
    stage_bytes: tuple[int, ...]
    step: float
    bubble: float
    candidates: tuple[PipelinePlan, ...] = ()  # (on the chosen plan) every candidate, fastest first

    def pipe(self, module: nn.Sequential, mesh: Any, **kwargs: Any) -> Any:
        """`DistributedPipe(module, balance, mesh, schedule=, chunks=, **kwargs)` of this plan."""
        from ..pipeline import DistributedPipe

        return DistributedPipe(module, list(self.balance), mesh, schedule=self.schedule, chunks=self.chunks, **kwargs)

    def report(self, top: int = 8) -> str:
        lines = [f"pipeline plan: {self.schedule}, {self.chunks} micro-batches, balance {list(self.balance)}: "
                 f"step {self.step * 1e3:.2f} ms modelled, bubble {self.bubble:.1%}",
                 "  stage  layers  forward ms / micro-batch  peak MiB"]
        for s, (n, t, b) in enumerate(zip(self.balance, self.stage_seconds, self.stage_bytes)):
            lines.append(f"  {s:>5}  {n:>6}  {t * 1e3:>24.3f}  {b / 2**20:>8.1f}")
        if self.candidates:
            lines.append("  candidates (fastest first): schedule, micro-batches, balance: step ms, bubble, peak MiB")
            for c in self.candidates[:top]:
                lines.append(f"    {c.schedule:<11} {c.chunks:>3}  {str(list(c.balance)):<20} {c.step * 1e3:9.2f}  "
                             f"{c.bubble:6.1%}  {max(c.stage_bytes) / 2**20:8.1f}")
        return "\n".join(lines)


def plan_pipeline(module: nn.Sequential, pp: int, example_inputs: Any, *, chunks: Optional[Sequence[int]] = None,
                  schedules: Sequence[str] = SCHEDULES, memory_budget: Optional[int] = None,
                  cost: Optional[CostModel] = None, param_scale: float = 4.0, overhead: float = 5e-4
                  ) -> PipelinePlan:
    """The fastest pipeline of `module` on `pp` ranks that fits `memory_budget` bytes per rank
    (see the module docstring); `example_inputs` is the first stage's input for one step (the
    global batch, split along dim 0 into micro-batches). `chunks`: the micro-batch counts to
    try (default: 1, 2, 4, ... up to the batch's rows); `schedules`: the `DistributedPipe`
    schedule names to try. MemoryBudgetError when nothing fits, naming the closest."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"plan_pipeline plans the nn.Sequential a DistributedPipe cuts, got {describe(module)}: cut "
                        "a Hugging Face model with shardwise.pipeline.hf_sequential(model)")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"plan_pipeline(pp={pp!r}): the number of pipeline ranks, a positive int")
    if len(module) < pp:
        raise ValueError(f"plan_pipeline: {len(module)} layers cannot fill {pp} stages (one layer at least each): "
                         f"use pp <= {len(module)}")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"plan_pipeline(schedules={list(schedules)!r}): choose among {SCHEDULES}")
    check(example_inputs)
    rows = Batch(example_inputs).tensors[0].shape[0]
    tries = list(chunks) if chunks is not None else [m for m in (1, 2, 4, 8, 16, 32) if m <= rows]
    bad = [m for m in tries if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= rows]
    if bad or not tries:
        raise ValueError(f"plan_pipeline(chunks={tries!r}): micro-batch counts between 1 and the batch's {rows} rows")
    cost = cost if cost is not None else CostModel.gloo_cpu()
    flops, params, saved, _ = _profile(module, example_inputs)
    layer_seconds = [f / cost.flops_per_second for f in flops]
    layer_bytes = [p * param_scale for p in params]
    candidates = []
    for schedule in schedules:
        stages = 2 * pp if schedule in _TWO_PER_RANK else pp
        if len(module) < stages:
            continue
        for balance in _balances(layer_seconds, stages):
            for m in tries:
                made = _schedule(schedule, pp, stages, m)
                if made is None:
                    continue
                candidates.append(_candidate(made, schedule, balance, m, layer_seconds, layer_bytes, saved, overhead))
    candidates.sort(key=lambda c: (c.step, max(c.stage_bytes)))
    fitting = [c for c in candidates if memory_budget is None or _rank_bytes(c, pp) <= memory_budget]
    if not fitting:
        least = min(candidates, key=lambda c: _rank_bytes(c, pp))
        raise MemoryBudgetError(f"plan_pipeline: no pipeline of {len(candidates)} candidates fits memory_budget="
                                f"{memory_budget} bytes per rank; the leanest, {least.schedule} with {least.chunks} "
                                f"micro-batches and balance {list(least.balance)}, needs {_rank_bytes(least, pp)}: raise "
                                "the budget, use more pipeline ranks or more micro-batches")
    best = fitting[0]
    return PipelinePlan(best.balance, best.schedule, best.chunks, best.stage_seconds, best.stage_bytes, best.step,
                        best.bubble, tuple(fitting))


def step_seconds(schedule: Schedule, seconds: Callable[[Action], float]) -> tuple[float, float]:
    """(step time, bubble) of `schedule` when action `a` lasts `seconds(a)`: each rank runs its
    `rank_order`, each action as soon as its rank is free and what it needs has finished."""
    orders = [schedule.rank_order(rank) for rank in range(schedule.num_ranks)]
    finished: dict[Action, float] = {}
    position, free = [0] * schedule.num_ranks, [0.0] * schedule.num_ranks
    busy = 0.0
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                a = order[position[rank]]
                ready = []
                for need in schedule.needs(a):
                    done = [finished[n] for n in need if n in finished]
                    if not done:
                        break
                    ready.append(min(done))
                else:
                    start = max([free[rank], *ready])
                    free[rank] = finished[a] = start + seconds(a)
                    busy += seconds(a)
                    position[rank] += 1
                    moved = True
                    continue
                break
    if any(p < len(o) for p, o in zip(position, orders)):
        raise RuntimeError(f"{schedule!r} deadlocks")
    step = max(free)
    return step, (1.0 - busy / (schedule.num_ranks * step) if step > 0 else 0.0)


def _profile(module: nn.Sequential, example_inputs: Any) -> tuple[list[float], list[int], list[int], list[int]]:
    """Per layer: forward FLOPs, parameter bytes, saved-activation bytes and output bytes (what
    it sends the next layer) on the whole batch, on meta."""
    flops, params, saved, sent = [], [], [], []
    value: Any = _meta(example_inputs)
    for layer in module:
        meta = layer if all(p.is_meta for p in layer.parameters()) else copy.deepcopy(layer).to("meta")
        kept: dict[int, int] = {}
        owned = {p.untyped_storage()._cdata for p in meta.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in owned:
                kept[storage._cdata] = t.numel() * t.element_size()
            return t

        counter = FlopCounterMode(display=False)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = Batch(value).call(meta).value
        flops.append(float(counter.get_total_flops()))
        params.append(sum(p.numel() * p.element_size() for p in meta.parameters()))
        saved.append(sum(kept.values()))
        sent.append(sum(t.numel() * t.element_size() for t in Batch(value).tensors))
        value = _detached(value)
    return flops, params, saved, sent


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta").requires_grad_(value.requires_grad or value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    return value


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


def _balances(layer_seconds: list[float], stages: int) -> list[tuple[int, ...]]:
    """The cut whose slowest stage is fastest, and the even split (the layers as equal as they go)."""
    even = tuple(len(layer_seconds) // stages + (1 if s < len(layer_seconds) % stages else 0) for s in range(stages))
    timed = tuple(balance_cost([max(t, 1e-12) for t in layer_seconds], stages))
    return [timed] if timed == even else [timed, even]


def _schedule(name: str, pp: int, stages: int, m: int) -> Optional[Schedule]:
    if name == "gpipe":
        return ScheduleGPipe(pp, m)
    if name == "1f1b":
        return Schedule1F1B(pp, m)
    if name == "zero_bubble":
        return ScheduleInterleavedZeroBubble(pp, 1, m)
    if name == "interleaved":
        return ScheduleInterleaved1F1B(pp, stages // pp, m) if m % pp == 0 else None
    if name == "zbv":
        return ScheduleZBVZeroBubble(pp, m)
    return ScheduleDualPipeV(pp, m) if m >= 2 * pp else None


def _candidate(schedule: Schedule, name: str, balance: tuple[int, ...], m: int, layer_seconds: list[float],
               layer_bytes: list[float], saved: list[int], overhead: float) -> PipelinePlan:
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    forward = [sum(layer_seconds[bounds[s]:bounds[s + 1]]) / m + overhead for s in range(len(balance))]
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    step, bubble = step_seconds(schedule, lambda a: forward[a.stage] * cost[a.kind])
    held = _in_flight(schedule)
    peak = tuple(int(sum(layer_bytes[bounds[s]:bounds[s + 1]]) + held[s] * sum(saved[bounds[s]:bounds[s + 1]]) / m)
                 for s in range(len(balance)))
    return PipelinePlan(balance, name, m, tuple(forward), peak, step, bubble)


def _in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches between their forward and their (weight) backward."""
    live, peak = [0] * schedule.num_stages, [0] * schedule.num_stages
    for rank in range(schedule.num_ranks):
        for a in schedule.rank_order(rank):
            live[a.stage] += {"F": 1, "B": -1, "I": 0, "W": -1}[a.kind]
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return peak


def _rank_bytes(plan: PipelinePlan, pp: int) -> int:
    """The most bytes a rank holds: its stages' peaks together."""
    mine = [0] * pp
    where = _stage_rank(plan.schedule, pp)
    for s, b in enumerate(plan.stage_bytes):
        mine[where(s)] += b
    return max(mine)


def _stage_rank(schedule: str, pp: int) -> Callable[[int], int]:
    """The pp rank of each stage under `schedule`: a V (rank k holds stages k and 2 pp - 1 - k)
    for zbv and dualpipev, round robin otherwise."""
    if schedule in ("zbv", "dualpipev"):
        return ScheduleZBVZeroBubble(pp, 1).stage_rank
    return lambda s: s % pp
