"""What a plan shards and what it leaves replicated, in parameters and bytes, before any sharding.

A planner that recognises layers by name can miss some (a model family it does not know):
the model still trains, only with those weights whole on every rank. `coverage(module,
plan)` says so up front: one row per parameter (tied parameters once) with its layout
and bytes, totals, and the large parameters left replicated; `MegatronPlanner` attaches it
to the plan it builds and warns when replicated matrices hold more than 10% of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from .._layout import format_placements
from .._mesh import AbstractMesh
from .._placement import Placement, Shard, _StridedShard
from ._plan import ShardingPlan, resolve

__all__ = ["Coverage", "coverage"]

# a parameter of 2+ dims holding at least this share of the model's bytes is "large"
LARGE = 0.01


@dataclass(frozen=True)
class CoverageRow:
    name: str
    shape: tuple[int, ...]
    nbytes: int
    placements: Optional[tuple[Placement, ...]]  # None: the plan does not name it (replicated)

    @property
    def sharded(self) -> bool:
        return self.placements is not None and any(isinstance(p, (Shard, _StridedShard)) for p in self.placements)


@dataclass(frozen=True)
class Coverage:
    """Per parameter: the layout a plan gives it; `str()` is a table with totals."""

    rows: tuple[CoverageRow, ...]

    @property
    def sharded_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows if r.sharded)

    @property
    def replicated_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows if not r.sharded)

    @property
    def sharded(self) -> list[str]:
        return [r.name for r in self.rows if r.sharded]

    @property
    def replicated(self) -> list[str]:
        return [r.name for r in self.rows if not r.sharded]

    def large_replicated(self, share: float = LARGE) -> list[CoverageRow]:
        """Replicated parameters of 2+ dims holding at least `share` of all parameter bytes, largest first."""
        total = self.sharded_bytes + self.replicated_bytes
        big = [r for r in self.rows if not r.sharded and len(r.shape) >= 2 and r.nbytes >= share * total]
        return sorted(big, key=lambda r: -r.nbytes)

    def replicated_matrix_share(self) -> float:
        """The share of all parameter bytes held by replicated parameters of 2+ dims."""
        total = self.sharded_bytes + self.replicated_bytes
        return sum(r.nbytes for r in self.rows if not r.sharded and len(r.shape) >= 2) / max(total, 1)

    def summary(self) -> str:
        total = max(self.sharded_bytes + self.replicated_bytes, 1)
        return (f"{len(self.sharded)} parameters sharded ({self.sharded_bytes:,} bytes, "
                f"{100 * self.sharded_bytes / total:.1f}%), {len(self.replicated)} replicated "
                f"({self.replicated_bytes:,} bytes, {100 * self.replicated_bytes / total:.1f}%)")

    def __str__(self) -> str:
        width = max([len(r.name) for r in self.rows] + [9])
        lines = [f"{'parameter':<{width}}  {'shape':<16} {'bytes':>12}  layout"]
        for r in self.rows:
            layout = format_placements(r.placements) if r.placements is not None else "replicated (not in the plan)"
            lines.append(f"{r.name:<{width}}  {str(list(r.shape)):<16} {r.nbytes:>12,}  {layout}")
        lines.append(self.summary())
        return "\n".join(lines)


def coverage(module: nn.Module, plan: ShardingPlan, mesh: Optional[AbstractMesh] = None) -> Coverage:
    """The layout `plan` gives each of `module`'s parameters (checked as `shard_module` checks it,
    on `mesh`, default a 1-D mesh of 2), with no communication."""
    mesh = mesh if mesh is not None else AbstractMesh((2,))
    resolved = resolve(plan, module, mesh)
    layouts: dict[str, tuple[Placement, ...]] = {name: pl for name, pl, _ in resolved.params}
    for path, sharder in resolved.sharders:
        sub = module.get_submodule(path)
        for attr, pl in sharder.param_layouts(sub, mesh).items():
            layouts[f"{path}.{attr}" if path else attr] = tuple(pl)
    rows: list[CoverageRow] = []
    named = dict(module.named_parameters(remove_duplicate=False))
    for name, p in module.named_parameters():  # tied parameters once, under their first name
        aliases = [n for n, q in named.items() if q is p]
        found = next((layouts[n] for n in aliases if n in layouts), None)
        rows.append(CoverageRow(name, tuple(p.shape), p.numel() * p.element_size(), found))
    return Coverage(tuple(rows))
