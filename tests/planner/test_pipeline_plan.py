"""`plan_pipeline`: stage boundaries, micro-batches and schedule chosen by a modelled step.

A model with one heavy layer first: the even split puts two light layers beside it and the
planner's cut does not, so its modelled step is shorter on the same schedule; the plan it
builds trains like one process. The step model agrees with the schedules' own bubble on
their cost model, a memory budget rules candidates out (and names the leanest when none
fits), and bad input is named.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.pipeline import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleavedZeroBubble,
                                ScheduleZBVZeroBubble)
from shardwise.pipeline._schedule import COST
from shardwise.planner import plan_pipeline, step_seconds
from shardwise.planner._solve import MemoryBudgetError
from shardwise.testing import run_distributed

W = 32


def _block(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(W, hidden), nn.Tanh(), nn.Linear(hidden, W))


def _heavy_first() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_block(16 * W), *(_block(W) for _ in range(5))).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, W, generator=g, dtype=torch.float64), torch.randn(16, W, generator=g, dtype=torch.float64)


def test_the_planners_cut_isolates_the_heavy_layer_and_models_a_shorter_step_than_the_even_split() -> None:
    x, _ = _batch()
    plan = plan_pipeline(_heavy_first(), 2, x)
    assert plan.balance == (1, 5), plan.report()
    same = [c for c in plan.candidates if c.schedule == plan.schedule and c.chunks == plan.chunks]
    even = next(c for c in same if c.balance == (3, 3))
    assert plan.step < even.step and max(plan.stage_seconds) < max(even.stage_seconds), plan.report()
    text = plan.report()
    assert f"pipeline plan: {plan.schedule}, {plan.chunks} micro-batches, balance [1, 5]" in text
    assert "stage  layers  forward ms / micro-batch  peak MiB" in text and "bubble" in text
    assert 0.0 <= plan.bubble < 1.0 and all(b > 0 for b in plan.stage_bytes)


@pytest.mark.parametrize("schedule", [ScheduleGPipe(3, 4), Schedule1F1B(4, 8), ScheduleInterleavedZeroBubble(4, 1, 8),
                                      ScheduleZBVZeroBubble(2, 4), ScheduleDualPipeV(2, 5)], ids=repr)
def test_the_step_model_agrees_with_the_schedules_own_bubble(schedule: object) -> None:
    step, bubble = step_seconds(schedule, lambda a: float(COST[a.kind]))  # type: ignore[arg-type]
    assert bubble == pytest.approx(schedule.bubble_fraction(), abs=1e-12)  # type: ignore[attr-defined]


def test_a_memory_budget_rules_candidates_out_and_names_the_leanest_when_none_fits() -> None:
    x, _ = _batch()
    free = plan_pipeline(_heavy_first(), 2, x)
    budget = min(max(c.stage_bytes) for c in free.candidates) + 1
    tight = plan_pipeline(_heavy_first(), 2, x, memory_budget=budget * 2)
    assert all(max(c.stage_bytes) <= budget * 2 for c in tight.candidates)
    with pytest.raises(MemoryBudgetError, match=r"no pipeline of \d+ candidates fits memory_budget=10 bytes per rank; "
                                                r"the leanest, .* needs \d+: raise the budget"):
        plan_pipeline(_heavy_first(), 2, x, memory_budget=10)


def test_bad_input_is_named() -> None:
    x, _ = _batch()
    with pytest.raises(TypeError, match="plans the nn.Sequential a DistributedPipe cuts, got"):
        plan_pipeline(nn.Linear(W, W), 2, x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"6 layers cannot fill 7 stages .*: use pp <= 6"):
        plan_pipeline(_heavy_first(), 7, x)
    with pytest.raises(ValueError, match=r"schedules=\['pipedream'\]\): choose among"):
        plan_pipeline(_heavy_first(), 2, x, schedules=["pipedream"])
    with pytest.raises(ValueError, match=r"chunks=\[0\]\): micro-batch counts between 1 and the batch's 16 rows"):
        plan_pipeline(_heavy_first(), 2, x, chunks=[0])


def _planned_trains_like_one_process() -> int:
    x, t = _batch()
    ref = _heavy_first()
    torch.nn.functional.mse_loss(ref(x), t).backward()
    plan = plan_pipeline(_heavy_first(), 2, x)
    pipe = plan.pipe(copy.deepcopy(_heavy_first()), sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)),
                     loss_fn=torch.nn.functional.mse_loss)
    pipe.step(x, t)
    want = dict(ref.named_parameters())
    checked = 0
    for part in pipe.partitions.values():
        for name, p in part.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(p.grad, want[name].grad, rtol=0, atol=1e-12)
            checked += 1
    pipe.close()
    return checked


def test_the_planned_pipeline_trains_like_one_process() -> None:
    assert sum(run_distributed(_planned_trains_like_one_process, 2)) == 24
