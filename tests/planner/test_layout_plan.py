"""The layout solver: a traced step, the ops' own strategies as choices, a MILP over them.

The trace knows every op's module, the backward's included, and every parameter's gradient.
Repeated blocks traced twice and bound to one set of choices give the same modelled step
and memory as solving the whole model, with a program the size of two blocks. A plan the
solver makes for an unchanged HF Llama (whatever it chose) is valid: `shard_module` takes
it and a training step on 4 real ranks equals one process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import shard_module
from shardwise._layout import Layout
from shardwise.planner import AutoPlanner, CostModel
from shardwise.planner import _layout_plan
from shardwise.planner._layout_plan import plan_layouts
from shardwise.planner._trace import trace_step
from shardwise.testing import distributed

from ._models import Stack

SLOW_LINKS = CostModel(flops_per_second=1e11, default_bandwidth=1e8, latency=1e-5)
# communication almost free, compute dear: the solver splits as much work as it can
FAST_LINKS = CostModel(flops_per_second=1e9, default_bandwidth=1e11, latency=1e-7)


def _square(out: Any) -> torch.Tensor:
    return out.square().mean()


def test_the_trace_knows_every_ops_module_and_every_gradient() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).to("meta")
    graph = trace_step(model, (torch.empty(3, 4, device="meta"),), _square)
    mms = [(n.path, n.backward) for n in graph.nodes if n.op == torch.ops.aten.mm.default]
    # the backward's matmuls: two for the last layer (weight and input gradients), one for the first
    assert sorted(mms) == [("0", True), ("2", True), ("2", True)]
    assert {n.path for n in graph.nodes if n.op == torch.ops.aten.threshold_backward.default} == {"1"}
    assert set(graph.grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, ref in graph.grads.items():
        assert graph.meta(ref).shape == dict(model.named_parameters())[name].shape
    assert [graph.nodes[i].kind for i in graph.inputs] == ["input"]


@pytest.mark.parametrize("batch", [8, 4096])
def test_repeated_blocks_solve_like_the_whole_model(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Stack(64, 6)
    args = (model, sw.AbstractMesh((4,), ("x",)), (torch.randn(batch, 64),), _square, SLOW_LINKS)
    clustered = plan_layouts(*args)
    monkeypatch.setattr(_layout_plan, "repeated", lambda module: None)
    whole = plan_layouts(*args)
    assert clustered.nodes < whole.nodes / 2
    # the whole model may treat an end block on its own: never worse, and here no better
    assert whole.solution.seconds <= clustered.solution.seconds * (1 + 1e-9)
    assert clustered.solution.seconds == pytest.approx(whole.solution.seconds, rel=1e-3)
    assert clustered.solution.memory == pytest.approx(whole.solution.memory, rel=1e-9)
    assert set(clustered.parameters) == {"blocks.*.up.weight", "blocks.*.up.bias", "blocks.*.down.weight",
                                         "blocks.*.down.bias", "head.weight", "head.bias"}
    for name, lay in whole.parameters.items():
        if name.startswith("blocks.1."):  # an inner block: the clustered plan's layout
            assert clustered.parameters["blocks.*." + name[len("blocks.1."):]] == lay


def test_a_batch_that_does_not_split_evenly_stays_whole() -> None:
    # 4096 rows over 4 would be data parallel (the test above); 4098 rows cannot be each rank's
    # equal share, so the input is never split and the plan still measures
    planner = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(4098, 32),), cost=SLOW_LINKS,
                          loss_fn=_square)
    planner.build_plan(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)))
    assert planner.layouts is not None and planner.layouts.inputs[0] != Layout((sw.Shard(0),))
    assert planner.report is not None and ("auto",) in {c.roles for c in planner.report.candidates}


def _llama_loss(out: Any) -> torch.Tensor:
    return out.logits.float().logsumexp(-1).mean()


@distributed(world_size=4)
def test_a_solved_plan_for_an_hf_llama_trains_as_one_process() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).double()
    tokens = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    # every rank solves alone: the solve must end optimal (not stopped by time on a loaded machine) for the
    # ranks to hold one plan
    solved = plan_layouts(reference, sw.AbstractMesh((4,), ("x",)), (tokens,), _llama_loss, FAST_LINKS,
                          time_limit=600.0)
    assert solved.solution.optimal
    assert any(sw.Shard(0) in lay.placements or sw.Shard(1) in lay.placements for lay in solved.parameters.values())
    assert any(name.startswith("model.layers.*.") for name in solved.parameters)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    model = shard_module(copy.deepcopy(reference), solved.plan, mesh)
    split = solved.inputs[0] is not None and solved.inputs[0].placements[0] == sw.Shard(0)
    _llama_loss(model(tokens.chunk(4)[mesh.get_local_rank(0)] if split else tokens)).backward()
    _llama_loss(reference(tokens)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p, sw.DTensor), name  # the plan names every parameter
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=1e-7, msg=name)
