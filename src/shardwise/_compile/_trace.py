"""Collectives as graph nodes while `compile` traces: one opaque op per collective record.

`compile` traces with `make_fx` over real pieces, so the door would run each collective
for real, as Python calls a tracer sees inside of. While a trace runs,
`collectives_as_nodes()` installs a door hook (`_comm.Interceptor`) that takes over every
tensor collective and issues it as one `shardwise::collective` node (the door's op,
`_comm/_traced.py`): the node's kernel runs the same record through the door (with the hook
suspended, so the hooks below it, `comm_log()` among them, see it) at every replay.

The block yields a `Trace`, which `current_trace()` returns to code running inside it: a
caller whose host work must happen at every replay (a pipeline's messages, whose headers
carry shapes and failures) files it as a `shardwise::host` node (`Trace.host`, `_host`), registers
hooks the replay calls before the graph and when it raises (`Trace.on_replay`), or says why
the trace cannot be replayed (`Trace.refuse`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Optional

import torch

from .. import _comm
from ._host import HostFn, host_node
from ._host import forget as forget_hosts

__all__ = ["Trace", "collectives_as_nodes", "current_trace"]

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
            return _comm.as_node(collective, local, self.made)


class Trace:
    """One running trace: the numbers its nodes use (`calls`, the collectives' records, and
    `hosts`, the host steps: keep them while the graph lives, `forget` them after), the hooks
    its replays call, and why it may not be replayed (`refused`)."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls
        self.hosts: list[int] = []
        self.begin: list[Callable[[], None]] = []
        self.failed: list[Callable[[BaseException], None]] = []
        self.refused: Optional[str] = None

    def host(self, fn: HostFn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`fn(inputs)` now and at every replay, as one node (see `_host.host_node`);
        `fn` runs as eager code, with no trace current (so the code it calls is not traced twice)."""
        def untraced(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            saved, _CURRENT.trace = getattr(_CURRENT, "trace", None), None
            try:
                return fn(parts)
            finally:
                _CURRENT.trace = saved

        return host_node(untraced, inputs, self.hosts)

    def on_replay(self, begin: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        """Call `begin()` before every replay of the graph and `failed(exc)` when a replay
        raises `exc` (it may raise an error of its own instead; the replay re-raises `exc` after)."""
        self.begin.append(begin)
        self.failed.append(failed)

    def refuse(self, reason: str) -> None:
        """This trace cannot be replayed: the function runs eagerly, warning with `reason`."""
        if self.refused is None:
            self.refused = reason

    def forget(self) -> None:
        """Drop the records and host steps of this trace's graph: it will not run again."""
        _comm.forget(self.calls)
        forget_hosts(self.hosts)


_CURRENT = threading.local()


def current_trace() -> Optional[Trace]:
    """The trace running on this thread, or None."""
    return getattr(_CURRENT, "trace", None)


@contextlib.contextmanager
def collectives_as_nodes() -> Iterator[Trace]:
    """Inside the block, tensor collectives run as `shardwise::collective` nodes; yields the
    block's `Trace`."""
    _comm.wait_pending()  # a background redistribute started before the trace finishes outside it
    hook = _AsNodes()
    trace = Trace(hook.made)
    with _LOCK, _comm.intercept(hook):
        _CURRENT.trace = trace
        try:
            yield trace
        finally:
            _CURRENT.trace = None
