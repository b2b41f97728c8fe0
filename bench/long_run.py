"""Long runs: growth per step of live objects and RSS, and host time per step, over thousands of steps.

Loops on gloo ranks, each under a cosine learning-rate schedule, through shardwise and through
torch's own implementation, the same program:
- tp: a tensor-parallel MLP on 2 ranks with AdamW (foreach, fused, for-loop);
- zero3: the MLP under `fully_shard` on 2 ranks (torch's FSDP2 beside), foreach AdamW;
- dp-x-tp: Colwise/Rowwise over tp, then `fully_shard` over dp, on (2, 2), foreach AdamW;
- compiled-tp: the tp loop's whole step under `shardwise.compile` (shardwise only).
After a warm-up, live Python objects (after `gc.collect()`) and the process's RSS are read,
and again at the end: the table gives their growth per step (0 is the goal), the host time
per step, and shardwise's cache sizes at the end (`shardwise.debug.cache_info()`).
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
    """(warm-up steps, measured steps). Quick (the smoke test): enough for every row and its
    check (the compiled loop traces on its second step), and a growth of one object every other
    step still reads 0.5 / step, which the check refuses; tests/test_long_run.py is where growth
    is checked exactly."""
    return (10, 40) if settings.quick else (300, 10_000)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(lib: Any, lib_name: str, loop: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    plan = {"0": lib.ColwiseParallel(), "2": lib.RowwiseParallel()}
    if loop in ("tp", "compiled-tp"):
        lib.parallelize_module(model, lib.mesh((2,), ("tp",)), plan)
        return model
    if lib_name == "shardwise":
        from shardwise.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    if loop == "zero3":
        fully_shard(model, mesh=lib.mesh((2,), ("dp",)))
    else:  # dp-x-tp (torchtitan's 2-D recipe)
        mesh = lib.mesh((2, 2), ("dp", "tp"))
        lib.parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    return model


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def body(settings: Settings, lib_name: str, loop: str, kind: str) -> dict[str, Any]:
    """One loop's growth per step, host time and caches (every rank).

    Quick (the smoke test): what the worker held before this run is frozen (`gc.freeze`) until
    it returns, so each `gc.collect()` skips it (about half a second a call in a worker with
    torch and transformers loaded) and `gc.get_objects()` counts only what was made since. A
    growth is counted all the same (what a step leaks is new); what can no longer show is a
    pre-existing object freed, a negative growth."""
    if not settings.quick:
        return _loop(settings, lib_name, loop, kind)
    gc.freeze()
    try:
        return _loop(settings, lib_name, loop, kind)
    finally:
        gc.unfreeze()


def _loop(settings: Settings, lib_name: str, loop: str, kind: str) -> dict[str, Any]:
    lib = load(lib_name)
    model = _model(lib, lib_name, loop)
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[kind]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **flags)
    warm, measured = _steps(settings)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, warm + measured)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    train = _train_step
    if loop == "compiled-tp":
        import shardwise

        train = shardwise.compile(_train_step)

    def step() -> None:
        train(model, optimizer, x)
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
            "ms": seconds * 1e3, "caches": sum(caches.values()),
            "programs": train.programs() if loop == "compiled-tp" else None}  # type: ignore[attr-defined]


# (loop, AdamW, ranks, libraries)
LOOPS = [("tp", kind, 2, LIBS) for kind in OPTIMIZERS] + [
    ("zero3", "foreach", 2, LIBS), ("dp-x-tp", "foreach", 4, LIBS), ("compiled-tp", "foreach", 2, ("shardwise",))]


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    warm, measured = _steps(settings)
    table = Table(
        "long_run",
        f"long run: an MLP (64 -> 256 -> 64) under TP, ZeRO-3, DP x TP and the compiled TP replay, AdamW under a "
        f"cosine lr schedule, {measured} steps after {warm} of warm-up: growth per step of live objects and RSS "
        f"(rank 0), host ms per step (slowest rank)",
        [Column("loop", "loop"), Column("optimizer", "AdamW"), Column("lib", "library"),
         Column("objects", "objects / step", ".3f"), Column("rss", "RSS KiB / step", ".3f"),
         Column("ms", "ms / step", ".2f"), Column("vs_torch", "time / torch", ".2f"), Column("caches", "cache entries")],
    )
    for loop, kind, ranks, libs in LOOPS:
        times: dict[str, float] = {}
        for lib_name in libs:
            try:
                per_rank = run_distributed(body, ranks, settings, lib_name, loop, kind, timeout=settings.timeout)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                table.rows.append({"loop": loop, "optimizer": kind, "lib": lib_name,
                                   "caches": "failed: " + str(exc)[:80]})
                continue
            times[lib_name] = max(r["ms"] for r in per_rank)
            programs = per_rank[0]["programs"]
            caches = per_rank[0]["caches"] if lib_name == "shardwise" else "-"
            table.rows.append({"loop": loop, "optimizer": kind, "lib": lib_name,
                               "objects": per_rank[0]["objects_per_step"], "rss": per_rank[0]["rss_kib_per_step"],
                               "ms": times[lib_name],
                               "caches": caches if programs is None else f"{caches} ({programs} program)"})
        for row in table.rows[-len(libs):]:
            row["vs_torch"] = ratio(times.get(row["lib"]), times.get("torch"))
    table.notes.append("objects: len(gc.get_objects()) after gc.collect(); RSS: /proc/self/statm; a positive "
                       "growth that does not scale with steps is the allocator settling, not a leak")
    table.notes.append("the tests (tests/test_long_run.py) run every loop, the pipeline and context parallel "
                       "included, for 400 steps and assert no growth (every optimizer on the tp loops)")
    return [table]
