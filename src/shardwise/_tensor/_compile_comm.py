"""Collectives as graph nodes while `compile` traces: one opaque op per collective record.

`compile` traces with `make_fx` over real pieces, so the door would run each collective
for real, as Python calls a tracer sees inside of. While a trace runs,
`collectives_as_nodes()` installs a door hook (`_comm.Interceptor`) that takes over every
tensor collective and issues it as one `shardwise::collective` node (`_comm._traced`): the
node's kernel runs the same record through the door (with the hook suspended, so the
hooks below it, `comm_log()` among them, see it) at every replay.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .. import _comm
from .._comm._traced import COLLECTIVE, as_node, forget

__all__ = ["COLLECTIVE", "collectives_as_nodes", "forget_calls"]

# The tensor-in, tensor-out records a trace turns into nodes (bookkeeping gathers are never offered).
_TRACED = (_comm.AllGather, _comm.AllToAll, _comm.AllToAllBoxes, _comm.AllReduce, _comm.ReduceScatter)

_LOCK = threading.Lock()


class _AsNodes(_comm.Interceptor):
    """Takes over tensor collectives: each becomes one `shardwise::collective` node."""

    synchronous = True  # a trace records collectives where they are issued, never in the background

    def __init__(self) -> None:
        self.made: list[int] = []

    def takes_over(self, collective: _comm.Collective) -> bool:
        return isinstance(collective, _TRACED)

    def run(self, collective: _comm.Collective, local: torch.Tensor) -> torch.Tensor:
        with _comm.suspended(self):  # the kernel runs the record through the door, past this hook
            return as_node(collective, local, self.made)


@contextlib.contextmanager
def collectives_as_nodes() -> Iterator[list[int]]:
    """Inside the block, tensor collectives run as `shardwise::collective` nodes; yields the
    call ids made (keep them while the graph lives, `forget_calls` after)."""
    _comm.wait_pending()  # a background redistribute started before the trace finishes outside it
    hook = _AsNodes()
    with _LOCK, _comm.intercept(hook):
        yield hook.made


forget_calls = forget
