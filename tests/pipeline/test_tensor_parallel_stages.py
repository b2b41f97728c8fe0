"""Pipeline stages that are tensor-parallel: `DistributedPipe(..., tp_plan=...)` on (pp, tp)
and (pp, dp, tp) meshes.

An MLP of two stages, each stage a column- then row-parallel pair, with the activation that
crosses the stage boundary a DTensor split by rows over tp (`Shard(0)`): each tp rank of
stage 0 sends only its rows to the rank of stage 1 with the same tp index. Trained with
1F1B and AdamW against the same model in one process (float64): losses, and every
parameter after every step, agree to 1e-10; the activation bytes each rank sends per
micro-batch are its piece's, half the micro-batch's. On 8 ranks the same pipeline runs on
each of 2 data-parallel replicas with half the batch each.

Then the demo's GPT (embeddings tied to the LM head across the first and last stage) on a
(pp, dp, tp) = (2, 2, 2) mesh of 8 processes with 1F1B, Megatron cuts over tp, vocab-split
logits under loss_parallel, and ZeRO-3 over dp: 5 AdamW steps with the one-process
parameters after every step (float64, 1e-10), every large matrix holding a quarter of its
elements per rank, and each stage-boundary message exactly the rank's activation piece.

Last, a skip connection whose stashed tensor is a column-split DTensor goes straight from
stage 0 to the popping layer in stage 1 as each rank's piece, with exact gradients.
"""

from __future__ import annotations

import functools

import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import DTensor, Shard, comm_log
from shardwise._comm import P2PRecord
from shardwise.parallel import ColwiseParallel, RowwiseParallel
from shardwise.parallel._data_parallel import _Reducer
from shardwise.pipeline import DistributedPipe
from shardwise.pipeline._wire import HEADER
from shardwise.pipeline.skip import pop, skippable, stash
from shardwise.testing import run_distributed

from ._mlp import D, PLAN, batch, mlp, one_process

H, ROWS, CHUNKS, STEPS = 16, 8, 2, 3


_model = functools.partial(mlp, H)  # module-level names: the worker processes import them
_batch = functools.partial(batch, rows=ROWS)


