"""Every pipeline schedule on 2 ranks, one core each: shardwise against torch's pipelining, bubbles measured and modelled.

A zero-bubble schedule fills idle time with the weights' half of each backward, so its gain
shows only where an idle stage is truly idle: each rank is pinned to a core of its own
(every thread, `os.sched_setaffinity`) with one intra-op thread, and the model is a stack
of square Linear blocks, where a forward, the inputs' gradients (I) and the weights' (W)
are one matmul each, as the cost model of `Schedule.bubble_fraction()` prices them (F = I =
W = 1, B = 2; but the first stage's input needs no gradient, so there I is empty and W
does the rest of the backward, 3 matmuls of a 2-block stage's 4). Per schedule, both
libraries' pipes are built on the same stages, checked once against one process (the loss
and every gradient of this rank's stages), then stepped in alternation, beside a shardwise
1F1B pipe of the same blocks (the baseline of the steps/s gain, timed in the same window,
since the load of this shared machine drifts); each of the row's shardwise steps runs
inside a `Timeline`, whose events go back to the parent, which merges the two ranks' per
step and takes the median idle fraction.

A span of the timeline covers an action from its start, receives included, so a rank that
waits for its input counts the wait as busy. The `compute` bubble trims each span to its
part after the last receive inside it (the pipe's receives are timed by wrapping its wire):
the idle fraction of the compute alone, the one the cost model predicts.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Settings, close, interleaved, per_repeat_max_median, quiet

__all__ = ["Case", "CASES", "CHUNKS", "BLOCKS", "sizes", "schedule_body", "schedule_row", "pinned"]

CHUNKS = 4
BLOCKS = 16  # Linear + ReLU blocks: 8 per stage on 1 stage per rank, 4 on 2 stages per rank
Span = tuple[Any, int, int, str, float, float]  # a TimelineEvent's fields: rank, stage, micro-batch, kind, start, end


@dataclass(frozen=True)
class Case:
    """One row: shardwise's `schedule=` name, torch's class, stages per rank, and the row's label."""

    schedule: str
    torch_class: str
    per_rank: int
    label: str


CASES = (
    Case("gpipe", "ScheduleGPipe", 1, "gpipe"),
    Case("1f1b", "Schedule1F1B", 1, "1f1b"),
    Case("interleaved", "ScheduleInterleaved1F1B", 2, "interleaved (v=2)"),
    Case("looped_bfs", "ScheduleLoopedBFS", 2, "looped_bfs (v=2)"),
    Case("zero_bubble", "ScheduleInterleavedZeroBubble", 1, "zero_bubble (ZB-H1)"),
    Case("zero_bubble", "ScheduleInterleavedZeroBubble", 2, "zero_bubble (v=2)"),
    Case("zbv", "ScheduleZBVZeroBubble", 2, "zbv"),
    Case("dualpipev", "ScheduleDualPipeV", 2, "dualpipev"),
)


def sizes(settings: Settings) -> tuple[int, int]:
    """(width of each Linear, rows per micro-batch): a forward of a few ms per block in a full run."""
    return (64, 4) if settings.quick else (1024, 128)


def _model(d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(BLOCKS)])


def _stage_ids(case: Case, rank: int, ranks: int) -> list[int]:
    """The stages `rank` holds: `rank`, `rank + ranks`, ... (looped), or `rank` and `2 ranks - 1 - rank` (V)."""
    if case.schedule in ("zbv", "dualpipev"):
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(case.per_rank)]


@contextlib.contextmanager
def pinned(core_index: int) -> Iterator[int]:
    """Every thread of this process on one core of the allowed ones (and one intra-op thread),
    restored afterwards: the pool's processes run other benchmarks next. Yields the core."""
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[core_index % len(allowed)]
    threads = torch.get_num_threads()

    def set_all(cores: set[int]) -> None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), cores)

    set_all({core})
    torch.set_num_threads(1)
    try:
        yield core
    finally:
        torch.set_num_threads(threads)
        set_all(set(allowed))


