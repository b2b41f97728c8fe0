"""What the safety of issue 15 costs: checkpoint save / load against torch.distributed.checkpoint,
and the bookkeeping of every collective against a bare `torch.distributed` call.

Checkpoints: 4 gloo ranks save and load the same sharded state (Shard(0) DTensors of fp32,
`checkpoint_mb` in all) with `shardwise.checkpoint` and with DCP, interleaved, each into its
own directory. shardwise's save writes generation-named files, fsyncs them and the
directory, checksums every piece (SHA-256) and agrees four times; its load checks every
piece it reads before copying. `async_save` is timed until it returns (what the training
loop waits for), then waited on untimed. The SHA-256 row is the hashing alone, over one
rank's share: the part of save's time that checksums cost. Each sample is the slowest rank.

Collectives: an all_reduce of 8 floats on 4 ranks, issued bare (`dist.all_reduce`), through
shardwise's door (numbered, async issue with a timed wait), and through the door with
`SHARDWISE_CHECK=1` (one extra fixed-size all_gather first): microseconds per call.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from ._common import Column, Settings, Table, interleaved, median, per_repeat_max_median, ratio
from ._libs import load

__all__ = ["run", "checkpoint_body", "door_body"]

WORLD = 4


def _state(lib: Any, mesh: Any, megabytes: float) -> dict[str, Any]:
    rows = max(WORLD, int(megabytes * 2**20 / 4 / 1024 / 8) // WORLD * WORLD)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": lib.distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [lib.Shard(0)])
            for i in range(8)}


def checkpoint_body(settings: Settings, root: str, megabytes: float) -> dict[str, Any]:
    """Every rank: save, load and async-save with both libraries; seconds per sample."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from shardwise import checkpoint

    sw, th = load("shardwise"), load("torch")
    states = {"shardwise": _state(sw, sw.mesh((WORLD,)), megabytes), "torch": _state(th, th.mesh((WORLD,)), megabytes)}
    where = {name: os.path.join(root, name) for name in states}
    pending: list[Any] = []

    def wait_pending() -> None:
        while pending:
            pending.pop().result()
        dist.barrier()

    def same(name: str) -> None:  # what loads back is what was saved
        target = {k: v.detach().clone() for k, v in states[name].items()}
        for v in target.values():
            v.to_local().zero_()
        (checkpoint.load if name == "shardwise" else dcp.load)(target, checkpoint_id=where[name])
        assert all(torch.equal(target[k].to_local(), v.to_local()) for k, v in states[name].items()), name

    def sw_async() -> None:
        pending.append(checkpoint.async_save(states["shardwise"], checkpoint_id=where["shardwise"]))

    def dcp_async() -> None:
        pending.append(dcp.async_save(states["torch"], checkpoint_id=where["torch"]))

    cases = {
        "save": {"shardwise": lambda: checkpoint.save(states["shardwise"], checkpoint_id=where["shardwise"]),
                 "torch": lambda: dcp.save(states["torch"], checkpoint_id=where["torch"])},
        "load": {"shardwise": lambda: checkpoint.load(states["shardwise"], checkpoint_id=where["shardwise"]),
                 "torch": lambda: dcp.load(states["torch"], checkpoint_id=where["torch"])},
        "async_save (until it returns)": {"shardwise": sw_async, "torch": dcp_async},
    }
    out: dict[str, Any] = {}
    for case, contenders in cases.items():
        for fn in contenders.values():  # warm up (and make the directories load can read)
            fn()
            wait_pending()
        if case == "save":
            for name in contenders:
                same(name)
        samples = interleaved(contenders, settings.repeats, before=wait_pending)
        wait_pending()
        out[case] = samples

    local = b"".join(v.to_local().numpy().tobytes() for v in states["shardwise"].values())
    hashing = []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        hashlib.sha256(local).hexdigest()
        hashing.append(time.perf_counter() - start)
    out["sha256"] = hashing
    out["bytes_per_rank"] = len(local)
    return out


