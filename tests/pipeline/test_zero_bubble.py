"""Every schedule, the zero-bubble ones included, is exact and composes with dp, tp and cp.

For each of gpipe, 1f1b, interleaved, looped_bfs, zero_bubble (ZB-H1 with one stage per rank,
interleaved with two), zbv and dualpipev on 2 processes: 3 AdamW steps of a float64 model
with and without skip connections (the skip model of `test_ranks`) leave every parameter
within 1e-10 of one process's; the skip model also under `shardwise.compile` (step 1 eager,
step 2 traced, step 3 replayed: one program), with checkpointing off (the zero-bubble
backwards really split into I and W) and on for all micro-batches but the last (a
checkpointed micro-batch's backward stays whole, beside split ones).

On 4 processes, the same for the split-backward schedules (zero_bubble, zbv, dualpipev) on
(2, 2) meshes of the pp dim with
- dp and ZeRO-3 stages (`shard_parameters=True`), each replica half the batch; counted from
  `comm_log()`: each stage's replicated gradient (a scalar, which ZeRO-3 cannot split) is
  averaged by one all_reduce per step, after the stage's last backward or W (W's are kept
  unreduced under `no_sync` until then), and each sharded block by one reduce_scatter per
  backward (or W) of each micro-batch;
- tp, each stage column- then row-parallel (`tp_plan`);
- cp, causal attention over the whole sequence (`cp_dim`; 9 tokens in pieces of 5 and 4);
and, beside the split backwards, checkpointed micro-batches in ZBV, and (dp and tp) a compiled
and replayed ZBV step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import DTensor, comm_log
from shardwise._compile import CompiledFunction
from shardwise.parallel import ColwiseParallel, RowwiseParallel
from shardwise.pipeline import DistributedPipe
from shardwise.testing import run_distributed

from .test_ranks import D, skip_model

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "zero_bubble", "zbv", "dualpipev")
ONE_PER_RANK = {"gpipe", "1f1b"}  # the others here run two stages per rank on 2 pp ranks
ROWS, CHUNKS, STEPS, LR, TOL = 10, 4, 3, 0.05, 1e-10


def _balance(schedule: str, layers: int, stages: int = 0) -> list[int]:
    """Two stages (one per pp rank) for gpipe and 1f1b, four (two per rank) for the others, or `stages`."""
    stages = stages or (2 if schedule in ONE_PER_RANK else 4)
    return [layers // stages] * stages


def _batch(step: int, rows: int = ROWS, shape: tuple[int, ...] = (D,)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, *shape, generator=g, dtype=torch.float64),
            torch.randn(rows, *shape, generator=g, dtype=torch.float64))


def _plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(),
                         nn.Linear(D, D), nn.Linear(D, D)).double()


def _skip_model() -> nn.Sequential:
    return skip_model().double()


MODELS: dict[str, Callable[[], nn.Sequential]] = {"plain": _plain_model, "skips": _skip_model}


def _one_process(model: nn.Module, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Every parameter after `steps` AdamW steps of `model` in one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batches(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _held(pipe: DistributedPipe) -> dict[str, torch.Tensor]:
    """This rank's parameters, whole, under the model's own names."""
    return {name.split(".", 2)[2]: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in pipe.named_parameters()}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got, "this rank holds no parameter"
    return max((g - want[n]).abs().max().item() for n, g in got.items())


def _pipe_step(pipe: DistributedPipe, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    opt.zero_grad()
    loss = pipe.step(x, y)
    opt.step()
    return loss


# -- exactness on 2 ranks ---------------------------------------------------------------------

# way -> (checkpoint, compiled): split backwards, or checkpointed micro-batches (whole) beside a split
# last one; eager, or under shardwise.compile (step 1 eager: it makes AdamW's state; 2 traced; 3 replayed)
WAYS = {"eager": ("never", False), "checkpointed": ("except_last", False), "compiled": ("never", True),
        "compiled checkpointed": ("except_last", True)}


def _exact(schedule: str, stages: int) -> dict[str, float]:
    """The worst parameter difference from one process, per model and way of running."""
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    out = {}
    for which, build in MODELS.items():
        reference = build()
        want = _one_process(copy.deepcopy(reference), _batch)
        for way, (checkpoint, compiled) in WAYS.items():
            if way != "eager" and which == "plain":
                continue  # (the skip model covers the other ways: the suite's time)
            pipe = DistributedPipe(copy.deepcopy(reference), _balance(schedule, 8, stages), mesh, schedule=schedule,
                                   chunks=CHUNKS, checkpoint=checkpoint, loss_fn=F.mse_loss)
            opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
            step = sw.compile(_pipe_step) if compiled else _pipe_step
            for k in range(STEPS):
                step(pipe, opt, *_batch(k))
            if isinstance(step, CompiledFunction):  # one program, traced at step 2, replayed at step 3
                assert step.programs() == 1 and step.eager() == 0, (schedule, which, step.programs(), step.eager())
            out[f"{which} {way}"] = _worst(_held(pipe), want)
            pipe.close()
    return out


@pytest.mark.parametrize("schedule, stages", [(s, 0) for s in SCHEDULES] + [("zero_bubble", 2)],
                         ids=[*SCHEDULES, "zb-h1"])  # zero_bubble with 2 stages on 2 ranks is ZB-H1, with 4 interleaved
def test_every_schedule_trains_like_one_process(schedule: str, stages: int) -> None:
    for rank, worst in enumerate(run_distributed(_exact, 2, schedule, stages, timeout=600)):
        assert all(w <= TOL for w in worst.values()), (schedule, rank, worst)


# -- compositions on 4 ranks ------------------------------------------------------------------

class Scale(nn.Module):
    """x times a scalar parameter: ZeRO-3 has no tensor dim to split it by, so it stays
    replicated over dp and its gradient is averaged once per step."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _scaled_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for i in range(4) for m in (nn.Linear(D, D), nn.Tanh() if i < 3 else nn.Identity(),
                                                          Scale())]).double()


