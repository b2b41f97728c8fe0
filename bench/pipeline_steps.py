"""A pipeline's train step on 2 ranks: shardwise eager, replayed, torch's pipelining, and by hand.

An MLP (Linear, ReLU, Linear, Linear, ReLU, Linear) cut into two stages of three layers, one
per rank, trained with 1F1B over 4 micro-batches, mean-squared-error loss, then an AdamW
step. The contenders, stepped in one interleaved loop:

- `shardwise`: `DistributedPipe(schedule="1f1b", checkpoint="never")`, eager (no
  recomputation, as the others);
- `shardwise_compiled`: the same step through `shardwise.compile` (its first call makes the
  optimizer state, its second traces, every timed call replays; each message between the
  ranks is a host step of the graph that runs the same wire protocol, headers included);
- `torch`: `torch.distributed.pipelining` (`PipelineStage`, `Schedule1F1B`), eager;
- `hand`: the floor: the same 1F1B order written on this rank's stage with fixed-shape
  `isend` / `irecv` and nothing else (no headers, no failure handling), AdamW on its fused
  kernel (the one a replayed step uses).

A one-process copy of the whole model steps alongside; afterwards every copy's stage must
hold its parameters (the `check` column), and the compiled copy must have replayed one program.

Then one row per schedule (`_pipeline_schedules`): gpipe, 1f1b, interleaved, looped_bfs,
zero_bubble, zbv and dualpipev against torch's class of the same name, each rank pinned to
its own core, with the bubble measured on both ranks' merged `Timeline` beside the
schedule's `bubble_fraction()`, and the steps/s gain over a 1F1B pipe timed alongside.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Column, Settings, Table, close, interleaved, per_repeat_max_median, quiet, ratio
from ._pipeline_schedules import BLOCKS, CASES, sizes, schedule_body, schedule_row

__all__ = ["run", "pipeline_body", "HandPipe"]

CHUNKS = 4
COPIES = ("shardwise", "shardwise_compiled", "torch", "hand")


def _model(d: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d), nn.Linear(d, hidden), nn.ReLU(),
                         nn.Linear(hidden, d))


def one_f_one_b(stage: int, stages: int, chunks: int) -> list[tuple[str, int]]:
    """This stage's actions in 1F1B order: warm-up forwards, then one forward one backward, then the rest."""
    warm = min(stages - stage - 1, chunks)
    order = [("F", i) for i in range(warm)]
    for i in range(chunks - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(chunks - warm, chunks)]


