"""Ranks agreeing that a step of a save or a load succeeded everywhere, before the next one.

One all_gather of (failed?, a few ints) per rank. If a step failed on any rank, every rank
raises: the failed rank its own error (with a note saying what this means for the
checkpoint), the others a RuntimeError naming the ranks that failed. A rank that never
arrives (dead, or not calling) makes the gather fail or time out on the others.

`gather_json` then hands rank 0 what every rank wrote (a JSON value per rank, packed into
ints): the width of the widest rank's value rides on the agreement before it, so the
gather itself is one all_gather of equal rows, and a failure of it names the save too.

>>> unpack(pack({"w": [[0, 2], [1, 3]]}))
{'w': [[0, 2], [1, 3]]}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from .._comm import CollectiveError, all_gather_ints

__all__ = ["agree", "agree_rows", "gather_json", "pack", "unpack"]

Outcome = Union[str, Callable[[], str]]


def agree(action: str, step: str, error: Optional[Exception], group: Any, size: int,
          outcome: Outcome, count: int = 0) -> list[int]:
    """Every rank's `count`, by group rank, once `step` of `action` succeeded on every rank
    of `group` (`size` ranks; None and 1 for one process); else raise on every rank, saying
    `outcome` (what the failure leaves behind; a callable is asked only on failure, when what
    is left behind must be looked at)."""
    return [row[0] for row in agree_rows(action, step, error, group, size, outcome, [count])]


def agree_rows(action: str, step: str, error: Optional[Exception], group: Any, size: int,
               outcome: Outcome, row: Sequence[int]) -> list[list[int]]:
    """`agree`, with a row of ints per rank (the same length on every rank) instead of one."""
    rows = [[0 if error is None else 1, *row]]
    if group is not None and size > 1:
        try:
            rows = all_gather_ints(rows[0], group, size)
        except CollectiveError as exc:
            exc.add_operation(f"{action}: agreeing that every rank finished {step}")
            exc.add_note(_said(outcome))
            raise
        except Exception as exc:
            raise RuntimeError(
                f"{action}: the ranks did not all reach the end of {step} ({exc}); every rank of the process group "
                f"must call it, with the same checkpoint_id. {_said(outcome)}"
            ) from (error or exc)
    failed = [r for r, (flag, *_) in enumerate(rows) if flag]
    if not failed:
        return [values for _, *values in rows]
    if error is not None and (group is None or size == 1):
        raise error  # alone: the error says it all
    ranks = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    why = f"{action} failed on {ranks} while {step}: {_said(outcome)}"
    if error is not None:
        error.add_note(why)
        raise error
    raise RuntimeError(f"{why}; the error of {ranks} says why")


def gather_json(action: str, what: str, packed: list[int], width: int, group: Any, size: int,
                outcome: Outcome) -> list[Any]:
    """Every rank's value (`packed` here, at most `width` ints on any rank; [] for None), by group rank."""
    if group is None or size == 1 or width == 0:
        return [unpack(packed)] * (1 if group is None or size == 1 else size)
    try:
        rows = all_gather_ints(packed + [0] * (width - len(packed)), group, size)
    except CollectiveError as exc:
        exc.add_operation(f"{action}: gathering {what}")
        exc.add_note(_said(outcome))
        raise
    return [unpack(row) for row in rows]


def pack(value: Any) -> list[int]:
    """`value` as JSON in non-negative ints for an all_gather: the length, then 7 bytes per int."""
    data = json.dumps(value, separators=(",", ":")).encode()
    padded = data.ljust(-(-len(data) // 7) * 7, b" ")
    return [len(data)] + [int.from_bytes(padded[i:i + 7], "big") for i in range(0, len(padded), 7)]


def unpack(row: Sequence[int]) -> Any:
    """The value `pack` packed (None for an empty or all-zero row: a rank that packed nothing)."""
    n = row[0] if row else 0
    if n == 0:
        return None
    return json.loads(b"".join(v.to_bytes(7, "big") for v in row[1:1 + -(-n // 7)])[:n])


def _said(outcome: Outcome) -> str:
    return outcome if isinstance(outcome, str) else outcome()
