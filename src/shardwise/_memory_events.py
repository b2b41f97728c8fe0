"""What an fsdp unit holds, told to whoever follows memory (a dry run's tracker) when it changes.

Why: a memory tracker follows each storage from the op that makes it until its weak
reference dies. `fully_shard` frees a unit's unsharded parameters with `resize_(0)`
instead (the tensors stay, so the views autograd saved see the next gather), so such a
storage never dies and a tracker would count every unit as unsharded until the end; nor
could it tell a unit's gather buffer from an activation. A unit therefore says when it has
started a gather, filled its unsharded parameters or freed them (`memory_changed(unit)`),
and the tracker that listens reads what the unit holds then. With no listener (any run
but a dry run) telling costs one context-variable lookup.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Callable, Optional

__all__ = ["listening", "memory_changed"]

Listener = Callable[[Any], None]

_LISTENER: contextvars.ContextVar[Optional[Listener]] = contextvars.ContextVar("shardwise_memory_listener",
                                                                                default=None)


def memory_changed(owner: Any) -> None:
    """`owner` (an fsdp unit) has just started a gather, or filled or freed its storages in place."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(owner)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Inside the block (in this thread), `listener(owner)` hears of every `memory_changed(owner)`."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
