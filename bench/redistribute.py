"""Redistribute: time and bytes on the wire per rank, shardwise vs torch DTensor, on meshes (4,) and (2, 2).

Every transition between S(0), S(1), R and P(sum) on (4,) (Partial only as a source:
neither library redistributes *to* Partial) and a set of 2-D transitions on (2, 2). A
Partial source is made by declaring a replicated local piece Partial, so its global value
is the full tensor times the size of the Partial mesh dims; each library's result is
checked against that value before timing. Each sample starts after a barrier and ends
when the result is local (torch's lazy collectives waited on); the table shows the median
over repeats of the slowest rank. Bytes: shardwise's own `comm_log()`, and for both
libraries the dispatcher spy of `_wire.py` (the two must agree for shardwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._common import Column, interleaved, Settings, Table, close, per_repeat_max_median, quiet, ratio, settle
from ._libs import LIBS, load, placements
from ._wire import WireSpy, summary

__all__ = ["CASES", "body", "run"]

_ONE_D = ["S0", "S1", "R", "P"]
CASES: dict[tuple[int, ...], list[tuple[str, str]]] = {
    (4,): [(s, d) for s in _ONE_D for d in _ONE_D if d != "P" and d != s],
    (2, 2): [
        ("S0,S1", "S1,S0"),
        ("S1,S0", "S0,S1"),
        ("S0,R", "R,S0"),
        ("R,S0", "S0,R"),
        ("S0,S0", "R,R"),
        ("S0,S1", "R,R"),
        ("S0,S0", "S1,S1"),
        ("R,R", "S0,S1"),
        ("P,P", "R,R"),
        ("P,S0", "S0,S1"),
        ("P,R", "S0,R"),
        ("S0,P", "S0,R"),
        ("P,P", "S0,S1"),
    ],
}


def _source(lib: Any, mesh: Any, full: torch.Tensor, src: str) -> Any:
    """A DTensor laid out as `src`; Partial mesh dims hold the replicated value on every rank."""
    wanted = placements(lib, src)
    seed = [lib.Replicate() if p.is_partial() else p for p in wanted]
    local = lib.distribute_tensor(full, mesh, seed).to_local()
    return lib.DTensor.from_local(local, mesh, wanted, shape=full.shape, stride=full.stride())


def _redistribute(x: Any, mesh: Any, target: list[Any]) -> torch.Tensor:
    return settle(x.redistribute(mesh, target).to_local())


def body(settings: Settings, shape: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every rank: for each case, check, count bytes, then time both libraries interleaved."""
    import torch.distributed as dist

    import shardwise as sw


    full = torch.randn(*settings.redistribute_shape, generator=torch.Generator().manual_seed(0))
    libs = {name: load(name) for name in LIBS}
    meshes = {name: lib.mesh(shape) for name, lib in libs.items()}
    rows = []
    seen: set[str] = set()
    with quiet(seen):
        for src, dst in CASES[shape]:
            factor = 1
            for size, p in zip(shape, src.split(",")):
                factor *= size if p == "P" else 1
            want = full * factor
            row: dict[str, Any] = {"src": src, "dst": dst}
            runnable: dict[str, Callable[[], object]] = {}
            for name, lib in libs.items():
                mesh, target = meshes[name], placements(lib, dst)
                try:
                    x = _source(lib, mesh, full, src)
                    spy = WireSpy()
                    if name == "shardwise":
                        with sw.comm_log() as log, spy:
                            y = x.redistribute(mesh, target)
                        row["shardwise_comm_log"] = summary(log)
                    else:
                        with spy:
                            y = x.redistribute(mesh, target)
                            settle(y.to_local())
                    row[f"{name}_wire"] = summary(spy.records)
                    row[f"{name}_ok"] = close(y.full_tensor(), want, 1e-5)
                    runnable[name] = functools.partial(_redistribute, x, mesh, target)
                except Exception as exc:  # unsupported by one library: reported, not fatal
                    row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            for fn in runnable.values():
                for _ in range(min(settings.warmup, 3)):
                    fn()
            samples = interleaved(runnable, settings.repeats, before=dist.barrier)
            row.update({f"{name}_samples": s for name, s in samples.items()})
            rows.append(row)
    rows.append({"warnings": sorted(seen)})
    return rows


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    h, w = settings.redistribute_shape
    table = Table(
        "redistribute",
        f"redistribute {h}x{w} fp32: ms per call (median over repeats of the slowest rank) and KiB received per rank",
        [Column("mesh", "mesh"), Column("transition", "transition"),
         Column("shardwise_ms", "shardwise ms", ".3f"), Column("torch_ms", "torch ms", ".3f"),
         Column("ratio", "ratio", ".2f"), Column("shardwise_kib", "sw KiB", ".1f"), Column("torch_kib", "torch KiB", ".1f"),
         Column("shardwise_comm", "sw comm"), Column("torch_comm", "torch comm"), Column("check", "check")],
    )
    for shape in CASES:
        per_rank = run_distributed(body, _world(shape), settings, shape, timeout=settings.timeout)
        *cases, tail = zip(*per_rank)
        for rank_rows in cases:
            first = rank_rows[0]
            row: dict[str, Any] = {"mesh": str(shape), "transition": f"({first['src']})->({first['dst']})"}
            problems = []
            for name in LIBS:
                errors = sorted({r[f"{name}_error"] for r in rank_rows if f"{name}_error" in r})
                if errors:
                    row[f"{name}_error"] = errors[0]
                    problems.append(f"{name} failed")
                    table.notes.append(f"{shape} {row['transition']}: {name} failed: {errors[0]}")
                    continue
                row[f"{name}_ms"] = _ms(per_repeat_max_median([r[f"{name}_samples"] for r in rank_rows]))
                wire = [r[f"{name}_wire"] for r in rank_rows]
                sizes = [b for b, _ in wire]
                row[f"{name}_bytes"] = None if any(b is None for b in sizes) else max(sizes)
                row[f"{name}_kib"] = None if row[f"{name}_bytes"] is None else row[f"{name}_bytes"] / 1024
                row[f"{name}_comm"] = wire[0][1]
                if any(r[f"{name}_ok"] is False for r in rank_rows):
                    problems.append(f"{name} WRONG")
            logged = [r["shardwise_comm_log"] for r in rank_rows if "shardwise_comm_log" in r]
            if logged:
                row["shardwise_comm_log_bytes"] = max(b or 0 for b, _ in logged)
                if row.get("shardwise_bytes") != row["shardwise_comm_log_bytes"]:
                    problems.append("spy != comm_log")
            row["ratio"] = ratio(row.get("shardwise_ms"), row.get("torch_ms"))
            row["check"] = "; ".join(problems) or "ok"
            table.rows.append(row)
        for w in sorted({w for r in tail for w in r["warnings"]}):
            table.notes.append(f"{shape} warning: {w}")
    table.notes.append("comm: AG all_gather, RS reduce_scatter, AR all_reduce, A2A all_to_all, BC broadcast "
                       "(counted at the dispatcher for both libraries)")
    return [table]


def _world(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ms(seconds: Any) -> Any:
    return None if seconds is None else seconds * 1e3
