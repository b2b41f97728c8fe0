"""Per-op overhead on 8x8 fp32: shardwise and torch DTensor against the plain op on the local tensor.

Overhead is what a distributed tensor library adds to an op that needs no communication:
the DTensor call's time minus the same op's time on the local piece. All three (plain,
shardwise, torch) are timed in one interleaved loop on every rank of meshes (2,) and (4,)
(every rank must run the same DTensor program); a rank's overhead is the median over
repeats of (library sample - plain sample), and the table shows the slowest rank's. The
samples are many and short (`Settings.op_repeats` x `inner` calls) so that, with more
ranks than cores, most of them fall between two deschedulings of the process.
Before timing, each op's result is checked against the single-device op on the full tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._common import Column, interleaved, Settings, Table, close, max_over_ranks, median, quiet, ratio
from ._libs import LIBS, load

__all__ = ["OPS", "MESHES", "body", "run"]

Op = Callable[[Any, Any, Any], Any]  # (x, y, r): x and y split by rows, r replicated
OPS: dict[str, Op] = {
    "add": lambda x, y, r: x + y,
    "mul scalar": lambda x, y, r: x * 2.0,
    "mm S(0)xR": lambda x, y, r: torch.mm(x, r),
    "sum": lambda x, y, r: x.sum(),
    "view": lambda x, y, r: x.view(-1),
    "reshape": lambda x, y, r: x.reshape(-1, 16),
    "transpose": lambda x, y, r: x.transpose(0, 1),
    "relu": lambda x, y, r: torch.relu(x),
    "softmax": lambda x, y, r: F.softmax(x, dim=-1),
    "layer_norm": lambda x, y, r: F.layer_norm(x, (x.shape[-1],)),
}
MESHES = ((2,), (4,))


def body(settings: Settings, world: int) -> dict[str, Any]:
    """Every rank: check each op, then time plain / shardwise / torch interleaved. Seconds per call."""
    import torch.distributed as dist


    torch.manual_seed(0)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    args: dict[str, tuple[Any, Any, Any]] = {}
    for name in LIBS:
        lib = load(name)
        mesh = lib.mesh((world,))
        args[name] = (lib.distribute_tensor(a, mesh, [lib.Shard(0)]), lib.distribute_tensor(b, mesh, [lib.Shard(0)]),
                      lib.distribute_tensor(b, mesh, [lib.Replicate()]))
    args["plain"] = (args["shardwise"][0].to_local(), args["shardwise"][1].to_local(), b)
    seen: set[str] = set()
    out: dict[str, Any] = {"ops": {}}
    with quiet(seen):
        for op_name, op in OPS.items():
            want = op(a, b, b)
            result: dict[str, Any] = {}
            runnable: dict[str, Callable[[], object]] = {"plain": functools.partial(op, *args["plain"])}
            for name in LIBS:
                try:
                    got = op(*args[name]).full_tensor()
                    result[f"{name}_ok"] = close(got, want)
                    runnable[name] = functools.partial(op, *args[name])
                except Exception as exc:  # a library without this op: reported in the table, not fatal
                    result[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            for fn in runnable.values():
                for _ in range(settings.warmup):
                    fn()
            dist.barrier()
            samples = interleaved(runnable, settings.op_repeats, settings.inner)
            result["plain"] = median(samples["plain"])
            for name in LIBS:
                if name in samples:
                    result[name] = median(samples[name])
                    result[f"{name}_overhead"] = median([s - p for s, p in zip(samples[name], samples["plain"])])
            out["ops"][op_name] = result
    out["warnings"] = sorted(seen)
    return out


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    table = Table(
        "overhead",
        "per-op overhead, 8x8 fp32, us per call (DTensor time - plain local op time; slowest rank)",
        [Column("mesh", "mesh"), Column("op", "op"), Column("plain", "plain", ".2f"),
         Column("shardwise_overhead", "shardwise ovh", ".2f"), Column("torch_overhead", "torch ovh", ".2f"),
         Column("ratio", "ratio sw/torch", ".2f"), Column("check", "check")],
    )
    for shape in MESHES:
        per_rank = run_distributed(body, shape[0], settings, shape[0], timeout=settings.timeout)
        for op_name in OPS:
            results = [r["ops"][op_name] for r in per_rank]
            row: dict[str, Any] = {"mesh": str(shape), "op": op_name}
            row["plain"] = _us(max_over_ranks([r.get("plain") for r in results]))
            for name in LIBS:
                row[f"{name}_time"] = _us(max_over_ranks([r.get(name) for r in results]))
                row[f"{name}_overhead"] = _us(max_over_ranks([r.get(f"{name}_overhead") for r in results]))
                errors = sorted({r[f"{name}_error"] for r in results if f"{name}_error" in r})
                if errors:
                    row[f"{name}_error"] = errors[0]
                    table.notes.append(f"{shape} {op_name}: {name} failed: {errors[0]}")
            row["ratio"] = ratio(row["shardwise_overhead"], row["torch_overhead"])
            bad = [n for n in LIBS if any(r.get(f"{n}_ok") is False for r in results)]
            row["check"] = "ok" if not bad and not any(f"{n}_error" in row for n in LIBS) else (
                "WRONG: " + ",".join(bad) if bad else "error")
            table.rows.append(row)
        for w in sorted({w for r in per_rank for w in r["warnings"]}):
            table.notes.append(f"{shape} warning: {w}")
    table.notes.append("ratio > 1: shardwise adds more than torch; overhead can be negative within noise")
    return [table]


def _us(seconds: Any) -> Any:
    return None if seconds is None else seconds * 1e6
