"""`AutoPlanner`: the modelled-cheapest roles for a mesh, found by dry runs.

The known answers: a 2-layer MLP with a large hidden dim and a small batch, under a
bandwidth-limited cost, is cut Megatron's way (the first layer by columns, the second by
rows: one all_reduce of the small activation instead of the large gradients); the same MLP
small with a large batch is plain data parallel. A memory budget below what data parallel
needs makes it shard parameters (ZeRO-3) and the chosen plan's modelled peak stays within
it. Clustering repeated blocks predicts the whole model's FLOPs and bytes exactly. The
chosen plans are valid: applied on 4 real ranks, a training step equals one process. The
default loss needs the whole output, so a plan that leaves it a pending sum pays to reduce it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise._layout import Layout
from shardwise.parallel import ColwiseParallel, RowwiseParallel
from shardwise import Replicate, Shard
from shardwise.planner import AutoPlanner, CostModel
from shardwise.planner._model import meta_copy
from shardwise.testing import distributed

from ._models import Stack

R, S0, S1 = Layout((Replicate(),)), Layout((Shard(0),)), Layout((Shard(1),))
SLOW_LINKS = CostModel(flops_per_second=1e11, default_bandwidth=1e8, latency=1e-5)


def _mlp(d: int, h: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))


def test_a_wide_mlp_on_a_small_batch_is_cut_column_then_row() -> None:
    planner = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(8, 512),), cost=SLOW_LINKS)
    plan = planner.build_plan(_mlp(512, 2048))
    assert planner.report is not None and planner.layouts is not None
    # the layout solver, from the ops' own strategies: the first layer by columns (its bias
    # with them), the second by rows, the input replicated
    assert planner.layouts.parameters == {"0.weight": S0, "0.bias": S0, "2.weight": S1, "2.bias": R}
    assert planner.layouts.inputs == (R,)
    costs = {c.roles: c.cost for c in planner.report.candidates}
    # both cut column-then-row; the default loss (a squared error) needs the output reduced,
    # which the hand plan does once in the layer's output hook, and the solver's plan (its
    # last layer's output a pending sum) for the loss's forward and again for its backward
    assert planner.report.chosen.roles in {("tp",), ("auto",)}
    assert planner.report.chosen.cost.seconds == min(c.seconds for c in costs.values())
    assert plan is planner.report.plan
    if planner.report.chosen.roles == ("tp",):
        assert {k: type(v) for k, v in plan.plan.items()} == {"0": ColwiseParallel, "2": RowwiseParallel}
    else:
        assert plan is planner.layouts.plan
    assert costs[("auto",)].comm_bytes <= 2 * costs[("tp",)].comm_bytes
    # data parallel all_reduces the 2 x 512 x 2048 weights' gradients; tp one 8 x 512 activation
    assert costs[("dp",)].comm_bytes > 100 * costs[("tp",)].comm_bytes
    assert "x=tp" in str(planner.report) and "<- chosen" in str(planner.report)
    assert "0.weight: (S(0))" in planner.layouts.describe()


def test_a_small_mlp_on_a_large_batch_is_data_parallel() -> None:
    planner = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(4096, 32),), cost=SLOW_LINKS,
                          loss_fn=lambda out: out.square().mean())
    planner.build_plan(_mlp(32, 128))
    assert planner.report is not None and planner.layouts is not None
    # the solver finds data parallel itself: the batch split, every parameter replicated
    assert planner.layouts.inputs == (S0,) and set(planner.layouts.parameters.values()) == {R}
    costs = {c.roles: c.cost for c in planner.report.candidates}
    assert planner.report.chosen.roles in {("auto",), ("dp",)}
    assert costs[("auto",)].comm_bytes <= costs[("dp",)].comm_bytes < costs[("tp",)].comm_bytes / 10


@pytest.mark.parametrize("loss", ["default", "linear"])
def test_the_default_loss_plans_a_small_mlp_on_a_large_batch_as_data_parallel(loss: str) -> None:
    # issue 30.6: the default loss was the output's mean, under which a row-parallel output's
    # pending sum is never reduced, so column-then-row tensor parallel (no communication at
    # all) won over data parallel for a 64 -> 256 -> 64 MLP on 16,384 rows
    loss_fn = (lambda out: out.float().mean()) if loss == "linear" else None
    planner = AutoPlanner(sw.AbstractMesh((4,), ("dp",)), example_inputs=(torch.randn(16384, 64),), loss_fn=loss_fn)
    planner.build_plan(_mlp(64, 256))
    assert planner.report is not None and planner.layouts is not None
    costs = {c.roles: c.cost for c in planner.report.candidates}
    solver_dp = planner.layouts.inputs == (S0,) and set(planner.layouts.parameters.values()) == {R}
    if loss == "linear":  # the old default, given by hand: the mistake it made
        assert not solver_dp and planner.report.chosen.roles == ("auto",)
        assert costs[("auto",)].comm_bytes == 0
        return
    # the solver finds data parallel itself (the batch split, every parameter replicated), and
    # the chosen candidate is data parallel, by roles or by the solver's layouts
    assert solver_dp, planner.layouts.describe()
    assert planner.report.chosen.roles in {("dp",), ("auto",)}
    assert costs[("dp",)].seconds < costs[("tp",)].seconds
    assert costs[("dp",)].comm_bytes < costs[("tp",)].comm_bytes / 10


def test_an_attention_block_model_is_cut_megatron_style() -> None:
    from shardwise._demo.model import CharGPT, CharGPTConfig

    torch.manual_seed(0)
    model = CharGPT(CharGPTConfig(vocab=64, d_model=256, seq=16, layers=1))
    planner = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randint(0, 64, (2, 16)),),
                          cost=SLOW_LINKS)
    plan = planner.build_plan(model)
    assert planner.report is not None and planner.report.chosen.roles == ("tp",)
    kinds = {k.rsplit(".", 1)[-1]: type(v).__name__ for k, v in plan.plan.items()}
    assert kinds["q"] == kinds["up"] == "ColwiseParallel" and kinds["proj"] == kinds["down"] == "RowwiseParallel", kinds


def test_a_memory_budget_below_data_parallel_shards_parameters() -> None:
    model = _mlp(256, 1024)
    square = dict(loss_fn=lambda out: out.square().mean(), cost=SLOW_LINKS)
    free = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(4096, 256),), **square)
    free.build_plan(model)
    assert free.report is not None and free.report.chosen.roles in {("dp",), ("auto",)}
    dp = next(c.cost.peak_bytes for c in free.report.candidates if c.roles == ("dp",))
    zero = next(c.cost.peak_bytes for c in free.report.candidates if c.roles == ("zero",))
    assert zero < dp
    tight = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(4096, 256),),
                        memory_budget=(zero + dp) // 2, **square)
    tight.build_plan(model)
    assert tight.report is not None and tight.report.chosen.roles != ("dp",)
    assert tight.report.chosen.cost.peak_bytes <= (zero + dp) // 2
    assert [c.fits for c in tight.report.candidates if c.roles == ("dp",)] == [False]
    assert tight.layouts is not None and any(lay != R for lay in tight.layouts.parameters.values())
    with pytest.raises(ValueError, match=r"fits memory_budget=1000 B per rank: the smallest peak is"):
        AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(4096, 256),),
                    memory_budget=1000).build_plan(model)


@pytest.mark.parametrize("roles", [("tp", "dp"), ("zero", "tp")])
def test_clustered_layers_predict_the_whole_models_flops_and_bytes(roles: tuple[str, str]) -> None:
    model = Stack(64, 6)
    planner = AutoPlanner(sw.AbstractMesh((2, 2), ("a", "b")), example_inputs=(torch.randn(8, 64),), cost=SLOW_LINKS)
    clustered = planner.compare(model, {"it": roles})["it"]
    whole = planner._measure(model, roles, None)
    assert (clustered.flops, clustered.comm_bytes, clustered.collectives) == \
        (whole.flops, whole.comm_bytes, whole.collectives)
    assert clustered.peaks["parameters"] == whole.peaks["parameters"]
    assert len(list(meta_copy(model, 2).blocks)) == 2 and next(meta_copy(model, 1).parameters()).is_meta


@distributed(world_size=4)
def test_the_chosen_plans_train_as_one_process() -> None:
    for d, h, batch in ((64, 512, 8), (16, 32, 4096)):
        reference = _mlp(d, h).double()
        inputs = torch.randn(batch, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        planner = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(inputs,), cost=SLOW_LINKS,
                              loss_fn=lambda out: out.square().mean())
        planner.build_plan(_mlp(d, h).double())
        mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
        model = planner.apply(_mlp(d, h).double(), mesh)
        assert planner.layouts is not None
        # the solver's plan either way: Megatron's cuts for the wide MLP, data parallel for the small one
        assert planner.layouts.inputs == ((R,) if batch == 8 else (S0,))
        out = model(*planner.local_inputs((inputs,), mesh))
        loss = (out.full_tensor() if isinstance(out, sw.DTensor) else out).square().mean()
        loss.backward()
        reference(inputs).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, sw.DTensor) else p.grad
            torch.testing.assert_close(g, q.grad, rtol=0, atol=1e-10, msg=name)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"plans 1-D and 2-D meshes"):
        AutoPlanner(sw.AbstractMesh((2, 2, 2)), example_inputs=(torch.randn(2, 2),))
    with pytest.raises(TypeError, match=r"example_inputs is the tuple"):
        AutoPlanner(sw.AbstractMesh((4,)), example_inputs=torch.randn(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"memory_budget is bytes per rank"):
        AutoPlanner(sw.AbstractMesh((4,)), example_inputs=(torch.randn(2, 2),), memory_budget=-1)
    planner = AutoPlanner(sw.AbstractMesh((4,)), example_inputs=(torch.randn(6, 8),))
    with pytest.raises(ValueError, match=r"roles \('pp',\) must give each"):
        planner.compare(_mlp(8, 8), {"x": ("pp",)})
    with pytest.raises(ValueError, match=r"6 rows does not split evenly over 4"):
        planner.compare(_mlp(8, 8), {"x": ("dp",)})
    with pytest.raises(ValueError, match=r"time_limit is the layout solver's seconds, a positive number, got 0"):
        AutoPlanner(sw.AbstractMesh((4,)), example_inputs=(torch.randn(8, 8),), time_limit=0)
    with pytest.raises(ValueError, match=r"rates must be positive"):
        CostModel(default_bandwidth=0)


def test_a_tensor_parallel_plan_that_cannot_split_the_model_is_no_candidate() -> None:
    # regression: MegatronPlanner cuts Stack's 3-output head by columns, which leaves one of 4 ranks an
    # empty piece; build_plan raised that plan's ValueError instead of planning without tensor parallelism
    model = Stack(64, 4)
    planner = AutoPlanner(sw.AbstractMesh((4,), ("x",)), example_inputs=(torch.randn(8, 64),), cost=SLOW_LINKS)
    planner.build_plan(model)
    assert planner.report is not None
    assert all(c.roles != ("tp",) for c in planner.report.candidates)
    two = AutoPlanner(sw.AbstractMesh((2, 4), ("a", "b")), example_inputs=(torch.randn(8, 64),), cost=SLOW_LINKS)
    two.build_plan(model)  # tp over the dim of 2 still is one
    assert two.report is not None and {c.roles.index("tp") for c in two.report.candidates} == {0}