def _train(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    pipe = DistributedPipe(_model(), [3, 3], mesh, tp_plan=PLAN, schedule="1f1b", chunks=CHUNKS, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    dp, d = (mesh.size("dp"), mesh.get_local_rank("dp")) if "dp" in names else (1, 0)
    losses, params, activation_bytes = [], [], []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        with comm_log() as records:
            loss = pipe.step(x.chunk(dp)[d], y.chunk(dp)[d])
        opt.step()
        losses.append(None if loss is None else loss.item())
        params.append({name.split(".", 2)[2]: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for name, p in pipe.named_parameters()})
        sent = [r for r in records if isinstance(r, P2PRecord) and r.op == "send" and "activation" in r.label]
        activation_bytes.append([r.bytes_sent - HEADER * 8 for r in sent])  # each message: a header, the piece inside
    return {"losses": losses, "params": params, "activation_bytes": activation_bytes,
            "holds": sorted({name.split(".")[1] for name, _ in pipe.named_parameters()}),
            "tp_params": all(isinstance(p, DTensor) for p in pipe.parameters())}


@pytest.mark.parametrize(("shape", "names"), [((2, 2), ("pp", "tp")), ((2, 2, 2), ("pp", "dp", "tp"))],
                         ids=["pp2-tp2", "pp2-dp2-tp2"])
def test_tensor_parallel_stages_train_like_one_process(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    reference = one_process(_model(), ROWS, STEPS)
    results = run_distributed(_train, math.prod(shape), shape, names, timeout=300)
    dp = 2 if "dp" in names else 1
    for rank, r in enumerate(results):
        assert r["tp_params"], rank  # every parameter of every stage is sharded over tp
        last = r["holds"] == ["1"]
        for step, (want_loss, want_params) in enumerate(reference):
            if last and dp == 1:
                assert abs(r["losses"][step] - want_loss) < 1e-10, (rank, step)
            for name, value in r["params"][step].items():
                torch.testing.assert_close(value, want_params[name], rtol=0, atol=1e-10,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        if not last:  # stage 0 sends its rows of each micro-batch's activation: the piece, not the whole
            piece = ROWS // dp // CHUNKS // 2 * D * 8
            assert r["activation_bytes"] == [[piece] * CHUNKS] * STEPS, (rank, r["activation_bytes"])
    if dp == 2:  # each replica's loss is its half's; their mean is the whole batch's
        for step, (want_loss, _) in enumerate(reference):
            halves = [r["losses"][step] for r in results if r["losses"][step] is not None]
            assert len(halves) == 4 and abs(sum(halves) / 4 - want_loss) < 1e-10, (step, halves)


def _refused() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with pytest.raises(ValueError, match=r"the tp dim 'tp' has 2 ranks but there is no tp_plan"):
        DistributedPipe(_model(), [3, 3], mesh, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"tp_plan patterns \['7'\] name no layer of the model"):
        DistributedPipe(_model(), [3, 3], mesh, tp_plan={**PLAN, "7": ColwiseParallel()}, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"tp_dim='pp' is also the pp dim"):
        DistributedPipe(_model(), [3, 3], mesh, tp_dim="pp", tp_plan=PLAN, loss_fn=F.mse_loss)


def test_contradictory_tensor_parallel_arguments_are_refused() -> None:
    run_distributed(_refused, 4, timeout=60)


# -- the demo's GPT, 3-D: pp x dp x tp with 1F1B and ZeRO-3 ----------------------------------------

GPT_STEPS, GPT_BATCH, GPT_CHUNKS = 5, 8, 2
SAME_NAME = {"embed.tok.weight": "tok.weight", "embed.pos.weight": "pos.weight", "final.ln_f.weight": "ln_f.weight",
             "final.ln_f.bias": "ln_f.bias", "final.head.weight": "tok.weight"}  # the head is tied to the tokens


def _gpt_plan() -> dict[str, Any]:
    from shardwise import Replicate

    col, row = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    return {"embed.tok": RowwiseParallel(input_layouts=Replicate(), use_local_output=False),
            "block*.attn.[qkv]": col, "block*.attn.proj": row, "block*.mlp.up": col, "block*.mlp.down": row,
            "final.head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from shardwise._demo.model import loss_fn
    from shardwise.parallel import loss_parallel

    with loss_parallel():  # vocab-split logits
        return loss_fn(logits, targets)


def _gpt() -> Any:
    from shardwise._demo.data import CharData
    from shardwise._demo.model import CharGPT, CharGPTConfig

    data = CharData()
    torch.manual_seed(0)
    return CharGPT(CharGPTConfig(vocab=data.vocab)).double(), data


def _gpt_reference() -> list[tuple[float, dict[str, torch.Tensor]]]:
    from shardwise._demo.model import loss_fn

    model, data = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    out = []
    for step in range(GPT_STEPS):
        x, y = data.batch(step, GPT_BATCH, model.cfg.seq)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _gpt_3d() -> dict[str, Any]:
    from shardwise._demo.model import pipeline_layers

    mesh = sw.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    model, data = _gpt()
    pipe = DistributedPipe(pipeline_layers(model), [2, 2], mesh, tp_plan=_gpt_plan(), shard_parameters=True,
                           schedule="1f1b", chunks=GPT_CHUNKS, loss_fn=_gpt_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.01)
    d = mesh.get_local_rank("dp")
    losses, params, activation_bytes, flushes = [], [], [], []
    for step in range(GPT_STEPS):
        x, y = data.batch(step, GPT_BATCH, model.cfg.seq)
        with comm_log() as records, mock.patch.object(_Reducer, "flush", autospec=True,
                                                      side_effect=_Reducer.flush) as flush:
            loss = pipe.step(x.chunk(2)[d], y.chunk(2)[d])
        flushes.append(flush.call_count)  # the dp average of replicated gradients: once per step
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
        params.append({n.split(".", 2)[2]: p.full_tensor().detach().clone() for n, p in pipe.named_parameters()})
        sent = [r for r in records if isinstance(r, P2PRecord) and r.op == "send" and "activation" in r.label]
        activation_bytes.append([r.bytes_sent - HEADER * 8 for r in sent])
    sharded = {n: (tuple(p.to_local().shape), tuple(p.shape), tuple(p.placements)) for n, p in pipe.named_parameters()}
    return {"losses": losses, "params": params, "activation_bytes": activation_bytes, "sharded": sharded,
            "flushes": flushes,
            "stage": mesh.get_local_rank("pp"), "d_model": model.cfg.d_model, "seq": model.cfg.seq}


def test_the_demo_gpt_trains_on_pp_dp_tp_with_1f1b_and_zero3_like_one_process() -> None:
    reference = _gpt_reference()
    results = run_distributed(_gpt_3d, 8, timeout=600)
    for rank, r in enumerate(results):
        for step, (want_loss, want_params) in enumerate(reference):
            for name, value in r["params"][step].items():
                torch.testing.assert_close(value, want_params[SAME_NAME.get(name, name.replace("block", "blocks.", 1))],
                                           rtol=0, atol=1e-10, msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        assert r["flushes"] == [1] * GPT_STEPS, r["flushes"]  # not once per micro-batch (nor per recomputation)
        # ZeRO-3 over dp on top of tp: the big matrices hold a quarter of their elements on each rank
        big = {n: v for n, v in r["sharded"].items() if n.endswith(("q.weight", "up.weight", "down.weight"))}
        assert big and all(math.prod(local) * 4 == math.prod(whole) for local, whole, _ in big.values()), big
        if r["stage"] == 0:  # the activation crossing to stage 1: a replicated (tp) piece of the micro-batch, as is
            piece = GPT_BATCH // 2 // GPT_CHUNKS * r["seq"] * r["d_model"] * 8
            assert r["activation_bytes"] == [[piece] * GPT_CHUNKS] * GPT_STEPS, r["activation_bytes"]
    for step, (want_loss, _) in enumerate(reference):  # the two dp replicas' mean losses average to the batch's
        halves = [r["losses"][step] for r in results if r["losses"][step] is not None]
        assert len(halves) == 4 and abs(sum(halves) / 4 - want_loss) < 1e-10, (step, halves, want_loss)


# -- a skip connection carrying a DTensor from stage to stage -------------------------------------

@skippable(stash=["h"])
class _Stash(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        yield stash("h", x)  # the hidden activation, split by columns over tp
        return x


@skippable(pop=["h"])
class _Pop(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        h = yield pop("h")
        return x * h


def _skip_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), _Stash(), nn.Linear(H, D), nn.Linear(D, H), _Pop(), nn.Linear(H, D)).double()


SKIP_PLAN = {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(use_local_output=False),
             "3": ColwiseParallel(use_local_output=False), "5": RowwiseParallel()}


def _skip_across_tp_stages() -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pipe = DistributedPipe(_skip_model(), [3, 3], mesh, tp_plan=SKIP_PLAN, schedule="1f1b", chunks=CHUNKS,
                           loss_fn=F.mse_loss)
    x, y = _batch(0)
    with comm_log() as records:
        loss = pipe.step(x, y)
    skips = [r.bytes_sent - HEADER * 8 for r in records if isinstance(r, P2PRecord) and r.op == "send"
             and "skip 'h'" in r.label and "gradient" not in r.label]
    grads = {name.split(".", 2)[2]: p.grad.full_tensor() for name, p in pipe.named_parameters()}
    return {"loss": None if loss is None else loss.item(), "grads": grads, "skip_pieces": skips}


def test_a_skip_connection_carries_a_dtensor_piece_straight_to_the_popping_stage() -> None:
    model = _skip_model()
    x, y = _batch(0)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    results = run_distributed(_skip_across_tp_stages, 4, timeout=120)
    for rank, r in enumerate(results):
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, rtol=0, atol=1e-10,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        if r["loss"] is not None:
            assert abs(r["loss"] - loss.item()) < 1e-10
        else:  # stage 0 sends each micro-batch's skip as its column piece: rows x H / 2 float64
            assert r["skip_pieces"] == [ROWS // CHUNKS * H // 2 * 8] * CHUNKS, r["skip_pieces"]


# -- interleaved 1F1B: two tensor-parallel stages on each pp rank ---------------------------------

def _four_stages() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))]).double()


def _interleaved() -> dict[str, torch.Tensor]:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    plan = {f"{3 * i}": ColwiseParallel() for i in range(4)}
    plan.update({f"{3 * i + 2}": RowwiseParallel(use_local_output=False) for i in range(4)})  # R DTensors cross
    pipe = DistributedPipe(_four_stages(), [3] * 4, mesh, tp_plan=plan, schedule="interleaved", chunks=2,
                           loss_fn=F.mse_loss)
    pipe.step(*_batch(0))
    return {name.split(".", 2)[2]: p.grad.full_tensor() for name, p in pipe.named_parameters()}


def test_interleaved_stages_are_tensor_parallel_too() -> None:
    model = _four_stages()
    F.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
    want = dict(model.named_parameters())
    for rank, grads in enumerate(run_distributed(_interleaved, 4, timeout=120)):
        assert len(grads) == 8  # two stages of two linears each on every rank
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name].grad, rtol=0, atol=1e-10, msg=lambda m: f"rank {rank} {name}: {m}")
