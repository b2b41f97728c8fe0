"""Long runs: growth per step of live objects and RSS, and host time per step, over thousands of steps.

A tensor-parallel MLP on 2 gloo ranks trains with AdamW (foreach, fused, for-loop) under a
cosine learning-rate schedule, through shardwise and through torch's DTensor, the same
program. After a warm-up, live Python objects (after `gc.collect()`) and the process's RSS
are read, and again at the end: the table gives their growth per step (0 is the goal), the
host time per step, and shardwise's cache sizes at the end (`shardwise.debug.cache_info()`).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from ._common import Column, Settings, Table, quiet, ratio
from ._libs import LIBS, load

__all__ = ["body", "run"]

OPTIMIZERS = ("foreach", "fused", "for-loop")


def _steps(settings: Settings) -> tuple[int, int]:
    """(warm-up steps, measured steps)."""
    return (100, 500) if settings.quick else (300, 10_000)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def body(settings: Settings, lib_name: str, kind: str) -> dict[str, Any]:
    lib = load(lib_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    lib.parallelize_module(model, lib.mesh((2,), ("tp",)), {"0": lib.ColwiseParallel(), "2": lib.RowwiseParallel()})
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[kind]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **flags)
    warm, measured = _steps(settings)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, warm + measured)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        schedule.step()

    with quiet():
        for _ in range(warm):
            step()
        gc.collect()
        objects, rss = len(gc.get_objects()), _rss()
        start = time.perf_counter()
        for _ in range(measured):
            step()
        seconds = (time.perf_counter() - start) / measured
        gc.collect()
        grown, rss_grown = len(gc.get_objects()) - objects, _rss() - rss
    caches: dict[str, int] = {}
    if lib_name == "shardwise":
        from shardwise.debug import cache_info

        caches = cache_info()
    return {"objects_per_step": grown / measured, "rss_kib_per_step": rss_grown / 1024 / measured,
            "ms": seconds * 1e3, "caches": sum(caches.values())}


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    warm, measured = _steps(settings)
    table = Table(
        "long_run",
        f"long run: TP MLP (64 -> 256 -> 64) on 2 ranks, AdamW under a cosine lr schedule, {measured} steps after "
        f"{warm} of warm-up: growth per step of live objects and RSS (rank 0), host ms per step (slowest rank)",
        [Column("optimizer", "AdamW"), Column("lib", "library"), Column("objects", "objects / step", ".3f"),
         Column("rss", "RSS KiB / step", ".3f"), Column("ms", "ms / step", ".2f"),
         Column("vs_torch", "time / torch", ".2f"), Column("caches", "cache entries")],
    )
    for kind in OPTIMIZERS:
        times: dict[str, float] = {}
        for lib_name in LIBS:
            try:
                per_rank = run_distributed(body, 2, settings, lib_name, kind, timeout=settings.timeout)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                table.rows.append({"optimizer": kind, "lib": lib_name, "caches": "failed: " + str(exc)[:80]})
                continue
            times[lib_name] = max(r["ms"] for r in per_rank)
            table.rows.append({"optimizer": kind, "lib": lib_name, "objects": per_rank[0]["objects_per_step"],
                               "rss": per_rank[0]["rss_kib_per_step"], "ms": times[lib_name],
                               "caches": per_rank[0]["caches"] if lib_name == "shardwise" else "-"})
        for row in table.rows[-len(LIBS):]:
            row["vs_torch"] = ratio(times.get(row["lib"]), times.get("torch"))
    table.notes.append("objects: len(gc.get_objects()) after gc.collect(); RSS: /proc/self/statm; a positive "
                       "growth that does not scale with steps is the allocator settling, not a leak")
    return [table]
