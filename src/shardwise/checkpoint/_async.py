"""The save running in the background: at most one per process, and never a failure unseen.

`async_save` hands the writing half of a save to a thread and returns a `SaveFuture`. The
next `save`, `async_save` or `load` waits for it first (`finish_pending`), so saves never
overlap, and raises its error if nobody asked for it, so a failed save is never silent.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Optional

__all__ = ["SaveFuture", "finish_pending", "in_background"]


class SaveFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """What `async_save` returns: a Future of None that remembers whether its outcome was asked for."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self.seen = False

    def result(self, timeout: Optional[float] = None) -> None:
        self.seen = True
        return super().result(timeout)  # type: ignore[no-any-return]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self.seen = True
        return super().exception(timeout)


class _InFlight:
    """The async save of this process still running or unwaited for, if any."""

    def __init__(self) -> None:
        self.future: Optional[SaveFuture] = None


_IN_FLIGHT = _InFlight()


def finish_pending() -> None:
    """Wait for the async save in flight, if any; raise its error if nobody asked for it."""
    future, _IN_FLIGHT.future = _IN_FLIGHT.future, None
    if future is None:
        return
    error = concurrent.futures.Future.exception(future)  # waits (without counting as asked)
    if error is not None and not future.seen:
        raise RuntimeError(
            f"the async_save to {future.directory!r} failed, and its result was never asked for: {error}. "
            f"Nothing new was started. Call .result() on what async_save returns to handle its failures"
        ) from error


def in_background(write: Callable[[], None], directory: str) -> SaveFuture:
    """Run `write` on a thread of its own; its outcome is the returned future's."""
    future = SaveFuture(directory)
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            write()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    thread = threading.Thread(target=run, name=f"shardwise async_save to {directory!r}")
    _IN_FLIGHT.future = future
    thread.start()  # not a daemon: the interpreter waits for it before exiting
    return future
