"""A persistent pool of gloo worker processes per world size: start, run a task, stop, kill.

Why a pool: a worker costs an interpreter, `import torch` and a rendezvous, seconds in
all; a suite of many multi-rank tests pays that once per world size, not once per test.
Why kill the whole pool on any failure: the other ranks may be stuck in a collective
with the rank that failed, where no message reaches them; a fresh pool is cheaper than
guessing what state they are in. Why the parent hosts the rendezvous `TCPStore` (on a
port the OS picks): no window between choosing a "free" port and binding it, in which
another program could take it.

Every wait has a deadline: start-up, each task (`timeout`), the grace period after the
first failure (`GRACE`), and stopping (`STOP_WAIT`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Union

import torch.distributed as dist

from ._report import DistributedTestError, RankFailure
from ._settings import DEFAULT_TIMEOUT, collective_timeout, default_timeout
from ._worker import HARNESS_DIR, Done, Raised, serve

__all__ = ["pool_for", "shutdown_pools"]

GRACE = 1.0  # seconds the other ranks get to report after the first failure
STOP_WAIT = 2.0  # seconds a worker gets to exit before it is killed
# Past this many threads in a worker, its pool is replaced before the next task. Every gloo group a
# body makes keeps three threads that wake up on their own: after a few hundred groups, idle
# workers held a fifth of a core each, which a long suite on two cores pays for every test after.
WORN_THREADS = 64


def shutdown_pools() -> None:
    """Stop every worker pool (workers leave their process group and exit); the next run starts afresh."""
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.ask_to_exit()
    deadline = time.monotonic() + STOP_WAIT  # all pools wind down at once
    for pool in pools:
        pool.join(deadline)
    for pool in pools:
        pool.kill()


class _Pool:
    """`world_size` spawned workers in one gloo group, each reached through its own pipe."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.closed = False
        # The rendezvous server; it lives as long as this object holds it.
        self._store: Any = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        self._dir = tempfile.TemporaryDirectory(prefix=f"shardwise-pool{world_size}-")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []  # multiprocessing's SpawnProcess
        self.worn = False  # a worker holds more than WORN_THREADS threads: replace the pool

    @classmethod
    def start(cls, world_size: int) -> _Pool:
        """Start the workers and wait until every one has joined the process group."""
        __tracebackhide__ = True
        pool = cls(world_size)
        limit = max(default_timeout(), DEFAULT_TIMEOUT)  # a short test timeout is no reason to give up on start-up
        try:
            pool._spawn()
            _, failures, pending = pool._collect(time.monotonic() + limit)
        except BaseException:
            pool.kill()
            raise
        if failures or pending:
            late = f"did not join the process group within {limit:g} s"
            pool._fail(f"starting a pool of {world_size} workers", failures, pending, late)
        return pool

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")  # never fork: the parent has torch's threads running
        world_size, port, collective = self.world_size, self._store.port, str(collective_timeout())
        for rank in range(world_size):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "SHARDWISE_COLLECTIVE_TIMEOUT": collective,
            }
            ours, theirs = ctx.Pipe()
            args = (rank, world_size, port, theirs, env, self._stack_path(rank))
            proc = ctx.Process(target=serve, args=args, name=f"shardwise-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    def alive(self) -> bool:
        return not self.closed and not wait([p.sentinel for p in self._procs], 0)

    def run(self, task: bytes, rewritten: list[str], timeout: float, name: str) -> list[Any]:
        """Run one pickled task on every rank, after importing the `rewritten` modules; see `run_distributed`."""
        __tracebackhide__ = True  # pytest shows the test's line, then the error
        frame = pickle.dumps((list(sys.path), rewritten, task), pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a dead worker is reported by _collect
                    conn.send_bytes(frame)
            done, failures, pending = self._collect(time.monotonic() + timeout)
        except BaseException:  # KeyboardInterrupt included: never leave ranks mid-task
            self.kill()
            raise
        if failures or pending:
            self._fail(name, failures, pending, f"did not finish within {timeout:g} s")
        self._check_in_step(name, done)
        self.worn = max(d.threads for d in done.values()) > WORN_THREADS
        return [done[rank].value for rank in range(self.world_size)]

    def ask_to_exit(self) -> None:
        """Tell idle workers to leave the process group and exit (see `join`, then `kill`)."""
        if self.closed:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")

    def kill(self) -> None:
        """Terminate, then kill, every worker; release the pipes, the store and the stack files."""
        if self.closed:
            return
        self.closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        self.join(time.monotonic() + STOP_WAIT)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        self.join(time.monotonic() + STOP_WAIT)
        for conn in self._conns:
            conn.close()
        self._store = None
        self._dir.cleanup()

    def join(self, deadline: float) -> None:
        """Wait until the workers have exited or `deadline` (a `time.monotonic()` value) has passed."""
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def _collect(self, deadline: float) -> tuple[dict[int, Done], list[RankFailure], list[int]]:
        """One reply per rank, until `deadline` or `GRACE` after the first failure.

        Returns the replies, the failures (ranks that exited first: usually the cause),
        and the ranks still running.
        """
        done: dict[int, Done] = {}
        exited: list[RankFailure] = []
        raised: list[RankFailure] = []
        pending = set(range(self.world_size))
        until = deadline
        while pending and (remaining := until - time.monotonic()) > 0:
            handles: dict[Any, int] = {}
            for rank in pending:
                handles[self._conns[rank]] = rank
                handles[self._procs[rank].sentinel] = rank
            for rank in sorted({handles[h] for h in wait(list(handles), remaining)}):
                pending.discard(rank)
                reply = self._read(rank)
                if isinstance(reply, Done):
                    done[rank] = reply
                    continue
                if reply is None:
                    exited.append(self._exited(rank))
                else:
                    raised.append(reply)
                until = min(until, time.monotonic() + GRACE)
        return done, exited + raised, sorted(pending)

    def _read(self, rank: int) -> Union[Done, RankFailure, None]:
        """The reply waiting on `rank`'s pipe; None if the pipe is closed (the worker is gone)."""
        conn = self._conns[rank]
        if not conn.poll():
            return None
        try:
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        except Exception as exc:
            return RankFailure(rank, f"returned a value the parent cannot unpickle: {exc}")
        if isinstance(reply, Raised):
            return RankFailure(rank, f"raised {reply.summary}", reply.traceback)
        return reply  # type: ignore[no-any-return]

    def _exited(self, rank: int) -> RankFailure:
        proc = self._procs[rank]
        proc.join(STOP_WAIT)
        code = proc.exitcode
        if code is not None and code < 0:
            what = f"exited with signal {signal.Signals(-code).name} (code {code})"
        else:
            what = f"exited with code {code}"
        return RankFailure(rank, what, self._stack(rank))

    def _fail(self, name: str, failures: list[RankFailure], pending: list[int], late: str) -> None:
        """Report the ranks still running with the stacks they are stuck in, kill the pool, raise."""
        __tracebackhide__ = True
        if failures:
            late = f"still running {GRACE:g} s after rank {failures[0].rank} failed"
        for rank in pending:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, signal.SIGUSR1)  # each dumps its Python stacks
        # wait until every dump is written whole: faulthandler writes one thread at a time, and a
        # worker with a background thread (shardwise's comm worker) writes the body's thread last
        deadline, seen = time.monotonic() + 1.0, None
        while time.monotonic() < deadline:
            now = [self._stack(rank) for rank in pending]
            if all(now) and now == seen:
                break
            seen = now
            time.sleep(0.05)
        stopped = [RankFailure(rank, late, self._stack(rank)) for rank in pending]
        self.kill()
        raise DistributedTestError(name, self.world_size, failures + stopped)

    def _check_in_step(self, name: str, done: dict[int, Done]) -> None:
        """Replace the pool if the body left the process groups unusable for the next one."""
        counts = [done[rank].counts for rank in range(self.world_size)]
        if any(c is None for c in counts):  # the default group was destroyed
            self.kill()
            return
        per_group: dict[str, dict[int, int]] = {}
        for rank, groups in enumerate(counts):
            for group, n in (groups or {}).items():
                per_group.setdefault(group, {})[rank] = n
        uneven = {g: c for g, c in per_group.items() if len(set(c.values())) > 1}
        if uneven:
            self.kill()
            detail = "; ".join(
                f"group {g!r}: " + ", ".join(f"rank {r} issued {n}" for r, n in sorted(c.items()))
                for g, c in uneven.items()
            )
            warnings.warn(
                f"{name} returned on every rank, but the ranks issued different numbers of collectives "
                f"({detail}); the pool of {self.world_size} workers was replaced so the next body starts in step",
                RuntimeWarning,
                stacklevel=4,
            )

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._dir.name, f"rank{rank}.stacks")

    def _stack(self, rank: int) -> str:
        """The Python stacks `rank` dumped, without the frames below the body (the worker's own)."""
        try:
            with open(self._stack_path(rank)) as f:
                return _body_frames(f.read().strip())
        except OSError:
            return ""


def _body_frames(dump: str) -> str:
    """A faulthandler dump without the frames below the body (the harness's and spawn's),
    and without thread addresses, so that ranks stuck in the same place read the same."""
    lines, below = [], False
    for line in dump.splitlines():
        if not line.startswith(" "):  # "Current thread 0x00007f... (most recent call first):"
            below = False
            line = re.sub(r" 0x[0-9a-f]+", "", line)
        below = below or f'File "{HARNESS_DIR}{os.sep}' in line
        if not below:
            lines.append(line)
    return "\n".join(lines)


_pools: dict[int, _Pool] = {}


def pool_for(world_size: int) -> _Pool:
    """The live pool for `world_size`, started (or replaced, if a worker died) as needed."""
    __tracebackhide__ = True
    pool = _pools.get(world_size)
    if pool is not None and pool.alive() and not pool.worn:
        return pool
    if pool is not None:
        if pool.worn:  # idle and well: let its workers leave their group before they are stopped
            pool.ask_to_exit()
            pool.join(time.monotonic() + STOP_WAIT)
        pool.kill()
        del _pools[world_size]
    pool = _Pool.start(world_size)
    _pools[world_size] = pool
    return pool


atexit.register(shutdown_pools)
