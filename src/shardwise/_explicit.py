"""Explicit mode: communication happens only where the program says so.

Outside it, an op whose inputs are not in a layout its strategies accept redistributes them
first (an all_gather, an all_reduce of a Partial, ...), as torch's DTensor does: convenient,
and the commonest source of hidden cost. Inside `explicit()` (or with `SHARDWISE_EXPLICIT=1`
in the environment) such a move is an `ImplicitRedistributionError` instead, naming the op,
the input layouts, the collectives it would have run with their bytes, and the
`redistribute(...)` call that makes the move explicit. Explicit `redistribute` calls, moves
that need no communication (Replicate -> Shard is a local slice), and ops that need no
move run as usual; backward ops are checked alike, so a training step passes only when all
of its communication is written down (or done by a ParallelStyle, which redistributes
explicitly). Plans are cached per mode, so the check costs nothing once an op's plan is made.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from ._layout import format_placements
from ._ops import ACTIVE_MODES, op_mode

__all__ = ["EXPLICIT", "ImplicitRedistributionError", "check_explicit", "explicit"]

EXPLICIT = "explicit"
_LOCAL_KINDS = ("chunk", "partialize")


class ImplicitRedistributionError(ValueError):
    """An op would have redistributed an input (with communication) under `explicit()`."""


@contextlib.contextmanager
def explicit() -> Iterator[None]:
    """Inside the block, an op that would redistribute an input with communication raises
    `ImplicitRedistributionError` instead (see the module docstring)::

        with shardwise.explicit():
            y = x @ w            # raises if x or w must move first, naming the redistribute to write
    """
    with op_mode(EXPLICIT):
        yield


def _communicates(plan: Any) -> bool:
    """Whether a redistribute plan sends anything (local slices and size-1 mesh dims do not)."""
    for step in plan.steps:
        if step.kind in _LOCAL_KINDS:
            continue
        if step.mesh_dim >= 0 and plan.mesh_shape[step.mesh_dim] == 1:
            continue
        if step.kind == "exchange" and step.bytes == 0:
            continue
        return True
    return False


def _name(location: tuple[Any, Optional[int]]) -> str:
    key, j = location
    base = f"argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"
    return base if j is None else f"{base}[{j}]"


def check_explicit(func: Any, moves: Sequence[tuple[tuple[Any, Optional[int]], Any]]) -> None:
    """Under explicit mode, ImplicitRedistributionError when one of an op's input moves communicates."""
    if EXPLICIT not in ACTIVE_MODES[0]:
        return
    hidden = [(loc, move) for loc, move in moves if move is not None and _communicates(move.plan)]
    if not hidden:
        return
    lines = []
    for loc, move in hidden:
        src, dst = move.src, move.dst
        steps = "; ".join(str(s) for s in move.plan.steps if s.kind not in _LOCAL_KINDS)
        placements = "[" + ", ".join(repr(p) for p in dst.placements) + "]"
        lines.append(f"  {_name(loc)}: {format_placements(src.placements)} -> {format_placements(dst.placements)} "
                     f"of a {list(src.shape)} tensor, by {steps}; write `x = x.redistribute(x.device_mesh, "
                     f"{placements})` for it before the op")
    raise ImplicitRedistributionError(
        f"{func} would redistribute {len(hidden)} input{'s' if len(hidden) > 1 else ''} with communication, which "
        f"explicit mode refuses (shardwise.explicit() / SHARDWISE_EXPLICIT=1):\n" + "\n".join(lines) +
        "\nmake each move explicit as shown, or give the inputs layouts the op accepts as they are")


def _from_environment() -> None:
    if os.environ.get("SHARDWISE_EXPLICIT", "").strip() not in ("", "0"):
        ACTIVE_MODES[0] = ACTIVE_MODES[0] | {EXPLICIT}


_from_environment()
