"""Collectives as graph nodes while `compile` traces: one opaque op that calls back into `_comm`.

A trace records dispatcher ops. The collectives in `shardwise._comm` are Python functions
over `torch.distributed` (in-place c10d calls with a Work handle and padding around them),
so a tracer would see their insides, not one step it can replay. While a trace runs,
`collectives_as_nodes()` routes the tensor collectives `_comm` offers through
`shardwise::collective(local, call)`: a dispatcher op whose kernel looks up call `call`
(the `_comm` function and its non-tensor arguments: group, sizes, tensor dims) and runs
it. The trace then holds one node per collective; replaying the node calls the same
`_comm` function, so the collective really happens again, through the one door, and
`comm_log()` sees it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _comm

__all__ = ["COLLECTIVE", "collectives_as_nodes", "forget_calls", "tracing"]

# The tensor-in, tensor-out collectives that `_redistribute` and the ops reach through the
# `_comm` module (looked up as `comm.<name>` at call time, so swapping the attribute routes them).
_ROUTED = ("all_gather_cat", "all_to_all_cat", "all_to_all_boxes", "all_reduce", "reduce_scatter_cat")

_CALLS: dict[int, tuple[Callable[..., torch.Tensor], tuple[Any, ...], dict[str, Any]]] = {}
_IDS = itertools.count()
_LOCK = threading.Lock()
_ACTIVE = [False]


def tracing() -> bool:
    """Whether a trace is recording collectives (they must then run in order, synchronously)."""
    return _ACTIVE[0]

_LIB = torch.library.Library("shardwise", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define("collective(Tensor local, int call) -> Tensor")  # type: ignore[no-untyped-call]


def _collective_kernel(local: torch.Tensor, call: int) -> torch.Tensor:
    fn, rest, kwargs = _CALLS[call]
    out = fn(local, *rest, **kwargs)
    # the op's schema promises a fresh tensor: never hand back the input itself
    return out.clone() if out is local else out


_LIB.impl("collective", _collective_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

COLLECTIVE = torch.ops.shardwise.collective.default


def _routed(fn: Callable[..., torch.Tensor], made: list[int]) -> Callable[..., torch.Tensor]:
    def call(local: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        key = next(_IDS)
        _CALLS[key] = (fn, rest, kwargs)
        made.append(key)
        return COLLECTIVE(local, key)  # type: ignore[no-any-return]

    return call


@contextlib.contextmanager
def collectives_as_nodes() -> Iterator[list[int]]:
    """Inside the block, `_comm`'s tensor collectives run as `shardwise::collective` nodes;
    yields the call ids made (keep them while the graph lives, `forget_calls` after)."""
    made: list[int] = []
    _comm.wait_pending()  # a background redistribute started before the trace finishes outside it
    with _LOCK:
        saved = {name: getattr(_comm, name) for name in _ROUTED}
        for name, fn in saved.items():
            setattr(_comm, name, _routed(fn, made))
        _ACTIVE[0] = True
        try:
            yield made
        finally:
            _ACTIVE[0] = False
            for name, fn in saved.items():
                setattr(_comm, name, fn)


def forget_calls(calls: list[int]) -> None:
    """Drop the recorded calls of a graph that will not run again."""
    for key in calls:
        _CALLS.pop(key, None)
