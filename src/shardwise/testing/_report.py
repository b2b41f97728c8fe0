"""What went wrong on which rank: `RankFailure` values and the `DistributedTestError` built from them.

A failed multi-rank run usually has one cause and several casualties: rank 2 raises,
ranks 0, 1 and 3 wait for it in an all_reduce until the pool is stopped. The message
leads with a one-line summary per kind of failure, cause first, then gives each failing
rank's remote traceback (or, for a rank that was stopped, the Python stack it was stuck
in), once for all the ranks that failed alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DistributedTestError", "RankFailure"]


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure: `what` completes "rank 2 ...", `detail` is a traceback or a stack dump."""

    rank: int
    what: str
    detail: str = ""


class DistributedTestError(AssertionError):
    """A body run by `run_distributed` failed on some ranks; `failures` says how, rank by rank.

    It subclasses `AssertionError` so pytest reports it as a test failure, not an error.
    """

    def __init__(self, name: str, world_size: int, failures: Sequence[RankFailure]) -> None:
        self.name = name
        self.world_size = world_size
        self.failures = tuple(failures)
        super().__init__(_message(name, world_size, self.failures))

    def __reduce__(self) -> tuple[type[DistributedTestError], tuple[str, int, tuple[RankFailure, ...]]]:
        return type(self), (self.name, self.world_size, self.failures)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks named in the message, cause first."""
        return tuple(f.rank for f in self.failures)


def _message(name: str, world_size: int, failures: tuple[RankFailure, ...]) -> str:
    groups: dict[str, list[int]] = {}
    for failure in failures:
        groups.setdefault(failure.what, []).append(failure.rank)
    summary = "; ".join(f"{_ranks(ranks)} {_short(what)}" for what, ranks in groups.items())
    lines = [f"{name} failed on {len(failures)} of {world_size} ranks: {summary}"]
    details: dict[tuple[str, str], list[int]] = {}  # ranks that failed alike are shown once
    for failure in failures:
        if failure.detail:
            details.setdefault((failure.what, failure.detail.rstrip()), []).append(failure.rank)
    for (what, detail), ranks in details.items():
        lines += ["", f"--- {_ranks(ranks)} {_short(what)} ---", detail]
    return "\n".join(lines)


def _short(what: str, limit: int = 100) -> str:
    return what if len(what) <= limit else what[: limit - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, sorted(ranks)))
