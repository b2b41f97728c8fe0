"""Sharded data parallel: torch's `fully_shard` against shardwise's, and `data_parallel(shard_parameters=True)`.

4 gloo ranks, a stack of pre-norm MLP blocks (width W, hidden 4W), AdamW, each rank its own
rows; every block a unit, then the model (torch's recipe, the same calls for both
`fully_shard`s). Per contender, in the same worker processes: peak memory of a
steady-state step (resident shards + optimizer state + batch, plus the highest point of
the allocator's running sum during the step, as `memory.py` counts it, the median of 3 to 7
steps), the median step
time (timed in rotating alternation after a barrier), and the collectives of one step
(shardwise's from its comm log, torch's by counting its `torch.distributed` calls); then the
host-side pieces alone: a forward under no_grad (every unit's pre-forward gather) and the
AdamW step (torch's default implementation choice for each library's DTensors).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ._common import Column, Settings, Table, close, interleaved, local_bytes, per_repeat_max_median, quiet, ratio
from .memory import peak_allocated

__all__ = ["body", "run"]

WHO = ("torch", "shardwise", "data_parallel")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)))


@contextlib.contextmanager
def _torch_collectives(counts: Counter[str]) -> Iterator[None]:
    """Count the torch.distributed collectives torch's FSDP2 calls (it looks them up at call time)."""
    import torch.distributed as dist

    names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_reduce")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")] += 1
            return fn(*args, **kwargs)
        return call

    for n, fn in saved.items():
        setattr(dist, n, counting(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _shard(who: str, model: nn.Module) -> nn.Module:
    if who == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (4,))
        for block in model:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
        return model
    import shardwise as sw

    mesh = sw.init_device_mesh("cpu", (4,))
    if who == "data_parallel":
        from shardwise.parallel import data_parallel

        return data_parallel(model, mesh, shard_parameters=True)
    from shardwise.fsdp import fully_shard

    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def body(settings: Settings) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    import shardwise as sw

    depth, width, rows = settings.fsdp
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    base = _model(depth, width)
    out: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], None]] = {}
    models: dict[str, nn.Module] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for who in WHO:
        model = _shard(who, copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

        with quiet():
            step()
            step()  # optimizer state made, forward order known
            opt.zero_grad(set_to_none=True)
            resident = (sum(local_bytes(p) for p in model.parameters()) + local_bytes(x)
                        + sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor)))
            # one step's peak depends on when gloo's worker thread lets go of a finished gather's
            # buffers (a race on a loaded machine, for torch's and ours alike): the median of several
            samples = []
            for _ in range(max(3, min(settings.repeats, 7))):
                opt.zero_grad(set_to_none=True)
                samples.append(peak_allocated(step))
            extra = sorted(samples)[len(samples) // 2]
            counts: Counter[str] = Counter()
            if who == "torch":
                with _torch_collectives(counts):
                    step()
            else:
                with sw.comm_log() as log:
                    step()
                counts.update(r.op for r in log)
        out[who] = {"resident": resident, "step_extra": extra, "peak": resident + extra,
                    "collectives": dict(counts)}
        steps[who] = step
        models[who] = model
        optimizers[who] = opt
    with quiet():
        samples = interleaved(steps, settings.repeats, before=dist.barrier)
        # host-side costs: a forward (the pre-forward hooks gather every unit), and the optimizer step alone
        with torch.no_grad():
            forwards = interleaved({who: (lambda m=models[who]: m(x)) for who in WHO}, settings.repeats,
                                   before=dist.barrier)
        for who in WHO:
            models[who](x).square().mean().backward()
        optimizer_steps = interleaved({who: optimizers[who].step for who in WHO}, settings.repeats,
                                      before=dist.barrier)
    # every contender took the same steps on the same rows: the same parameters, or the row says WRONG
    finals = {who: [p.full_tensor() for p in models[who].parameters()] for who in WHO}
    for who in WHO:
        out[who]["seconds"] = samples[who]
        out[who]["forward_seconds"] = forwards[who]
        out[who]["optimizer_seconds"] = optimizer_steps[who]
        same = all(close(a, b) for a, b in zip(finals[who], finals["torch"]))
        out[who]["check"] = "ok" if same else "WRONG"
    return out


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    depth, width, rows = settings.fsdp
    per_rank = run_distributed(body, 4, settings, timeout=settings.timeout)
    table = Table(
        "fsdp",
        f"sharded data parallel step: {depth} pre-norm MLP blocks ({width}->{4 * width}->{width}), {rows} rows per "
        f"rank, AdamW, 4 ranks; MiB per rank (largest rank)",
        [Column("who", "who"), Column("resident_mib", "resident", ".2f"), Column("step_extra_mib", "step extra", ".2f"),
         Column("peak_mib", "peak", ".2f"), Column("peak_vs_torch", "peak / torch", ".2f"),
         Column("step_ms", "step ms", ".1f"), Column("time_vs_torch", "time / torch", ".2f"),
         Column("forward_ms", "forward ms (no grad)", ".1f"), Column("optimizer_ms", "AdamW ms", ".1f"),
         Column("collectives", "collectives per step"), Column("check", "check")],
    )
    medians = {who: per_repeat_max_median([r[who]["seconds"] for r in per_rank]) for who in WHO}
    peaks = {who: max(r[who]["peak"] for r in per_rank) for who in WHO}
    for who in WHO:
        row: dict[str, Any] = {"who": who if who != "shardwise" else "shardwise fully_shard"}
        for key in ("resident", "step_extra", "peak"):
            row[key] = max(r[who][key] for r in per_rank)
            row[f"{key}_mib"] = row[key] / 2**20
        row["peak_vs_torch"] = ratio(peaks[who], peaks["torch"])
        for key in ("forward", "optimizer"):
            value = per_repeat_max_median([r[who][f"{key}_seconds"] for r in per_rank])
            row[f"{key}_ms"] = None if value is None else value * 1e3
        seconds = medians[who]
        row["step_ms"] = None if seconds is None else seconds * 1e3
        row["time_vs_torch"] = ratio(seconds, medians["torch"])
        counts = per_rank[0][who]["collectives"]
        row["collectives"] = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        row["collective_counts"] = counts
        row["check"] = "ok" if all(r[who]["check"] == "ok" for r in per_rank) else "WRONG"
        table.rows.append(row)
    table.notes.append("data_parallel is shardwise's ZeRO-3 (shard_parameters=True): the same units engine, "
                       "one unit per child of the model's outermost Sequential / ModuleList")
    return [table]
