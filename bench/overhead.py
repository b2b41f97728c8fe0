"""Per-op dispatch overhead: plain torch vs shardwise vs torch.distributed.tensor, one process.

A world of one process isolates dispatch cost from communication. Each op runs on 8x8
fp32 in layouts that need no collective; times are the best of several interleaved
repeats, in microseconds per call. Run: `.venv/bin/python bench/overhead.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def best_us(fn: Callable[[], object], n: int = 2000, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def main() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import torch.distributed.tensor as tdt  # the reference: allowed in bench/ only

    import shardwise as sw

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    mesh = sw.init_device_mesh("cpu", (1,))
    tmesh = tdt.init_device_mesh("cpu", (1,)) if hasattr(tdt, "init_device_mesh") else None
    if tmesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        tmesh = init_device_mesh("cpu", (1,))
    sa, sb = sw.distribute_tensor(a, mesh, [sw.Shard(0)]), sw.distribute_tensor(b, mesh, [sw.Shard(0)])
    sr = sw.distribute_tensor(b, mesh, [sw.Replicate()])
    ta, tb = tdt.distribute_tensor(a, tmesh, [tdt.Shard(0)]), tdt.distribute_tensor(b, tmesh, [tdt.Shard(0)])
    tr = tdt.distribute_tensor(b, tmesh, [tdt.Replicate()])
    cases: dict[str, tuple[Callable[[], object], Callable[[], object], Callable[[], object]]] = {
        "add": (lambda: a + b, lambda: sa + sb, lambda: ta + tb),
        "mul scalar": (lambda: a * 2, lambda: sa * 2, lambda: ta * 2),
        "relu": (lambda: a.relu(), lambda: sa.relu(), lambda: ta.relu()),
        "view": (lambda: a.view(64), lambda: sa.view(64), lambda: ta.view(64)),
        "sum": (lambda: a.sum(), lambda: sa.sum(), lambda: ta.sum()),
        "mm S(0)xR": (lambda: a @ b, lambda: sa @ sr, lambda: ta @ tr),
    }
    print(f"{'op':12s} {'torch':>8s} {'shardwise':>10s} {'torch DT':>9s} {'sw ovh':>7s} {'DT ovh':>7s} {'ratio':>6s}")
    for name, (plain, ours, theirs) in cases.items():
        p, s, t = best_us(plain), best_us(ours), best_us(theirs)
        print(f"{name:12s} {p:8.2f} {s:10.2f} {t:9.2f} {s - p:7.2f} {t - p:7.2f} {(s - p) / max(t - p, 1e-9):6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
