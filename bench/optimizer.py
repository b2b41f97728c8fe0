"""Optimizer host time: AdamW over N DTensor parameters against the same AdamW over their local pieces.

On 2 gloo ranks, N parameters of 64 x 64 split in two (`Shard(0)`) get gradients; one
AdamW steps the DTensor parameters (shardwise's, and torch's DTensor's), another the plain
local pieces (the physical limit for eager: the same kernels on pieces made and laid out
alike, see `body`). Steps are
interleaved and the median per step is reported, foreach and fused, N = 100 and 1,000.
The goal is DTensor / local <= 1.2.
"""

from __future__ import annotations

import time

import torch

from ._common import Column, Settings, Table, quiet, ratio
from ._libs import LIBS, load

__all__ = ["body", "run"]


def _sizes(settings: Settings) -> tuple[int, ...]:
    return (10, 50) if settings.quick else (100, 1000)


def body(settings: Settings, n: int, kind: str) -> dict[str, float]:
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "default": {}}[kind]
    torch.manual_seed(0)
    whole = [torch.randn(64, 64) for _ in range(n)]
    params: dict[str, list[torch.nn.Parameter]] = {}
    for lib_name in LIBS:
        lib = load(lib_name)
        mesh = lib.mesh((2,), ("tp",))
        params[lib_name] = [torch.nn.Parameter(lib.distribute_tensor(w, mesh, [lib.Shard(0)])) for w in whole]
        for p in params[lib_name]:
            p.grad = lib.distribute_tensor(torch.ones(64, 64), mesh, [lib.Shard(0)])
    # the plain pieces are made the way the DTensors' are (distributed one by one, gradients
    # after), so they lie in memory alike: clones made in a row step a few % faster on CPU for
    # their locality alone
    sw = load("shardwise")
    mesh = sw.mesh((2,), ("tp",))
    pieces = [sw.distribute_tensor(w, mesh, [sw.Shard(0)]) for w in whole]
    params["local"] = [torch.nn.Parameter(d.to_local()) for d in pieces]
    for p in params["local"]:
        p.grad = sw.distribute_tensor(torch.ones(64, 64), mesh, [sw.Shard(0)]).to_local()
    optimizers = {name: torch.optim.AdamW(ps, lr=1e-3, **flags) for name, ps in params.items()}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    with quiet():
        for o in optimizers.values():
            for _ in range(3):
                o.step()
        for _ in range(max(5, settings.repeats)):
            for name, o in optimizers.items():
                start = time.perf_counter()
                o.step()
                times[name].append(time.perf_counter() - start)
    return {name: sorted(v)[len(v) // 2] * 1e3 for name, v in times.items()}


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    table = Table(
        "optimizer",
        "optimizer host time: AdamW step over N DTensor parameters (64 x 64, Shard(0) on 2 ranks) / over their "
        "plain local pieces, median ms per step (slowest rank)",
        [Column("kind", "AdamW"), Column("n", "N"), Column("local_ms", "local ms", ".2f"),
         Column("shardwise_ms", "shardwise ms", ".2f"), Column("shardwise_vs_local", "shardwise / local", ".2f"),
         Column("torch_ms", "torch ms", ".2f"), Column("torch_vs_local", "torch / local", ".2f")],
    )
    for kind in ("default", "foreach", "fused"):
        for n in _sizes(settings):
            try:
                per_rank = run_distributed(body, 2, settings, n, kind, timeout=settings.timeout)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                table.notes.append(f"{kind} N={n} failed: {str(exc).splitlines()[0][:120]}")
                continue
            ms = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
            table.rows.append({"kind": kind, "n": n, "local_ms": ms["local"], "shardwise_ms": ms["shardwise"],
                               "shardwise_vs_local": ratio(ms["shardwise"], ms["local"]), "torch_ms": ms["torch"],
                               "torch_vs_local": ratio(ms["torch"], ms["local"])})
    return [table]
