"""`AutoPlanner`'s pp role: a mesh dim of pipeline stages, planned by `plan_pipeline`'s model.

An MLP whose first block is 16x wider than the others, on a large batch and a memory budget
that neither the replicated model (data parallel) nor its shards (ZeRO-3, tensor parallel)
fit, is a pipeline: its micro-batches keep few activations in flight. The cut puts the heavy
block alone and models a shorter step than the even split, and the report shows each stage's
memory and the bubble. On a (2, 2) mesh the pipeline goes beside data parallel or ZeRO-3, on
either dim, at the costs the rank's stages imply (one all_reduce of their gradients, or two
all_gathers and a reduce_scatter per micro-batch). `apply` builds the planned
`DistributedPipe`, which trains like one process on 4 real ranks. Bad input is named.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import DTensor
from shardwise.pipeline import DistributedPipe
from shardwise.planner import AutoPlanner, plan_pipeline
from shardwise.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:MegatronPlanner left")  # (the light blocks stay replicated)

W = 64


def _block(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(W, hidden), nn.Tanh(), nn.Linear(hidden, W))


def _heavy_first() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_block(16 * W), *(_block(W) for _ in range(5)))


def _roles(planner: AutoPlanner) -> dict[tuple[str, ...], Any]:
    assert planner.report is not None
    return {c.roles: c for c in planner.report.candidates}


def test_a_model_with_one_heavy_block_under_a_tight_budget_is_a_pipeline_cut_after_that_block() -> None:
    x = torch.randn(4096, W)
    planner = AutoPlanner(sw.AbstractMesh((2,), ("pp",)), example_inputs=(x,), memory_budget=12 * 10**6)
    planner.build_plan(_heavy_first())
    assert planner.report is not None
    chosen, candidates = planner.report.chosen, _roles(planner)
    assert chosen.roles == ("pp",) and chosen.pipeline is not None, str(planner.report)
    assert not candidates[("dp",)].fits and not candidates[("zero",)].fits, str(planner.report)
    assert all(not c.fits for r, c in candidates.items() if r != ("pp",)), str(planner.report)
    plan = chosen.pipeline
    assert plan.balance == (1, 5), plan.report()
    # the even split, on the same schedule and micro-batches, models a longer step
    same = plan_pipeline(_heavy_first(), 2, x, schedules=[plan.schedule], chunks=[plan.chunks],
                         overhead=planner.cost.latency)
    even = next(c for c in same.candidates if c.balance == (3, 3))
    assert plan.step < even.step, (plan.report(), even)
    assert chosen.cost.compute_seconds == plan.step and chosen.cost.peak_bytes <= 12 * 10**6
    text = str(planner.report)
    assert "pp=pp" in text and "<- chosen" in text and "chosen (pp=pp), per pipeline: pipeline plan:" in text
    assert f"bubble {plan.bubble:.1%}" in text
    for s, (n, b) in enumerate(zip(plan.balance, plan.stage_bytes)):  # each stage's layers and memory
        assert f"  {s:>5}  {n:>6}  {plan.stage_seconds[s] * 1e3:>24.3f}  {b / 2**20:>8.1f}" in text, text


def test_on_a_2d_mesh_the_pipeline_goes_beside_data_parallel_or_zero3() -> None:
    x = torch.randn(256, W)
    planner = AutoPlanner(sw.AbstractMesh((2, 2), ("pp", "dp")), example_inputs=(x,))
    planner.build_plan(_heavy_first())
    candidates = _roles(planner)
    piped = {r for r in candidates if "pp" in r}
    assert piped == {("pp", "dp"), ("pp", "zero"), ("dp", "pp"), ("zero", "pp")}, str(planner.report)
    dp, zero = candidates[("pp", "dp")], candidates[("pp", "zero")]
    assert dp.pipeline is not None and zero.pipeline is not None
    # the same pipeline (memory does not bind), so the same modelled step; the measured rank
    # holds the heavy block: dp all_reduces its gradients once, ZeRO-3 gathers its parameters
    # twice and reduce-scatters its gradients once per micro-batch; both receive the gradient of
    # the block's output (half the batch: each pipeline's share) from stage 1
    assert dp.pipeline.balance == (1, 5)
    assert (dp.pipeline.balance, dp.pipeline.schedule, dp.pipeline.chunks, dp.pipeline.step) == \
        (zero.pipeline.balance, zero.pipeline.schedule, zero.pipeline.chunks, zero.pipeline.step)
    assert dp.cost.compute_seconds == zero.cost.compute_seconds == dp.pipeline.step
    heavy = sum(p.numel() * 4 for p in _heavy_first()[0].parameters())
    sent = 128 * W * 4
    assert dp.cost.comm_bytes == heavy + sent and dp.cost.collectives == 1
    chunks = zero.pipeline.chunks
    assert zero.cost.comm_bytes == 3 * chunks * (heavy // 2) + sent and zero.cost.collectives == 3 * chunks
    assert zero.cost.comm_seconds > dp.cost.comm_seconds and zero.cost.peak_bytes < dp.cost.peak_bytes
    assert dp.cost.peaks["gradients"] == heavy and zero.cost.peaks["gradients"] == heavy // 2
    # pp on the other dim: the same numbers (both dims at the default bandwidth)
    assert candidates[("dp", "pp")].cost == dp.cost and candidates[("zero", "pp")].cost == zero.cost
    # compare measures a pipeline as the report does
    assert planner.compare(_heavy_first(), {"pipeline": ("pp", "dp")})["pipeline"] == dp.cost
    assert "pp=pp, dp=dp" in str(planner.report) and "pipeline plan:" in str(planner.report)


# -- on 4 real ranks ----------------------------------------------------------------------------

D, H, ROWS, STEPS, LR = 8, 32, 16, 3, 0.05


def _flat() -> nn.Sequential:
    """No block MegatronPlanner cuts: on a 2-D mesh the candidates are the pipelines."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D), nn.Tanh(), nn.Linear(D, H), nn.Tanh(),
                         nn.Linear(H, D), nn.Linear(D, D)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(ROWS, D, generator=g, dtype=torch.float64),
            torch.randn(ROWS, D, generator=g, dtype=torch.float64))


