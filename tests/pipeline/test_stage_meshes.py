"""Pipelines over one mesh per stage, consecutive stages of different tensor-parallel widths.

`DistributedPipe(model, balance, [mesh_0, mesh_1], tp_plan=...)` puts stage `s` on its own
(tp,) or (dp, tp) mesh; where two consecutive stages' tp rows differ in size, the
activations and gradients that cross between them move by the cross-mesh planner: each
receiving rank gets exactly the piece of the landing layout it holds (the lower bound, as
the rows are disjoint), from the senders the plan deals it to.

The MLP of `test_tensor_parallel_stages` (column- then row-parallel per stage, the
crossing activation split by rows) trains with 1F1B and AdamW against one process
(float64, every parameter after every step within 1e-10) on stage meshes of tp widths
4 -> 2 (6 processes, micro-batches of 6 rows that 4 ranks split unevenly), 1 -> 2, and
(dp, tp) = (2, 2) -> (2, 1). A stage that raises tells every rank of the previous stage,
whose tp row is wider; bad stage meshes are refused by name. Last, a weight tied across
stages of widths 2 and 1 (split by columns on one, whole on the other) steps as one weight.
"""

from __future__ import annotations

import functools

from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import DTensor, comm_log
from shardwise._comm import P2PRecord
from shardwise.parallel import ColwiseParallel, RowwiseParallel
from shardwise.pipeline import DistributedPipe, PipelineError
from shardwise.testing import run_distributed

from ._mlp import D, PLAN, batch, mlp, one_process

H, ROWS, CHUNKS, STEPS = 12, 12, 2, 3


_model = functools.partial(mlp, H)  # module-level names: the worker processes import them
_batch = functools.partial(batch, rows=ROWS)


def _payloads(records: list[Any], kind: str, senders: int) -> list[int]:
    """Bytes of tensor payload this rank received per micro-batch on `kind` channels: each
    micro-batch's receives are every sender's header (the metadata inside), then the pieces."""
    by_tag: dict[int, list[int]] = defaultdict(list)
    for r in records:
        if isinstance(r, P2PRecord) and r.op == "recv" and r.label.startswith(f"the {kind} of"):
            by_tag[r.tag].append(r.bytes_received)
    return [sum(sizes[senders:]) for _, sizes in sorted(by_tag.items())]


