"""Overlap: `redistribute(async_op=True)` with compute issued before the result is used.

One sample on every rank of a (2,) mesh: start gathering a row-split 1024x1024 fp32 tensor
(S(0) -> R), run a local matmul that does not need it, then use both. `sync` waits for the
gather before the matmul; `async` starts it, computes, then waits at the first use. Both
libraries, same shapes, interleaved; the result is checked against one device. On this
machine the ranks share two cores with the collective's own threads, so the overlap shows
how much of the communication hides behind compute, not a device's DMA engine.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._common import Column, interleaved, Settings, Table, close, per_repeat_max_median, quiet, ratio, settle
from ._libs import LIBS, load

__all__ = ["body", "run"]


def _step(x: Any, mesh: Any, target: list[Any], a: torch.Tensor, b: torch.Tensor, async_op: bool) -> torch.Tensor:
    y = x.redistribute(mesh, target, async_op=async_op)
    c = a @ b  # independent of y: overlaps the gather when it runs in the background
    return settle(y.to_local()[: c.shape[0], : c.shape[1]] + c)


def body(settings: Settings) -> list[dict[str, Any]]:
    import torch.distributed as dist

    h, w = settings.redistribute_shape
    full = torch.randn(h, w, generator=torch.Generator().manual_seed(0))
    k = max(h // 2, 8)
    a = torch.randn(k, k, generator=torch.Generator().manual_seed(1))
    b = torch.randn(k, k, generator=torch.Generator().manual_seed(2))
    want = full[:k, :k] + a @ b
    runnable = {}
    checks = {}
    seen: set[str] = set()
    with quiet(seen):
        for name in LIBS:
            lib = load(name)
            mesh = lib.mesh((2,))
            x = lib.distribute_tensor(full, mesh, [lib.Shard(0)])
            for mode in ("sync", "async"):
                fn = functools.partial(_step, x, mesh, [lib.Replicate()], a, b, mode == "async")
                checks[f"{name}_{mode}_ok"] = close(fn(), want, 1e-4)
                runnable[f"{name}_{mode}"] = fn
        for fn in runnable.values():
            for _ in range(min(settings.warmup, 3)):
                fn()
        samples = interleaved(runnable, settings.repeats, before=dist.barrier)
    return [{**checks, **{f"{n}_samples": s for n, s in samples.items()}, "warnings": sorted(seen)}]


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    h, w = settings.redistribute_shape
    k = max(h // 2, 8)
    table = Table(
        "overlap",
        f"async redistribute: gather {h}x{w} fp32 (S0 -> R) on (2,) while a {k}x{k} matmul runs, "
        f"ms per step (median over repeats of the slowest rank)",
        [Column("library", "library"), Column("sync_ms", "sync ms", ".3f"), Column("async_ms", "async ms", ".3f"),
         Column("gain", "async/sync", ".2f"), Column("vs_torch", "async vs torch async", ".2f"),
         Column("check", "check")],
    )
    per_rank = [rows[0] for rows in run_distributed(body, 2, settings, timeout=settings.timeout)]
    ms = {key: per_repeat_max_median([r[f"{key}_samples"] for r in per_rank]) for name in LIBS
          for key in (f"{name}_sync", f"{name}_async")}
    for name in LIBS:
        sync, asyn = ms[f"{name}_sync"], ms[f"{name}_async"]
        ok = all(r[f"{name}_{m}_ok"] for r in per_rank for m in ("sync", "async"))
        table.rows.append({
            "library": name, "sync_ms": None if sync is None else sync * 1e3,
            "async_ms": None if asyn is None else asyn * 1e3, "gain": ratio(asyn, sync),
            "vs_torch": ratio(asyn, ms["torch_async"]), "check": "ok" if ok else "WRONG",
        })
    for warning in sorted({w for r in per_rank for w in r["warnings"]}):
        table.notes.append(f"warning: {warning}")
    return [table]