def schedule_body(settings: Settings, case: Case) -> dict[str, Any]:
    """On each rank, for one case: this rank's step samples of both libraries, shardwise's spans
    per timed step (as recorded, and trimmed to compute), the modelled bubble and the checks."""
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.pipeline import DistributedPipe

    rank, ranks = dist.get_rank(), dist.get_world_size()
    d, rows = sizes(settings)
    ref = _model(d)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows * CHUNKS, d, generator=g), torch.randn(rows * CHUNKS, d, generator=g)
    plain = copy.deepcopy(ref)
    loss = F.mse_loss(plain(x), y)
    loss.backward()
    ref_loss = loss.item()
    num_stages = case.per_rank * ranks
    per_stage = BLOCKS // num_stages
    mine = _stage_ids(case, rank, ranks)
    holds_last = num_stages - 1 in mine
    want = {s: list(nn.Sequential(*list(plain)[s * per_stage:(s + 1) * per_stage]).parameters()) for s in mine}
    mesh = sw.init_device_mesh("cpu", (ranks,), mesh_dim_names=("pp",))
    seen: set[str] = set()
    with pinned(rank) as core, quiet(seen), contextlib.ExitStack() as closing:
        pipe = DistributedPipe(copy.deepcopy(ref), [per_stage] * num_stages, mesh, schedule=case.schedule,
                               chunks=CHUNKS, loss_fn=F.mse_loss, checkpoint="never")
        closing.callback(pipe.close)
        result: dict[str, Any] = {"formula": pipe.schedule.bubble_fraction(), "sw_class": type(pipe.schedule).__name__,
                                  "core": core}
        sw_params = {s: list(pipe.partitions[str(s)].parameters()) for s in mine}
        result["sw_check"] = _check(_zeroed(pipe.parameters(), lambda: pipe.step(x, y)), ref_loss, sw_params, want,
                                    holds_last)
        steps: dict[str, Callable[[], Any]] = {}
        params = list(pipe.parameters())
        torch_step, torch_params, error = _torch_pipe(case, ref, mine, num_stages, per_stage, x, y)
        if torch_step is not None:
            try:
                torch_loss = _zeroed(_flat(torch_params), torch_step)
            except Exception as exc:  # noqa: BLE001 -- both ranks raise: torch refuses the case, a result
                error = _text(exc)
            else:
                result["torch_check"] = _check(torch_loss, ref_loss, torch_params, want, holds_last)
                steps["torch"], params = torch_step, params + _flat(torch_params)
        if error is not None:
            result["torch_error"] = error
        if case.schedule != "1f1b":  # the baseline of the steps/s gain, timed in the same window (load drifts)
            base = DistributedPipe(copy.deepcopy(ref), [BLOCKS // ranks] * ranks, mesh, schedule="1f1b", chunks=CHUNKS,
                                   loss_fn=F.mse_loss, checkpoint="never")
            closing.callback(base.close)
            steps["shardwise_1f1b"], params = functools.partial(base.step, x, y), params + list(base.parameters())
        result.update(_time(settings, pipe, x, y, steps, params))
    result["warnings"] = sorted(seen)
    return result


def _time(settings: Settings, pipe: Any, x: torch.Tensor, y: torch.Tensor, others: dict[str, Callable[[], Any]],
          params: list[nn.Parameter]) -> dict[str, Any]:
    """Warm-up, then the steps in alternation: this pipe's inside a Timeline, and the others'."""
    import torch.distributed as dist

    from shardwise.pipeline import Timeline

    waits = _watch_receives(pipe)
    events: list[list[Span]] = []
    computes: list[list[Span]] = []

    def sw_step() -> None:
        del waits[:]
        with Timeline() as tl:
            pipe.step(x, y)
        spans = [(e.rank, e.stage, e.microbatch, e.kind, e.start, e.end) for e in tl.events]
        events.append(spans)
        computes.append(_trim(spans, waits))

    steps = {"shardwise": sw_step, **others}

    def before() -> None:
        for p in params:
            p.grad = None
        dist.barrier()

    for _ in range(max(settings.warmup // 20, 2)):
        for fn in steps.values():
            before()
            fn()
    events.clear()
    computes.clear()
    samples = interleaved(steps, settings.repeats, before=before)
    return {"samples": samples, "events": events, "compute_events": computes}


def _watch_receives(pipe: Any) -> list[tuple[float, float]]:
    """Each receive's (start, end) from now on, appended as the pipe's wire returns it (a wrapper
    on this pipe's wire alone); none are seen if the pipe keeps its wire elsewhere."""
    waits: list[tuple[float, float]] = []
    wire = getattr(getattr(pipe, "_context", None), "wire", None)
    if wire is None:
        return waits
    inner = wire.receive

    def receive(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            waits.append((start, time.perf_counter()))

    wire.receive = receive
    return waits


def _trim(spans: list[Span], waits: list[tuple[float, float]]) -> list[Span]:
    """Each span from the end of the last receive inside it: the action's compute (and sends)."""
    out = []
    for rank, stage, i, kind, start, end in spans:
        begin = max([w_end for w_start, w_end in waits if start <= w_start and w_end <= end], default=start)
        out.append((rank, stage, i, kind, begin, end))
    return out


def _text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _flat(params: dict[int, list[nn.Parameter]]) -> list[nn.Parameter]:
    return [p for ps in params.values() for p in ps]


def _zeroed(params: Any, step: Callable[[], Any]) -> Any:
    for p in params:
        p.grad = None
    return step()


def _check(loss: Any, ref_loss: float, got: dict[int, list[nn.Parameter]], want: dict[int, list[nn.Parameter]],
           holds_last: bool) -> str:
    """"ok", or what differs from one process: the loss (on the last stage's rank) or a stage's gradients."""
    wrong = []
    value = None if loss is None else float(loss.detach())
    if holds_last and (value is None or abs(value - ref_loss) > 1e-4 * max(1.0, abs(ref_loss))):
        wrong.append(f"loss {value} != {ref_loss}")
    for s, ps in got.items():
        if len(ps) != len(want[s]) or not all(
                p.grad is not None and q.grad is not None and close(p.grad, q.grad, 1e-3) for p, q in zip(ps, want[s])):
            wrong.append(f"stage {s} gradients")
    return "ok" if not wrong else "; ".join(wrong)


def _torch_pipe(case: Case, ref: nn.Sequential, mine: list[int], num_stages: int, per_stage: int,
                x: torch.Tensor, y: torch.Tensor
                ) -> tuple[Optional[Callable[[], Any]], dict[int, list[nn.Parameter]], Optional[str]]:
    """torch.distributed.pipelining's schedule on the same stages: (its step, this rank's
    parameters by stage, None), or (None, {}, the error's text) when torch refuses the case."""
    import torch.distributed.pipelining as pp
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    model = copy.deepcopy(ref)
    modules = {s: nn.Sequential(*list(model)[s * per_stage:(s + 1) * per_stage]) for s in mine}
    try:
        stages = [pp.PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
        cls = getattr(pp, case.torch_class)
        single = issubclass(cls, PipelineScheduleSingle)
        schedule = cls(stages[0] if single else stages, CHUNKS, loss_fn=F.mse_loss)
    except Exception as exc:  # noqa: BLE001 -- torch refusing a case is a result, recorded in the row
        return None, {}, _text(exc)
    first, last = 0 in mine, num_stages - 1 in mine
    losses: list[torch.Tensor] = []

    def step() -> Any:
        losses.clear()
        args = (x,) if first else ()
        if last:
            schedule.step(*args, target=y, losses=losses)
            return torch.stack(losses).mean()
        schedule.step(*args)
        return None

    return step, {s: list(m.parameters()) for s, m in modules.items()}, None


def _bubble(per_rank: list[list[list[Span]]]) -> tuple[Optional[float], str]:
    """Median over steps of the merged ranks' idle fraction (None without steps), and that step drawn."""
    from shardwise.pipeline import Timeline, TimelineEvent

    steps = []
    for step in zip(*per_rank):
        tl = Timeline()
        for spans in step:
            tl.extend(TimelineEvent(*s) for s in spans)
        steps.append((tl.bubble_fraction(), tl))
    if not steps:
        return None, ""
    steps.sort(key=lambda ft: ft[0])
    _, tl = steps[(len(steps) - 1) // 2]  # the median step (the lower of two)
    return statistics.median(f for f, _ in steps), tl.render_text(96)


def _costed_bubble(case: Case, ranks: int, per_rank: list[list[list[Span]]]) -> Optional[float]:
    """The schedule's bubble when each action lasts its measured median (per kind and stage, from
    the compute spans): the formula's model with this machine's costs in place of F = I = W = 1,
    B = 2 (here W's matmul is slower than F's, and the first stage's I is empty), so the gap
    between it and the measured bubble is the execution's, not the cost model's."""
    from shardwise import pipeline as engine
    from shardwise.planner import step_seconds

    lasted: dict[tuple[str, int], list[float]] = {}
    for steps in per_rank:
        for spans in steps:
            for _, stage, _, kind, start, end in spans:
                lasted.setdefault((kind, stage), []).append(end - start)
    if not lasted:
        return None
    made = {"gpipe": lambda: engine.ScheduleGPipe(ranks, CHUNKS), "1f1b": lambda: engine.Schedule1F1B(ranks, CHUNKS),
            "interleaved": lambda: engine.ScheduleInterleaved1F1B(ranks, case.per_rank, CHUNKS),
            "looped_bfs": lambda: engine.ScheduleLoopedBFS(ranks, case.per_rank, CHUNKS),
            "zero_bubble": lambda: engine.ScheduleInterleavedZeroBubble(ranks, case.per_rank, CHUNKS),
            "zbv": lambda: engine.ScheduleZBVZeroBubble(ranks, CHUNKS),
            "dualpipev": lambda: engine.ScheduleDualPipeV(ranks, CHUNKS)}[case.schedule]()
    median = {key: statistics.median(times) for key, times in lasted.items()}
    return step_seconds(made, lambda a: median.get((a.kind, a.stage), 0.0))[1]


def schedule_row(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The table row of one case from both ranks' results."""
    first = per_rank[0]
    row: dict[str, Any] = {"schedule": case.label, "stages": f"{case.per_rank * len(per_rank)} ({first['sw_class']})",
                           "torch_class": case.torch_class, "formula": first["formula"],
                           "cores": [r["core"] for r in per_rank]}
    for who in ("shardwise", "torch", "shardwise_1f1b"):
        ms = per_repeat_max_median([r["samples"].get(who, []) for r in per_rank])
        row[f"{who}_ms"] = None if ms is None else ms * 1e3
    if case.schedule == "1f1b":
        row["shardwise_1f1b_ms"] = row["shardwise_ms"]
    if row["shardwise_ms"] and row["shardwise_1f1b_ms"]:
        row["vs_1f1b"] = row["shardwise_1f1b_ms"] / row["shardwise_ms"]  # steps/s over 1F1B's, same window
    errors = sorted({r["torch_error"] for r in per_rank if "torch_error" in r})
    if errors:
        row["torch_error"] = row["torch_ms"] = " / ".join(errors)
    elif row["shardwise_ms"] is not None and row["torch_ms"]:
        row["ratio"] = row["shardwise_ms"] / row["torch_ms"]
    row["bubble"], _ = _bubble([r["events"] for r in per_rank])
    row["compute_bubble"], row["compute_timeline"] = _bubble([r["compute_events"] for r in per_rank])
    row["costed_bubble"] = _costed_bubble(case, len(per_rank), [r["compute_events"] for r in per_rank])
    wrong = [f"shardwise rank {k}: {r['sw_check']}" for k, r in enumerate(per_rank) if r["sw_check"] != "ok"]
    wrong += [f"torch rank {k}: {r['torch_check']}" for k, r in enumerate(per_rank)
              if r.get("torch_check", "ok") != "ok"]
    row["check"] = "ok" if not wrong else "WRONG: " + "; ".join(wrong)
    row["warnings"] = sorted({w for r in per_rank for w in r["warnings"]})
    return row