def _train(grids: list[Any], names: tuple[str, ...]) -> dict[str, Any]:
    meshes = [sw.DeviceMesh("cpu", grid, mesh_dim_names=names) for grid in grids]
    pipe = DistributedPipe(_model(), [3, 3], meshes, tp_plan=PLAN, schedule="1f1b", chunks=CHUNKS, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    t = pipe.topology
    dp, d = len(t.grids[0]), t.dp_index
    other = len(t.row(1 - t.pp_rank))
    losses, params, received = [], [], []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        with comm_log() as records:
            loss = pipe.step(x.chunk(dp)[d], y.chunk(dp)[d])
        opt.step()
        losses.append(None if loss is None else loss.item())
        params.append({name.split(".", 2)[2]: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for name, p in pipe.named_parameters()})
        received.append(_payloads(records, "activation" if t.pp_rank == 1 else "gradient", other))
    pipe.close()
    return {"losses": losses, "params": params, "received": received, "pp": t.pp_rank, "tp": t.tp_index,
            "width": len(t.row(t.pp_rank)), "dp": dp}


def _rows_held(rows: int, width: int, index: int) -> int:
    """Rows of a `rows`-row tensor that rank `index` of `width` holds under Shard(0) (torch.chunk sizes)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(width)]
    return sizes[index] if index < len(sizes) else 0


@pytest.mark.parametrize(("grids", "names"), [
    ([[0, 1, 2, 3], [4, 5]], ("tp",)),
    ([[0], [1, 2]], ("tp",)),
    ([[[0, 1], [2, 3]], [[4], [5]]], ("dp", "tp")),
], ids=["tp4-tp2", "tp1-tp2", "dp2tp2-dp2tp1"])
def test_stages_of_different_tp_widths_train_like_one_process(grids: list[Any], names: tuple[str, ...]) -> None:
    reference = one_process(_model(), ROWS, STEPS)
    world = sum(torch.tensor(g).numel() for g in grids)
    results = run_distributed(_train, world, grids, names, timeout=300)
    for rank, r in enumerate(results):
        for step, (want_loss, want_params) in enumerate(reference):
            if r["pp"] == 1 and r["dp"] == 1:
                assert abs(r["losses"][step] - want_loss) < 1e-10, (rank, step)
            for name, value in r["params"][step].items():
                torch.testing.assert_close(value, want_params[name], rtol=0, atol=1e-10,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        # the activation lands split by rows on stage 1's row, its gradient split by rows on stage 0's:
        # each rank receives its rows of the micro-batch and nothing more
        rows = ROWS // r["dp"] // CHUNKS
        want = _rows_held(rows, r["width"], r["tp"]) * D * 8
        assert r["received"] == [[want] * CHUNKS] * STEPS, (rank, r["received"], want)
    if results[-1]["dp"] == 2:
        for step, (want_loss, _) in enumerate(reference):
            halves = [r["losses"][step] for r in results if r["losses"][step] is not None]
            assert len(halves) == 2 and abs(sum(halves) / 2 - want_loss) < 1e-10, (step, halves)


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("stage 1 broke")


def _failing() -> str:
    meshes = [sw.DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",)), sw.DeviceMesh("cpu", [2], mesh_dim_names=("tp",))]
    model = nn.Sequential(*_model()[:3], _Fails())
    pipe = DistributedPipe(model, [3, 1], meshes, tp_plan={k: v for k, v in PLAN.items() if k in "02"},
                           schedule="1f1b", chunks=CHUNKS, loss_fn=F.mse_loss)
    x, y = _batch(0)
    try:
        pipe.step(x, y)
    except (PipelineError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_failing_narrow_stage_stops_every_rank_of_the_wide_one() -> None:
    errors = run_distributed(_failing, 3, timeout=120)
    assert errors[2].startswith("RuntimeError: stage 1 broke"), errors[2]
    for rank in (0, 1):  # both ranks of stage 0 wait on stage 1's gradient, and are told
        assert errors[rank].startswith("PipelineError: stage 0 on rank"), errors[rank]
        assert "stage 1 on rank 2 raised RuntimeError: stage 1 broke" in errors[rank], errors[rank]


def _refusals() -> None:
    a = sw.DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    b = sw.DeviceMesh("cpu", [2, 3], mesh_dim_names=("tp",))
    ab = sw.DeviceMesh("cpu", [1, 2], mesh_dim_names=("tp",))
    dp = sw.DeviceMesh("cpu", [[2], [3]], mesh_dim_names=("dp", "tp"))
    only_dp = sw.DeviceMesh("cpu", [2, 3], mesh_dim_names=("dp",))
    narrow = sw.DeviceMesh("cpu", [0], mesh_dim_names=("tp",))
    model = _model()
    with pytest.raises(ValueError, match=r"rank 1 is in stage meshes 0 and 1: the stages' meshes must not overlap"):
        DistributedPipe(model, [3, 3], [a, ab], tp_plan=PLAN, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"the stage meshes have \[1, 2\] data-parallel replicas"):
        DistributedPipe(model, [3, 3], [a, dp], tp_plan=PLAN, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"stage mesh 1 \(shape \(2,\) \('dp',\), ranks \[2, 3\]\) must be a \('tp',\)"):
        DistributedPipe(model, [3, 3], [a, only_dp], tp_plan=PLAN, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] are in none of the stage meshes"):
        DistributedPipe(model, [3, 3], [narrow, sw.DeviceMesh("cpu", [1], mesh_dim_names=("tp",))], tp_plan=PLAN,
                        loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"stage meshes \[0, 1\] have tp rows of \[2, 2\] ranks but there is no tp_plan"):
        DistributedPipe(model, [3, 3], [a, b], loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"runs one stage per pp rank, so balance needs 2 entries"):
        DistributedPipe(model, [2, 2, 2], [a, b], tp_plan=PLAN, loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match=r"or a list of one DeviceMesh per stage"):
        DistributedPipe(model, [3, 3], [a, "b"], tp_plan=PLAN, loss_fn=F.mse_loss)
    shared = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)).double()
    shared[1].weight = shared[0].weight
    wide = sw.DeviceMesh("cpu", [[0, 1, 2]], mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"parameter 0.weight of stage 0 is shared by stages on pp indices \[0, 1\], "
                                         r"whose tp rows have \[3, 1\] ranks: under shard_parameters=True"):
        DistributedPipe(shared, [1, 1], [wide, sw.DeviceMesh("cpu", [[3]], mesh_dim_names=("dp", "tp"))],
                        tp_plan={"0": ColwiseParallel()}, shard_parameters=True, loss_fn=F.mse_loss)


def test_bad_stage_meshes_are_refused_by_name() -> None:
    run_distributed(_refusals, 4, timeout=120)


# -- a parameter tied across stages of different widths ------------------------------------------

def _tied_model() -> nn.Sequential:
    model = _model()
    model[3].weight = model[0].weight  # stage 0's first projection and stage 1's share one weight
    return model


def _tied_reference() -> list[dict[str, torch.Tensor]]:
    return [params for _, params in one_process(_tied_model(), ROWS, STEPS)]


def _tied(grids: list[Any]) -> list[dict[str, torch.Tensor]]:
    meshes = [sw.DeviceMesh("cpu", grid, mesh_dim_names=("tp",)) for grid in grids]
    pipe = DistributedPipe(_tied_model(), [3, 3], meshes, tp_plan=PLAN, schedule="1f1b", chunks=CHUNKS,
                           loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    params = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
        params.append({name.split(".", 2)[2]: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for name, p in pipe.named_parameters()})
    pipe.close()
    return params


@pytest.mark.parametrize("grids", [[[0, 1], [2]], [[0], [1, 2]]], ids=["tp2-tp1", "tp1-tp2"])
def test_a_parameter_tied_across_stages_of_different_widths_gets_the_whole_gradient(grids: list[Any]) -> None:
    # each copy is split over its own stage's row (column-parallel there): the holders swap their
    # gradients across meshes and sum them in pp order, so both copies step as the one weight does
    reference = _tied_reference()
    results = run_distributed(_tied, 3, grids, timeout=120)
    for rank, params in enumerate(results):
        assert "0.weight" in params[0] or "3.weight" in params[0]
        for step, want in enumerate(reference):
            for name, value in params[step].items():
                torch.testing.assert_close(value, want[name], rtol=0, atol=1e-10,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")


# -- interleaved: four stages on two meshes of different widths ---------------------------------

def _four_stages() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))]).double()


def _interleaved() -> tuple[Any, dict[str, torch.Tensor]]:
    meshes = [sw.DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",)), sw.DeviceMesh("cpu", [2], mesh_dim_names=("tp",))]
    plan = {**{str(3 * i): ColwiseParallel() for i in range(4)}, **{str(3 * i + 2): RowwiseParallel() for i in range(4)}}
    pipe = DistributedPipe(_four_stages(), [3, 3, 3, 3], meshes, tp_plan=plan, schedule="interleaved", chunks=4,
                           loss_fn=F.mse_loss)
    x, y = _batch(0)
    loss = pipe.step(x, y)
    grads = {name.split(".", 2)[2]: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for name, p in pipe.named_parameters()}
    pipe.close()
    return loss, grads


def test_interleaved_stages_alternate_between_meshes_of_different_widths() -> None:
    # stages 0 and 2 on the 2-wide mesh, 1 and 3 on the 1-wide one: every boundary crosses
    model = _four_stages()
    x, y = _batch(0)
    want = F.mse_loss(model(x), y)
    want.backward()
    results = run_distributed(_interleaved, 3, timeout=120)
    assert abs(results[2][0].item() - want.item()) < 1e-10
    reference = dict(model.named_parameters())
    for rank, (_, grads) in enumerate(results):
        assert len(grads) == 8, (rank, sorted(grads))  # two stages of two linear layers each
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name].grad, rtol=0, atol=1e-10, msg=lambda m: f"{rank} {name}: {m}")


def _no_dp_to_shard_over() -> None:
    meshes = [sw.DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",)), sw.DeviceMesh("cpu", [2], mesh_dim_names=("tp",))]
    with pytest.raises(ValueError, match=r"shard_parameters=True splits parameters over the data-parallel dim, but "
                                         r"the mesh has none: .*\('dp', 'tp'\) stage meshes"):
        DistributedPipe(_model(), [3, 3], meshes, tp_plan=PLAN, shard_parameters=True, loss_fn=F.mse_loss)


def test_zero3_over_stage_meshes_without_a_dp_dim_is_refused() -> None:
    run_distributed(_no_dp_to_shard_over, 3, timeout=60)