class HandPipe:
    """One rank's stage of a 2-stage pipeline written by hand: fixed shapes, plain isend/irecv."""

    def __init__(self, stage: nn.Module, rank: int, rows: int, width: int) -> None:
        self.stage, self.rank = stage, rank
        self.order = one_f_one_b(rank, 2, CHUNKS)
        self.shape = (rows // CHUNKS, width)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        xs, ys = x.chunk(CHUNKS), y.chunk(CHUNKS)
        kept: dict[int, Any] = {}
        sends, loss = [], torch.zeros(())
        for kind, i in self.order:
            if self.rank == 0 and kind == "F":
                out = self.stage(xs[i])
                sends.append(dist.isend(out.detach(), 1, tag=i))
                kept[i] = out
            elif self.rank == 0:
                grad = torch.empty(self.shape)
                dist.recv(grad, 1, tag=CHUNKS + i)
                kept.pop(i).backward(grad)
            elif kind == "F":
                a = torch.empty(self.shape)
                dist.recv(a, 0, tag=i)
                a.requires_grad_(True)
                value = F.mse_loss(self.stage(a), ys[i]) / CHUNKS
                loss = loss + value.detach()
                kept[i] = (a, value)
            else:
                a, value = kept.pop(i)
                value.backward()
                sends.append(dist.isend(a.grad, 0, tag=CHUNKS + i))
        for work in sends:
            work.wait()
        return loss


def _stage_layers(model: nn.Sequential, rank: int) -> nn.Sequential:
    return nn.Sequential(*list(model)[3 * rank:3 * rank + 3])


def pipeline_body(settings: Settings) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import shardwise as sw
    from shardwise.pipeline import DistributedPipe

    d, hidden, batch = settings.mlp
    batch = max(batch, CHUNKS) // CHUNKS * CHUNKS
    rank = dist.get_rank()
    ref = _model(d, hidden)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
    plain = copy.deepcopy(ref)
    # no activation checkpointing (the default recomputes every micro-batch's forward but the
    # last): torch's schedule and the hand-written floor keep activations too
    pipe = DistributedPipe(copy.deepcopy(ref), [3, 3], sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)),
                           schedule="1f1b", chunks=CHUNKS, loss_fn=F.mse_loss, checkpoint="never")
    compiled_pipe = DistributedPipe(copy.deepcopy(ref), [3, 3],
                                    sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)), schedule="1f1b",
                                    chunks=CHUNKS, loss_fn=F.mse_loss, checkpoint="never")
    torch_stage = _stage_layers(copy.deepcopy(ref), rank)
    schedule = Schedule1F1B(PipelineStage(torch_stage, rank, 2, torch.device("cpu")), CHUNKS, loss_fn=F.mse_loss)
    hand = HandPipe(_stage_layers(copy.deepcopy(ref), rank), rank, batch, d)
    params: dict[str, list[nn.Parameter]] = {
        "plain": list(plain.parameters()), "shardwise": list(pipe.parameters()),
        "shardwise_compiled": list(compiled_pipe.parameters()), "torch": list(torch_stage.parameters()),
        "hand": list(hand.stage.parameters()),
    }
    opts = {k: torch.optim.AdamW(p, lr=1e-3, **({"fused": True} if k == "hand" else {})) for k, p in params.items()}

    def plain_step() -> None:
        opts["plain"].zero_grad()
        F.mse_loss(plain(x), y).backward()
        opts["plain"].step()

    def torch_step() -> None:
        opts["torch"].zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opts["torch"].step()

    def hand_step() -> None:
        opts["hand"].zero_grad()
        hand.step(x, y)
        opts["hand"].step()

    compiled = sw.compile(_pipe_step)
    steps: dict[str, Callable[[], Any]] = {
        "plain": plain_step, "shardwise": functools.partial(_pipe_step, pipe, opts["shardwise"], x, y),
        "shardwise_compiled": functools.partial(compiled, compiled_pipe, opts["shardwise_compiled"], x, y),
        "torch": torch_step, "hand": hand_step,
    }
    seen: set[str] = set()
    try:
        with quiet(seen):
            for fn in steps.values():
                for _ in range(max(settings.warmup // 10, 3)):  # the compiled copy: eager, traced, replayed
                    fn()
            samples = interleaved(steps, settings.repeats, before=dist.barrier)
    finally:
        pipe.close()
        compiled_pipe.close()
    mine = params["plain"][4 * rank:4 * rank + 4]  # this rank's stage: two Linears, weight and bias each
    checks = {k: len(params[k]) == 4 and all(close(p.detach(), q.detach(), 1e-3) for p, q in zip(params[k], mine))
              for k in COPIES}
    return {"samples": samples, "checks": checks, "programs": compiled.programs(), "warnings": sorted(seen)}


def _pipe_step(pipe: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    opt.zero_grad()
    loss = pipe.step(x, y)  # type: ignore[operator]
    opt.step()
    return loss


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    d, hidden, batch = settings.mlp
    width, rows = sizes(settings)
    table = Table(
        "pipeline_steps",
        f"pipeline train step on 2 ranks, {CHUNKS} micro-batches, ms per step: median over repeats of the slowest "
        "rank; bubbles: median idle fraction of both ranks' timeline against the schedule's formula",
        [Column("schedule", "schedule"), Column("model", "model"), Column("plain_ms", "1-process ms", ".2f"),
         Column("shardwise_ms", "shardwise ms", ".2f"), Column("shardwise_compiled_ms", "sw compiled ms", ".2f"),
         Column("torch_ms", "torch pipelining ms", ".2f"), Column("hand_ms", "hand-written ms", ".2f"),
         Column("ratio", "ratio sw/torch", ".2f"), Column("compiled_ratio", "ratio compiled/torch", ".2f"),
         Column("compiled_vs_hand", "ratio compiled/hand", ".2f"), Column("bubble", "bubble timeline", ".3f"),
         Column("compute_bubble", "bubble compute", ".3f"), Column("formula", "bubble formula", ".3f"),
         Column("costed_bubble", "bubble at measured costs", ".3f"),
         Column("vs_1f1b", "steps/s vs 1f1b", ".2f"), Column("check", "check")],
    )
    per_rank = run_distributed(pipeline_body, 2, settings, timeout=settings.timeout)
    row: dict[str, Any] = {"schedule": "1f1b (AdamW)", "model": f"MLP {d}->{hidden}->{d} x2 in 2 stages, batch {batch}"}
    for k in ("plain",) + COPIES:
        ms = per_repeat_max_median([r["samples"][k] for r in per_rank])
        row[f"{k}_ms"] = None if ms is None else ms * 1e3
    row["ratio"] = ratio(row["shardwise_ms"], row["torch_ms"])
    row["compiled_ratio"] = ratio(row["shardwise_compiled_ms"], row["torch_ms"])
    row["compiled_vs_hand"] = ratio(row["shardwise_compiled_ms"], row["hand_ms"])
    row["compiled_programs"] = [r["programs"] for r in per_rank]
    wrong = [k for k in COPIES if not all(r["checks"][k] for r in per_rank)]
    if row["compiled_programs"] != [1, 1]:
        wrong.append(f"shardwise_compiled (programs {row['compiled_programs']}, want 1)")
    row["check"] = "ok" if not wrong else "WRONG: " + ",".join(wrong)
    table.rows.append(row)
    warnings = {w for r in per_rank for w in r["warnings"]}
    for case in CASES:
        try:
            case_row = schedule_row(case, run_distributed(schedule_body, 2, settings, case, timeout=settings.timeout))
        except Exception as exc:  # a hang or a crash of one case: its row says so, the next cases still run
            case_row = {"schedule": case.label, "check": f"FAILED: {str(exc).strip().splitlines()[0][:300]}"}
        case_row["model"] = f"{BLOCKS} x (Linear {width}, ReLU) in {case.per_rank * 2} stages, batch {rows * CHUNKS}"
        warnings.update(case_row.pop("warnings", []))
        table.rows.append(case_row)
    for w in sorted(warnings):
        table.notes.append(f"warning: {w}")
    table.notes.append("hand-written: the same 1F1B order on this rank's stage with fixed-shape isend/irecv (no "
                       "headers, no failure handling) and fused AdamW, the floor a replayed step is measured against")
    table.notes.append("sw compiled: shardwise.compile over the eager step function; each message is a host step "
                       "running the same protocol as eager (a header, the payloads inside it up to 64 KiB); "
                       "shardwise's pipes run with checkpoint='never', as torch's schedule and the floor do")
    table.notes.append("schedule rows: forward and backward only (grads cleared between steps, no optimizer), each rank "
                       "pinned to its own core with one thread; 2 stages per rank where the schedule takes them; "
                       "check: loss and every gradient of both libraries against one process")
    table.notes.append("bubble timeline: the spans as the pipe records them (a receive's wait counted busy); bubble "
                       "compute: each span from the end of its last receive; formula: Schedule.bubble_fraction() "
                       "(F = I = W = 1, B = 2); bubble at measured costs: the same schedule run on the cost model with each "
                       "action's measured median time per kind and stage (the gap from it to the measured bubble is the "
                       "execution's; from the formula to it, the costs'); steps/s vs 1f1b: a shardwise 1F1B pipe's ms (the same blocks in 2 stages, stepped "
                       "in alternation with the row's pipes) over this row's shardwise ms")
    return [table]
