"""What the automatic planner tells its user: `Candidate`, the `AutoPlanReport` of
`build_plan` and the `Comparison` of `compare`, printed as one table format.

Both tables have a row per candidate with its modelled step (compute + communication),
the bytes each rank receives and its peak memory, so a candidate compared by hand reads
against the report's row for the same roles. Under the report's table, the pipeline of the
chosen pp candidate (or of the fastest pp candidate, when another won): each stage's layers,
time and memory, and the modelled bubble.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Optional

from ..parallel import ShardingPlan
from ._cost import StepCost
from ._pipeline import PipelinePlan

__all__ = ["AutoPlanReport", "Candidate", "Comparison"]

Roles = tuple[str, ...]


@dataclass(frozen=True)
class Candidate:
    """One way to use the mesh: a role per mesh dim, its modelled cost, and whether it fits;
    for a pp candidate, the `PipelinePlan` its cost models."""

    roles: Roles
    cost: StepCost
    fits: bool
    pipeline: Optional[PipelinePlan] = None


@dataclass(frozen=True)
class AutoPlanReport:
    """What `AutoPlanner.build_plan` found: every candidate, the chosen one, its plan, and
    the seconds planning took."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    candidates: list[Candidate]
    chosen: Candidate
    plan: ShardingPlan
    seconds: float
    memory_budget: Optional[int]

    def __str__(self) -> str:
        head = (f"AutoPlanner on mesh {self.mesh_shape} {self.mesh_dim_names}: {len(self.candidates)} candidates in "
                f"{self.seconds:.2f} s" + (f", memory budget {_gib(self.memory_budget)}" if self.memory_budget else ""))
        rows = [(", ".join(f"{n}={r}" for n, r in zip(self.mesh_dim_names, c.roles)), c.cost, c.fits, c is self.chosen)
                for c in sorted(self.candidates, key=lambda c: c.cost.seconds)]
        text = _table(head, "roles", rows)
        piped = [c for c in self.candidates if c.pipeline is not None]
        if not piped:
            return text
        shown = self.chosen if self.chosen.pipeline is not None else min(piped, key=lambda c: c.cost.seconds)
        assert shown.pipeline is not None
        which = "chosen" if shown is self.chosen else "fastest pp candidate"
        roles = ", ".join(f"{n}={r}" for n, r in zip(self.mesh_dim_names, shown.roles))
        return f"{text}\n{which} ({roles}), per pipeline: {shown.pipeline.report()}"


class Comparison(Mapping[str, StepCost]):
    """`AutoPlanner.compare`'s answer: each named candidate's modelled step (`StepCost`), by
    name, in the order given; `fits[name]` says whether it is within the memory budget, and
    `str()` is a table like the report's."""

    def __init__(self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...], costs: Mapping[str, StepCost],
                 memory_budget: Optional[int]) -> None:
        self.mesh_shape, self.mesh_dim_names, self.memory_budget = mesh_shape, mesh_dim_names, memory_budget
        self._costs = dict(costs)
        self.fits = {k: memory_budget is None or c.peak_bytes <= memory_budget for k, c in self._costs.items()}

    def __getitem__(self, name: str) -> StepCost:
        return self._costs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._costs)

    def __len__(self) -> int:
        return len(self._costs)

    def __repr__(self) -> str:
        return f"Comparison({self._costs!r})"

    def __str__(self) -> str:
        head = (f"AutoPlanner.compare on mesh {self.mesh_shape} {self.mesh_dim_names}: {len(self)} candidates"
                + (f", memory budget {_gib(self.memory_budget)}" if self.memory_budget else ""))
        return _table(head, "candidate", [(k, c, self.fits[k], False) for k, c in self._costs.items()])


def _table(head: str, label: str, rows: list[tuple[str, StepCost, bool, bool]]) -> str:
    """`head`, then a row per (label, cost, fits, chosen)."""
    lines = [head, f"  {label:<22}{'step s':>10}{'compute s':>11}{'comm s':>10}{'comm':>11}{'peak/rank':>12}  fits"]
    for name, cost, fits, chosen in rows:
        lines.append(f"  {name:<22}{cost.seconds:>10.4f}{cost.compute_seconds:>11.4f}{cost.comm_seconds:>10.4f}"
                     f"{_gib(cost.comm_bytes):>11}{_gib(cost.peak_bytes):>12}  {'yes' if fits else 'no'}"
                     + (" <- chosen" if chosen else ""))
    return "\n".join(lines)


def _gib(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
