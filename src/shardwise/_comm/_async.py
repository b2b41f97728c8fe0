"""Asynchronous collectives: one background worker per process, and program order kept.

`run_async(fn)` runs `fn` (a function issuing collectives through this package) on one
background thread, so compute on the calling thread overlaps it. Collectives must reach
every rank's process groups in the same order: the worker runs jobs first in, first out,
and every collective issued from any other thread first waits for the jobs already
submitted (`wait_pending`, which the door calls). So the order on every rank is program
order, as if everything ran synchronously; only the waiting moves to the first use of a
result.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from typing import Any, Optional, TypeVar

__all__ = ["has_pending", "run_async", "wait_pending"]

T = TypeVar("T")

_WORKER: list[Optional[concurrent.futures.ThreadPoolExecutor]] = [None]
_LAST: list[Optional[concurrent.futures.Future[Any]]] = [None]
_ON_WORKER = threading.local()


def run_async(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """Run `fn(*args)` after every collective issued before it; the result (or error) in a future."""
    worker = _WORKER[0]
    if worker is None:
        worker = _WORKER[0] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardwise-comm")
    context = contextvars.copy_context()  # the caller's comm_log() sees what the job moves

    def job() -> T:
        _ON_WORKER.active = True
        return context.run(fn, *args)

    future = worker.submit(job)
    _LAST[0] = future
    return future


def has_pending() -> bool:
    """Whether a job was submitted since the last `wait_pending` (cheap: read before every collective)."""
    return _LAST[0] is not None


def wait_pending() -> None:
    """Wait until every asynchronous job submitted so far is done (their errors are raised
    where their results are used, not here). A no-op on the worker itself."""
    last = _LAST[0]
    if last is not None and not getattr(_ON_WORKER, "active", False):
        concurrent.futures.wait([last])
        _LAST[0] = None