def _dp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(step, 2 * ROWS)  # each of the 2 dp replicas takes half


H = 16


def _tp_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))]).double()


TP_PLAN = {**{str(3 * i): ColwiseParallel() for i in range(4)},
           **{str(3 * i + 2): RowwiseParallel(use_local_output=False) for i in range(4)}}  # replicated DTensors cross


SEQ, HEADS = 9, 2  # 9 tokens over 2 cp ranks: pieces of 4 and 5


class Attention(nn.Module):
    """Causal self-attention over (batch, seq, D) with a residual: under a cp dim, each rank's
    queries attend over the whole sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, n, D / heads)
        out: torch.Tensor = x + self.out(a.transpose(1, 2).reshape(b, n, D))
        return out


def _cp_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (Attention(), nn.Linear(D, D))]).double()


def _cp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(step, ROWS, (SEQ, D))


# kind -> (mesh dim names, model, batches, DistributedPipe arguments); the mesh is (2, 2)
COMPOSITIONS: dict[str, tuple[tuple[str, str], Callable[[], nn.Sequential], Callable[[int], Any], dict[str, Any]]] = {
    "dp x pp, ZeRO-3": (("dp", "pp"), _scaled_model, _dp_batch, {"shard_parameters": True}),
    "tp x pp": (("pp", "tp"), _tp_model, _batch, {"tp_plan": TP_PLAN}),
    "cp x pp": (("pp", "cp"), _cp_model, _cp_batch, {}),
}
# (schedule, checkpoint, compiled): the schedules whose backwards split (checkpointing off; the others
# compose as tests/pipeline's dp, tp and cp tests show), and ZBV also with checkpointed micro-batches,
# whose backwards stay whole, beside split ones
CASES = [(s, "never", False) for s in ("zero_bubble", "zbv", "dualpipev")] + [("zbv", "except_last", False)]
COMPILED = ("zbv", "never", True)  # and a replayed ZBV step (not under cp: its steps agree on the sequence length)


def _compose(kind: str, cases: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
    """Per case: this rank's parameters after the steps, its stage and ZeRO-3 block counts, and
    per step the dp all_reduces and reduce_scatters it issued (and which came last)."""
    from shardwise.experimental import set_load_balance, set_rotate_method

    set_rotate_method("allgather")  # (process-wide cp settings, which outlive a test in the worker pool)
    set_load_balance(True)
    names, build, batches, options = COMPOSITIONS[kind]
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    dp, d = (2, mesh.get_local_rank("dp")) if "dp" in names else (1, 0)
    out = []
    for schedule, checkpoint, compiled in cases:
        model = build()
        pipe = DistributedPipe(model, _balance(schedule, len(model)), mesh, schedule=schedule, chunks=CHUNKS,
                               checkpoint=checkpoint, loss_fn=F.mse_loss, **options)
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        step = sw.compile(_pipe_step) if compiled else _pipe_step
        counts = []
        for k in range(STEPS):
            x, y = batches(k)
            with comm_log() as log:  # (under cp, every cp rank passes the whole sequences)
                step(pipe, opt, x.chunk(dp)[d], y.chunk(dp)[d])
            ops = [r.op for r in log if r.op in ("all_reduce", "reduce_scatter")]
            counts.append((ops.count("all_reduce"), ops.count("reduce_scatter"), ops[-1] if ops else None))
        if isinstance(step, CompiledFunction):  # step 1 eager, step 2 traced, step 3 replayed
            assert step.programs() == 1 and step.eager() == 0, (kind, schedule, step.programs(), step.eager())
        out.append({"held": _held(pipe), "counts": counts, "stages": len(pipe.stages),
                    "blocks": sum(isinstance(m, nn.Linear) for m in pipe.modules()),  # ZeRO-3's units
                    "tp": all(isinstance(p, DTensor) for p in pipe.parameters())})
        pipe.close()
    return out


@pytest.mark.parametrize("kind", COMPOSITIONS)
def test_every_schedule_composes_with_dp_tp_and_cp(kind: str) -> None:
    _, build, batches, _ = COMPOSITIONS[kind]
    want = _one_process(build(), batches)
    cases = CASES + ([] if kind.startswith("cp") else [COMPILED])
    for rank, results in enumerate(run_distributed(_compose, 4, kind, cases, timeout=600)):
        for (schedule, checkpoint, compiled), r in zip(cases, results):
            what = (kind, schedule, f"checkpoint={checkpoint}", "compiled" * compiled, f"rank {rank}")
            assert _worst(r["held"], want) <= TOL, (*what, _worst(r["held"], want))
            if kind.startswith("tp"):
                assert r["tp"], what  # every parameter sharded over tp
            if kind.startswith("dp"):
                # one all_reduce (one bucket: the stage's scales) per stage and step, after the stage's
                # last backward or W; one reduce_scatter per backward (or W) of each sharded block
                want_counts = (r["stages"], CHUNKS * r["blocks"], "all_reduce")
                assert r["counts"] == [want_counts] * STEPS, (*what, r["counts"], want_counts)
