"""Ranks agreeing that a step of a save or a load succeeded everywhere, before the next one.

One all_gather of (failed?, a count) per rank. If a step failed on any rank, every rank
raises: the failed rank its own error (with a note saying what this means for the
checkpoint), the others a RuntimeError naming the ranks that failed. A rank that never
arrives (dead, or not calling) makes the gather fail or time out on the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

from .._comm import CollectiveError, all_gather_ints

__all__ = ["agree"]


def agree(action: str, step: str, error: Optional[Exception], group: Any, size: int,
          outcome: Union[str, Callable[[], str]], count: int = 0) -> list[int]:
    """Every rank's `count`, by group rank, once `step` of `action` succeeded on every rank
    of `group` (`size` ranks; None and 1 for one process); else raise on every rank, saying
    `outcome` (what the failure leaves behind; a callable is asked only on failure, when what
    is left behind must be looked at)."""
    rows = [[0 if error is None else 1, count]]
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
    failed = [r for r, (flag, _) in enumerate(rows) if flag]
    if not failed:
        return [n for _, n in rows]
    if error is not None and (group is None or size == 1):
        raise error  # alone: the error says it all
    ranks = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    why = f"{action} failed on {ranks} while {step}: {_said(outcome)}"
    if error is not None:
        error.add_note(why)
        raise error
    raise RuntimeError(f"{why}; the error of {ranks} says why")


def _said(outcome: Union[str, Callable[[], str]]) -> str:
    return outcome if isinstance(outcome, str) else outcome()
