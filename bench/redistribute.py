"""Redistribute time and bytes: shardwise vs torch.distributed.tensor on 4 gloo processes.

1024x1024 fp32 on mesh (4,): each transition timed for both libraries in the same
processes, interleaved, median of repeats (ms). Bytes are shardwise's received bytes per
rank (comm_log). Run: `.venv/bin/python bench/redistribute.py`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def body(repeats: int = 9) -> list[tuple[str, float, float, int]]:
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor as tdt  # the reference: allowed in bench/ only
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise as sw

    full = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    mesh, tmesh = sw.init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (4,))
    S, R, P = (sw.Shard, sw.Replicate, sw.Partial)
    TS, TR, TP = (tdt.Shard, tdt.Replicate, tdt.Partial)
    cases = [
        ("S(0)->R", [S(0)], [R()], [TS(0)], [TR()]),
        ("S(0)->S(1)", [S(0)], [S(1)], [TS(0)], [TS(1)]),
        ("P->R", [P()], [R()], [TP()], [TR()]),
        ("P->S(0)", [P()], [S(0)], [TP()], [TS(0)]),
        ("R->S(0)", [R()], [S(0)], [TR()], [TS(0)]),
    ]
    rows = []
    for name, src, dst, tsrc, tdst in cases:
        local = sw.distribute_tensor(full, mesh, [R() if p.is_partial() else p for p in src]).to_local()
        ours = sw.DTensor.from_local(local, mesh, src, shape=full.shape, stride=full.stride())
        tlocal = tdt.distribute_tensor(full, tmesh, [TR() if p.is_partial() else p for p in tsrc]).to_local()
        theirs = tdt.DTensor.from_local(tlocal, tmesh, tsrc, shape=full.shape, stride=full.stride())
        a, b = [], []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            ours.redistribute(mesh, dst)
            dist.barrier()
            t1 = time.perf_counter()
            theirs.redistribute(tmesh, tdst).to_local()
            dist.barrier()
            t2 = time.perf_counter()
            a.append(t1 - t0)
            b.append(t2 - t1)
        with sw.comm_log() as log:
            ours.redistribute(mesh, dst)
        rows.append((name, statistics.median(a) * 1e3, statistics.median(b) * 1e3, sum(r.bytes_received for r in log)))
    return rows


def main() -> None:
    from shardwise.testing import run_distributed, shutdown_pools

    try:
        rows = run_distributed(body, 4, timeout=600)[0]
    finally:
        shutdown_pools()
    print(f"{'transition':12s} {'shardwise ms':>13s} {'torch DT ms':>12s} {'ratio':>6s} {'sw bytes/rank':>14s}")
    for name, ours, theirs, nbytes in rows:
        print(f"{name:12s} {ours:13.2f} {theirs:12.2f} {ours / theirs:6.2f} {nbytes:14d}")


if __name__ == "__main__":
    main()
