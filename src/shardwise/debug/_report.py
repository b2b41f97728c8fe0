"""What a dry run reports (`dry_run` fills it): per simulated rank, every collective and the
memory held, with totals, per-module rows, a printed table and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ._moe import MoeReport

__all__ = ["CATEGORIES", "UNSHARDED", "DryCollective", "DryRunReport", "MemoryReport", "RankReport"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
UNSHARDED = "unsharded"  # fsdp units' unsharded parameters: a category only where a program has units
_COLUMNS = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "activations": "activ.",
            UNSHARDED: "unshard."}


@dataclass(frozen=True)
class DryCollective:
    """One collective a rank would issue: its kind, the mesh dims its group spans, the group's
    size, the bytes this rank receives, the op that caused it ("-": outside an op), and the
    module path ("" the model) and pass it fell in."""

    kind: str
    mesh_dims: tuple[str, ...]
    group_size: int
    bytes: int
    op: str
    module: str
    pass_: str


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds. `peaks`: the peak of each category on its own; `peak`: the peak of
    the total, `at_peak` its split and `peak_tick` when (ops counted from the start; of
    `ticks`); `modules`: what each module path holds at that peak (activations by the module
    that made them, the rest by the module that owns the parameter).

    `units`: per `fully_shard` unit (by the path of its module, "" the root), in the order
    first gathered, the bytes of its unsharded parameters (or of its gather in flight) held
    at the peak (0: resharded then). Where a program has units, every dict above has a fifth
    category, "unsharded": those bytes (in `modules`, in the unit's row)."""

    peaks: dict[str, int]
    peak: int
    at_peak: dict[str, int]
    peak_tick: int
    ticks: int
    modules: dict[str, dict[str, int]]
    units: dict[str, int] = field(default_factory=dict)

    @property
    def units_unsharded_at_peak(self) -> int:
        """How many fsdp units held their unsharded parameters at the peak."""
        return sum(1 for n in self.units.values() if n)


@dataclass(frozen=True)
class RankReport:
    """A simulated rank: its coordinate, collectives in issue order, memory, and the mesh dims
    along which some tensor was split unevenly (ranks differ only along those)."""

    rank: int
    coordinate: tuple[int, ...]
    collectives: list[DryCollective]
    memory: MemoryReport
    uneven: list[str]
    flops: dict[str, int] = field(default_factory=dict)  # per pass, of the ops torch counts FLOPs of
    moe: Optional[MoeReport] = None  # the experts modules that dispatch tokens (`_moe`), when there are some

    def totals(self, which: Optional[str] = None) -> dict[str, tuple[int, int]]:
        """(count, bytes received) per collective kind, of one pass or both."""
        out: dict[str, list[int]] = {}
        for c in self.collectives:
            if which is None or c.pass_ == which:
                row = out.setdefault(c.kind, [0, 0])
                row[0] += 1
                row[1] += c.bytes
        return {k: (n, b) for k, (n, b) in sorted(out.items())}


