"""After a failure, the rank that hosts the process group's store stays until its peers have read it.

Why: a failing rank diagnoses its peers from the store (their arrival records, their pids).
When one of the ranks hosts that store (rank 0, under `init_process_group` with MASTER_ADDR /
MASTER_PORT or `tcp://`), it is often the first to fail, and a program exits as soon as its
error goes uncaught: the store goes with it, and a peer that failed a moment later can no
longer tell who died. So every rank says when it has finished reading (a `done` key), and the
host, before it raises, waits until each other rank has said so, is gone, or is known to be
stalled. The wait is bounded: a peer blocked in a collective when the host failed fails
within one collective timeout and then reads for at most `2 GRACE + 1` seconds, so the host
waits no longer than that after its own failure, once per process. A store hosted elsewhere
(torchrun's agent, the test harness) costs nothing; neither does success.

A stalled rank (alive, never arriving) never reads, so waiting for it only delays the
host's own error: by the whole bound, 15 s on top of a 10 s timeout. So the host leaves
out a rank that a failing rank's diagnosis found stalled (its own, or one posted in the
store) unless that rank reports a failure of its own; the caller says which (`waiting_for`).
Stalled means absent for a whole collective timeout: after a peer's death the others fail
at once, and a rank that has not arrived yet may only be late, so the host waits for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["hosts_store", "say_done", "stay_for_readers"]

_DONE = "shardwise/fault/done"


class _Stay:
    """Whether this process has waited for its readers already (it waits once)."""

    done = False


def say_done(store: Any, rank: int) -> None:
    """Record that `rank` has read all it needed from the store for its diagnosis."""
    try:
        store.set(f"{_DONE}/{rank}", "1")
    except Exception:
        pass


def stay_for_readers(store: Any, rank: int, until: float, waiting_for: Callable[[list[int]], list[int]]) -> list[int]:
    """If this process hosts `store`: wait until every other rank has said it is done, or
    `waiting_for` (given the ranks not done yet) leaves it out (gone, or stalled), at most
    until `until` (time.monotonic()); the ranks still reading then (none if this process does
    not host the store, or has waited once before)."""
    if _Stay.done or not hosts_store(store):
        return []
    _Stay.done = True
    pending = [r for r in range(dist.get_world_size()) if r != rank]
    while pending:
        pending = waiting_for([r for r in pending if not _said_done(store, r)])
        if not pending or time.monotonic() > until:
            break
        time.sleep(0.05)
    return pending


def _said_done(store: Any, rank: int) -> bool:
    try:
        return bool(store.check([f"{_DONE}/{rank}"]))
    except Exception:
        return False


def hosts_store(store: Any) -> bool:
    """Whether this process serves `store` (a TCPStore, possibly under prefixes): it holds the
    socket listening on the store's port. Without /proc, rank 0 is taken to host it unless
    torchrun's agent does."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    port = getattr(store, "port", None)
    if not isinstance(port, int):
        return False  # a HashStore or FileStore: nothing to lose with this process
    try:
        sockets = _listening(port)
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:["):-1] in sockets:
            return True
    return False


def _listening(port: int) -> set[str]:
    """The inodes of the TCP sockets listening on `port` in this network namespace."""
    found: set[str] = set()
    read = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        read += 1
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(fields[9])
    if not read:
        raise OSError("no /proc/net/tcp")
    return found
