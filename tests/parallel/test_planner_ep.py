"""`AutoPlanner`'s "ep" role: a mixture of experts too big for a rank under data parallel gets expert parallelism.

A small Mixtral in float64 (2 layers of 8 experts of intermediate 256, top-2) on a (4,) mesh,
with a memory budget of 20 MiB per rank: data parallel holds every expert with its gradient
and AdamW state on every rank (24 MiB at the peak) and does not fit; ZeRO-3 and expert
parallelism do, and "ep" (the experts spread over the 4 ranks, each rank's routes sent to
their owners by all_to_all, the dense parameters data parallel) sends far fewer bytes than
ZeRO-3's gathers of every parameter, so it is chosen. Applied on 4 real gloo ranks, the
chosen plan trains 3 AdamW steps equal to one process on the global batch.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.planner import AutoPlanner
from shardwise.testing import run_distributed

from .test_moe_dispatch import _three_steps

transformers = pytest.importorskip("transformers")

BUDGET = 20 * 2**20


def _mixtral() -> Any:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=8, num_experts_per_tok=2,
        experts_implementation="batched_mm")).double()  # (the eager loop reads routes on the host: no dry run)


@functools.lru_cache(maxsize=1)
def _planned() -> AutoPlanner:
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))  # the global batch: 2 rows a rank
    planner = AutoPlanner(sw.AbstractMesh((4,), ("ep",)), example_inputs=(ids,), memory_budget=BUDGET)
    planner.build_plan(_mixtral())
    return planner


def test_experts_that_do_not_fit_under_data_parallel_are_spread_by_the_ep_role() -> None:
    report = _planned().report
    assert report is not None
    costs = {c.roles: c for c in report.candidates}
    assert set(costs) == {("dp",), ("zero",), ("tp",), ("ep",)}  # no layout solver: it knows no token dispatch
    assert report.chosen.roles == ("ep",), report
    assert not costs[("dp",)].fits and costs[("ep",)].fits and costs[("zero",)].fits
    # the routed tokens out and back against every parameter gathered twice and scattered once
    assert costs[("ep",)].cost.comm_bytes * 10 < costs[("zero",)].cost.comm_bytes
    # the experts split 4 ways: a rank holds a quarter of them, the dense parameters whole
    assert costs[("ep",)].cost.peaks["parameters"] < costs[("dp",)].cost.peaks["parameters"] / 2
    assert "ep=ep" in str(report) and "<- chosen" in next(line for line in str(report).splitlines() if "ep=ep" in line)
    with pytest.raises(ValueError, match=r"Linear has no experts module that ExpertParallel\(tokens=\"split\"\) "
                                         r"takes on 4 ranks"):
        _planned().compare(torch.nn.Linear(4, 4), {"experts": ("ep",)})


def _train_as_planned(planner: AutoPlanner) -> tuple[float, float]:
    reference = _mixtral()
    model = copy.deepcopy(reference)
    planner.apply(model, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)))
    return _three_steps("mixtral", reference, model, 4)


def test_the_ep_plan_applied_on_4_ranks_trains_like_one_process() -> None:
    for worst, loss in run_distributed(_train_as_planned, 4, _planned()):
        assert worst < 1e-10 and loss < 1e-10, (worst, loss)