class DryRunReport:
    """The report of `dry_run`: one `RankReport` per simulated rank (`ranks`), the mesh, and
    the seconds the dry run took. `str(report)` is a table; `to_json()` the whole of it."""

    def __init__(self, shape: tuple[int, ...], names: Optional[tuple[str, ...]], ranks: list[RankReport],
                 seconds: float) -> None:
        self.mesh_shape, self.mesh_dim_names, self.ranks, self.seconds = shape, names, ranks, seconds

    def rank(self, rank: int) -> RankReport:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} was not simulated (simulated: {[r.rank for r in self.ranks]}); "
                       f"pass it in dry_run(..., ranks=[...])")

    @property
    def collectives(self) -> list[DryCollective]:
        return self.ranks[0].collectives

    @property
    def memory(self) -> MemoryReport:
        return self.ranks[0].memory

    def totals(self, which: Optional[str] = None) -> dict[str, tuple[int, int]]:
        return self.ranks[0].totals(which)

    def symmetric(self) -> bool:
        """Whether every rank of the mesh holds pieces of the same sizes (no uneven split), so
        the first simulated rank's numbers hold for all."""
        return not any(r.uneven for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": {"shape": list(self.mesh_shape), "mesh_dim_names": list(self.mesh_dim_names or ())},
            "seconds": round(self.seconds, 3),
            "ranks": [{
                "rank": r.rank, "coordinate": list(r.coordinate), "uneven_mesh_dims": r.uneven, "flops": r.flops,
                "totals": {k: {"count": n, "bytes": b} for k, (n, b) in r.totals().items()},
                "memory": asdict(r.memory),
                "collectives": [{**asdict(c), "pass": c.pass_} for c in r.collectives],
                "moe": None if r.moe is None else asdict(r.moe),
            } for r in self.ranks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        names = f" {self.mesh_dim_names}" if self.mesh_dim_names else ""
        lines = [f"dry run on mesh {self.mesh_shape}{names} in {self.seconds:.2f} s"]
        for r in self.ranks:
            lines += _rank_text(r, self)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DryRunReport(mesh={self.mesh_shape}, ranks={[r.rank for r in self.ranks]})"


def _rank_text(r: RankReport, report: DryRunReport) -> list[str]:
    who = f"rank {r.rank} {r.coordinate}"
    if r.uneven:
        who += f" (uneven along {', '.join(r.uneven)}: ranks differ along those mesh dims)"
    elif len(report.ranks) == 1:
        who += " (every split even: every rank holds and sends the same)"
    lines = ["", who, f"  {'pass':<10}{'collective':<16}{'mesh dims':<12}{'count':>7}{'bytes':>12}   "
                      f"by op ('-': a hook or an explicit redistribute)"]
    rows: dict[tuple[str, tuple[str, ...], str], list[Any]] = {}
    for c in r.collectives:
        row = rows.setdefault((c.pass_, c.mesh_dims, c.kind), [0, 0, set()])
        row[0] += 1
        row[1] += c.bytes
        row[2].add(c.op)
    for (which, dims, kind), (n, b, ops) in sorted(rows.items(), key=lambda kv: (kv[0][0] != "forward", kv[0])):
        lines.append(f"  {which:<10}{kind:<16}{','.join(dims) or '-':<12}{n:>7}{_size(b):>12}   "
                     f"{', '.join(sorted(ops))}")
    total = sum(c.bytes for c in r.collectives)
    lines.append(f"  {'total':<38}{len(r.collectives):>7}{_size(total):>12}")
    m = r.memory
    kinds = tuple(m.at_peak)  # CATEGORIES, and UNSHARDED where the program has fsdp units
    lines.append(f"  memory peak {_size(m.peak)} at op {m.peak_tick} of {m.ticks}: "
                 + ", ".join(f"{k} {_size(m.at_peak[k])}" for k in kinds))
    lines.append("  peak of each: " + ", ".join(f"{k} {_size(m.peaks[k])}" for k in kinds))
    if m.units:
        held = [f"{path or '(model)'} {_size(n)}" for path, n in m.units.items() if n]
        lines.append(f"  fsdp units unsharded at the peak: {m.units_unsharded_at_peak} of {len(m.units)}"
                     + (f": {', '.join(held)}" if held else ""))
    if r.moe is not None:
        lines += r.moe.lines()
    if r.flops:
        lines.append("  FLOPs: " + ", ".join(f"{k} {v / 1e9:.3g} G" for k, v in r.flops.items()))
    comm: dict[str, list[int]] = {}
    for c in r.collectives:
        row = comm.setdefault(c.module, [0, 0, 0, 0])
        i = 0 if c.pass_ == "forward" else 2
        row[i] += 1
        row[i + 1] += c.bytes
    paths = sorted(set(m.modules) | set(comm))
    if paths:
        lines.append(f"  {'module':<36}" + "".join(f"{_COLUMNS[k]:>10}" for k in kinds) + "   forward / backward comm")
        for path in paths:
            mem = m.modules.get(path, dict.fromkeys(kinds, 0))
            n = comm.get(path, [0, 0, 0, 0])
            label = (path or "(model)")[-36:]
            lines.append(f"  {label:<36}" + "".join(f"{_size(mem[k]):>10}" for k in kinds)
                         + f"   x{n[0]} {_size(n[1])} / x{n[2]} {_size(n[3])}")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