def door_body(settings: Settings) -> dict[str, Any]:
    """Every rank: bare all_reduce, the door's, the door's under SHARDWISE_CHECK=1; seconds per call."""
    import torch.distributed as dist

    from shardwise import _comm as comm

    t = torch.ones(8)
    collective = comm.AllReduce(group=dist.group.WORLD, size=WORLD, shape=(8,), dtype=t.dtype, op="sum")

    def bare() -> None:
        dist.all_reduce(t.clone(), group=dist.group.WORLD)

    def door() -> None:
        comm.run(collective, t)

    def checked() -> None:
        os.environ["SHARDWISE_CHECK"] = "1"
        try:
            comm.run(collective, t)
        finally:
            del os.environ["SHARDWISE_CHECK"]

    contenders = {"bare": bare, "door": door, "checked": checked}
    for fn in contenders.values():
        for _ in range(settings.warmup):
            fn()
    dist.barrier()
    return interleaved(contenders, settings.op_repeats, settings.inner, before=dist.barrier)


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    megabytes = 4.0 if settings.quick else 256.0
    root = tempfile.mkdtemp(prefix="shardwise-bench-checkpoint-")
    try:
        per_rank = run_distributed(checkpoint_body, WORLD, settings, root, megabytes, timeout=settings.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = per_rank[0]["bytes_per_rank"] * WORLD / 2**20
    table = Table(
        "checkpoint",
        f"checkpoint of {mb:.0f} MB (8 fp32 matrices, Shard(0) on 4 ranks), ms (slowest rank, median of "
        f"{settings.repeats})",
        [Column("case", "case"), Column("shardwise", "shardwise ms", ".1f"), Column("torch", "DCP ms", ".1f"),
         Column("ratio", "ratio sw/DCP", ".2f"), Column("throughput", "shardwise GB/s", ".2f")],
    )
    for case in ("save", "load", "async_save (until it returns)"):
        row: dict[str, Any] = {"case": case}
        for name in ("shardwise", "torch"):
            row[name] = _ms(per_repeat_max_median([r[case][name] for r in per_rank]))
        row["ratio"] = ratio(row["shardwise"], row["torch"])
        row["throughput"] = mb / 1024 / (row["shardwise"] / 1e3) if row["shardwise"] else None
        table.rows.append(row)
    sha = _ms(per_repeat_max_median([r["sha256"] for r in per_rank]))
    table.rows.append({"case": "SHA-256 of one rank's share (within save)", "shardwise": sha,
                       "throughput": mb / WORLD / 1024 / (sha / 1e3) if sha else None})
    table.notes.append("save: generation-named files, fsync of files and directory, per-piece SHA-256, 4 agreements; "
                       "load: every piece checked before any copy; both on this machine's local disk")
    table.notes.append("async_save: the blocking part (checks, agreements, copy to host memory); the writing overlaps "
                       "the next step")

    door = run_distributed(door_body, WORLD, settings, timeout=settings.timeout)
    collectives = Table(
        "collective_bookkeeping",
        "all_reduce of 8 fp32 on 4 ranks: us per call (slowest rank's median)",
        [Column("path", "path"), Column("us", "us per call", ".1f"), Column("over", "over bare", ".1f"),
         Column("ratio", "ratio to bare", ".2f")],
    )
    bare = _us(max(median(r["bare"]) or 0.0 for r in door))
    for path, key in (("dist.all_reduce", "bare"), ("shardwise door", "door"), ("door, SHARDWISE_CHECK=1", "checked")):
        us = _us(max(median(r[key]) or 0.0 for r in door))
        collectives.rows.append({"path": path, "us": us, "over": us - bare, "ratio": ratio(us, bare)})
    collectives.notes.append("door: numbering, a timed wait on an async issue, fault diagnosis on failure only; "
                             "SHARDWISE_CHECK adds one all_gather of 4 int64 per collective")
    return [table, collectives]


def _ms(seconds: Any) -> Any:
    return None if seconds is None else seconds * 1e3


def _us(seconds: Any) -> Any:
    return None if seconds is None else seconds * 1e6
