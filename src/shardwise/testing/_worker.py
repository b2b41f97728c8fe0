"""The worker side of the pool: join the gloo process group, then run tasks until told to stop.

Protocol over one duplex pipe per rank, every frame a plain `pickle` (never
multiprocessing's pickler, which would move tensors through shared memory):

| direction | frame | meaning |
|---|---|---|
| worker -> parent | `Done(None, {})` | joined the process group, ready |
| parent -> worker | `(sys.path, modules, task bytes)` | run `fn(*args, **kwargs)` from the task bytes |
| worker -> parent | `Done(value, counts)` or `Raised(summary, traceback)` | the task's outcome |
| parent -> worker | `b""` (or the pipe closes) | leave the process group and exit |

The task is pickled twice so the worker can prepare before it unpickles the function:
extend `sys.path` (pytest puts the rootdir there after the pool may have started) and
import `modules`, the body's test module if pytest rewrote its asserts, the same way.

Between tasks the worker puts back what a body may cheaply change (RNG state, default
dtype, grad mode, thread count, environment, working directory). What it cannot put
back it reports: `Done.counts` (collectives issued per process group) lets the parent
see ranks that fell out of step, and a missing default group sends no counts at all.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .._mesh import POINT_TO_POINT
from ._asserts import import_rewritten

__all__ = ["Done", "Raised", "serve", "HARNESS_DIR"]

HARNESS_DIR = os.path.dirname(__file__)  # frames from here are the harness's, not the body's


@dataclass(frozen=True)
class Done:
    """A task returned `value`; `counts` maps process-group name to collectives issued so far.

    `counts` is None when the default process group is gone (the body destroyed it);
    `threads` is how many threads the worker holds (each gloo group it joined keeps some).
    """

    value: Any
    counts: Optional[dict[str, int]]
    threads: int = 0


@dataclass(frozen=True)
class Raised:
    """A task (or start-up) raised; `summary` is the exception's type and first line."""

    summary: str
    traceback: str


def serve(rank: int, world_size: int, port: int, conn: Connection, env: dict[str, str], stack_path: str) -> None:
    """Entry point of worker `rank`: set up, join the group, then serve tasks from `conn`."""
    os.environ.update(env)
    torch.set_num_threads(1)
    # A crash (faulthandler.enable) or a SIGUSR1 from the parent (a rank that did not
    # finish) writes this process's Python stacks to a file the parent puts in its report.
    stacks = open(stack_path, "w")  # kept open for the life of the process
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        timeout = timedelta(seconds=float(env["SHARDWISE_COLLECTIVE_TIMEOUT"]))
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:
        conn.send_bytes(pickle.dumps(_raised(exc)))
        return
    conn.send_bytes(pickle.dumps(Done(None, {})))
    fresh = _Fresh()
    while True:
        try:
            frame = conn.recv_bytes()
        except EOFError:
            break
        if not frame:
            break
        conn.send_bytes(_run(frame))
        fresh.restore()
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(frame: bytes) -> bytes:
    paths, rewritten, task = pickle.loads(frame)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    try:
        for module in rewritten:
            import_rewritten(module)
        fn, args, kwargs = pickle.loads(task)
        value = fn(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        return pickle.dumps(_raised(exc), pickle.HIGHEST_PROTOCOL)
    counts = _collective_counts() if dist.is_initialized() else None
    try:
        return pickle.dumps(Done(value, counts, _threads()), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return pickle.dumps(Raised(f"returned {type(value).__name__} that cannot be pickled: {exc}", ""))


def _threads() -> int:
    """This process's threads, the native ones included (Linux), else the Python ones."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _raised(exc: BaseException) -> Raised:
    """`exc` as text, from the first frame outside the harness (all of it if it has none)."""
    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == HARNESS_DIR:
        tb = tb.tb_next
    lines = str(exc).strip().splitlines()
    summary = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return Raised(summary, "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__)))


def _collective_counts() -> dict[str, int]:
    # Every collective, point-to-point included, advances a group's sequence number on
    # each member; members that disagree have issued different collectives. The group of
    # moves between meshes carries point-to-point messages only, which differ by nature.
    # A group whose backend keeps no sequence number (torchtitan's "fake" groups for mesh
    # dims of size 1) has nothing to compare: it is left out, not a failure of the body.
    counts: dict[str, int] = {}
    for pg in c10d._world.pg_map:
        if pg.group_name in POINT_TO_POINT:
            continue
        try:
            counts[pg.group_name] = pg._get_sequence_number_for_group()  # type: ignore[attr-defined]
        except RuntimeError:
            continue
    return counts


class _Fresh:
    """What a newly started worker looks like, to put back after each task."""

    def __init__(self) -> None:
        self.rng = torch.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.env = dict(os.environ)
        self.cwd = os.getcwd()

    def restore(self) -> None:
        torch.set_rng_state(self.rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