def _one_process() -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """Per step each half batch's loss before the step; every parameter after the steps."""
    model = _flat()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        with torch.no_grad():
            losses.append((F.mse_loss(model(x[:8]), y[:8]).item(), F.mse_loss(model(x[8:]), y[8:]).item()))
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _planner(memory_budget: Optional[int] = None) -> AutoPlanner:
    planner = AutoPlanner(sw.AbstractMesh((2, 2), ("pp", "dp")), example_inputs=(_batch(0)[0],),
                          memory_budget=memory_budget)
    planner.build_plan(_flat())
    return planner


def _applied(memory_budget: Optional[int]) -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    planner = _planner(memory_budget)
    assert planner.report is not None
    pipe = planner.apply(_flat(), mesh, loss_fn=F.mse_loss)
    assert isinstance(pipe, DistributedPipe)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = pipe.step(*planner.local_inputs(_batch(step), mesh))
        losses.append(None if loss is None else loss.item())
        opt.step()
    held = {name.split(".", 2)[2]: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in pipe.named_parameters()}
    pipe.close()
    return {"roles": planner.report.chosen.roles, "balance": pipe.balance, "dp": mesh.get_local_rank("dp"),
            "losses": losses, "held": held, "sharded": any(isinstance(p, DTensor) for p in pipe.parameters())}


def _both(memory_budget: int) -> list[dict[str, Any]]:
    return [_applied(None), _applied(memory_budget)]


def test_the_applied_pipeline_trains_like_one_process() -> None:
    want_losses, want = _one_process()
    # a budget between ZeRO-3's peak and data parallel's: the pipeline's parameters sharded over dp
    costs = _roles(_planner())
    budget = (costs[("pp", "zero")].cost.peak_bytes + costs[("pp", "dp")].cost.peak_bytes) // 2
    last = 0
    for rank, results in enumerate(run_distributed(_both, 4, budget, timeout=300)):
        for r, roles in zip(results, [("pp", "dp"), ("pp", "zero")]):
            assert r["roles"] == roles and r["sharded"] == (roles[1] == "zero"), (rank, r["roles"])
            assert r["held"] and all((p - want[n]).abs().max().item() <= 1e-10 for n, p in r["held"].items()), \
                (rank, roles, {n: (p - want[n]).abs().max().item() for n, p in r["held"].items()})
            for step, loss in enumerate(r["losses"]):
                if loss is not None:  # the last stage's rank: its replica's half of the batch
                    assert abs(loss - want_losses[step][r["dp"]]) <= 1e-10, (rank, roles, step, loss)
                    last += 1
    assert last == 2 * 2 * STEPS  # two last-stage ranks (one per replica), two plans, every step


# -- bad input --------------------------------------------------------------------------------

def test_bad_input_is_named() -> None:
    x = torch.randn(8, W)
    one = AutoPlanner(sw.AbstractMesh((2,), ("pp",)), example_inputs=(x,))
    with pytest.raises(ValueError, match=r"roles \('pp',\) cut the model into pipeline stages, which takes the "
                                         r"nn.Sequential of its layers, got .*Linear.*shardwise.pipeline."
                                         r"hf_sequential\(model\)"):
        one.compare(nn.Linear(W, W), {"pipeline": ("pp",)})
    with pytest.raises(ValueError, match=r"roles \('pp',\) must give each of the 2 pipeline stages on mesh dim 'pp' "
                                         r"a layer, and the nn.Sequential has 1: use a pp dim of at most 1"):
        one.compare(nn.Sequential(_block(W)), {"pipeline": ("pp",)})
    two = AutoPlanner(sw.AbstractMesh((2, 2), ("pp", "tp")), example_inputs=(x,))
    with pytest.raises(ValueError, match=r"roles \('pp', 'tp'\): a pp dim goes beside a 'dp' or 'zero' dim only "
                                         r"\(pp with tensor parallel is not planned"):
        two.compare(_heavy_first(), {"pp x tp": ("pp", "tp")})
    # a model that is no nn.Sequential gets no pp candidate (and no error) from build_plan
    from ._models import Stack

    one.build_plan(Stack(W, 2))
    assert one.report is not None and all("pp" not in c.roles for c in one.report.candidates)
    # apply: the pipeline's keywords only for a pipeline, and not those the plan sets
    with pytest.raises(TypeError, match=r"apply\(loss_fn=\): keywords go to the DistributedPipe of a pp choice"):
        one.apply(Stack(W, 2), sw.AbstractMesh((2,), ("pp",)), loss_fn=F.mse_loss)  # type: ignore[arg-type]
    piped = AutoPlanner(sw.AbstractMesh((2,), ("pp",)), example_inputs=(torch.randn(4096, W),),
                        memory_budget=12 * 10**6)
    piped.build_plan(_heavy_first())
    with pytest.raises(TypeError, match=r"apply\(chunks=, schedule=\): the plan sets the pipeline's balance"):
        piped.apply(_heavy_first(), sw.AbstractMesh((2,), ("pp",)), schedule="gpipe",  # type: ignore[arg-type]
                    chunks=2)
