"""Collectives as graph nodes while `compile` traces: one opaque op per collective record.

A trace records dispatcher ops. A collective issued through `shardwise._comm` is a Python
call around `torch.distributed` (in-place c10d calls with a Work handle and padding), so a
tracer would see its insides, not one step it can replay. While a trace runs,
`collectives_as_nodes()` installs a door hook (`_comm.Interceptor`) that takes over every
tensor collective and issues `shardwise::collective(local, call)` instead: a dispatcher op
whose kernel looks up record `call` and runs it through the door (with the hook
suspended, so the hooks below it, `comm_log()` among them, see it). The trace then holds
one node per collective; replaying the node runs the same record again, through the one
door.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch

from .. import _comm

__all__ = ["COLLECTIVE", "collectives_as_nodes", "forget_calls"]

# The tensor-in, tensor-out records a trace turns into nodes (bookkeeping gathers are never offered).
_TRACED = (_comm.AllGather, _comm.AllToAll, _comm.AllToAllBoxes, _comm.AllReduce, _comm.ReduceScatter)

_CALLS: dict[int, _comm.Collective] = {}
_IDS = itertools.count()
_LOCK = threading.Lock()

_LIB = torch.library.Library("shardwise", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define("collective(Tensor local, int call) -> Tensor")  # type: ignore[no-untyped-call]


def _collective_kernel(local: torch.Tensor, call: int) -> torch.Tensor:
    out = _comm.run(_CALLS[call], local)
    # the op's schema promises a fresh tensor: never hand back the input itself
    return out.clone() if out is local else out


_LIB.impl("collective", _collective_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

COLLECTIVE = torch.ops.shardwise.collective.default


class _AsNodes(_comm.Interceptor):
    """Takes over tensor collectives: each becomes one `shardwise::collective` node."""

    synchronous = True  # a trace records collectives where they are issued, never in the background

    def __init__(self) -> None:
        self.made: list[int] = []

    def takes_over(self, collective: _comm.Collective) -> bool:
        return isinstance(collective, _TRACED)

    def run(self, collective: _comm.Collective, local: torch.Tensor) -> torch.Tensor:
        key = next(_IDS)
        _CALLS[key] = collective
        self.made.append(key)
        with _comm.suspended(self):  # the kernel runs the record through the door, past this hook
            return COLLECTIVE(local, key)  # type: ignore[no-any-return]


@contextlib.contextmanager
def collectives_as_nodes() -> Iterator[list[int]]:
    """Inside the block, tensor collectives run as `shardwise::collective` nodes; yields the
    call ids made (keep them while the graph lives, `forget_calls` after)."""
    _comm.wait_pending()  # a background redistribute started before the trace finishes outside it
    hook = _AsNodes()
    with _LOCK, _comm.intercept(hook):
        yield hook.made


def forget_calls(calls: list[int]) -> None:
    """Drop the recorded calls of a graph that will not run again."""
    for key in calls:
        _CALLS.pop(key, None)
