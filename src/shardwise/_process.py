"""This process's life under torch.distributed: the default group it starts, the timeout of
every collective, and how it leaves.

The mesh is a value (`_mesh`); starting the world, noting who this process is for peers
that diagnose a failure, and shutting the world down at exit are things that happen once
per process, whatever meshes it builds. They live here, in one place, so the mesh code
holds no process-wide switches:

- `init_default_group` starts the default group from torchrun's environment (or a
  one-process store), sets the CUDA device, and arranges the exit below.
- `collective_timeout` is the timeout of every collective shardwise issues.
- `PROCESS` records what this process learned about itself: a collective failed (its groups
  are broken), its host and pid were posted, an exception went uncaught.
- At exit, the group is shut down after every rank got there (`_leave`), unless the process
  is failing: then a barrier would only wait out a timeout.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PROCESS", "collective_timeout", "init_default_group", "note_process"]


@dataclass
class _Process:
    collective_failed: bool = False  # a CollectiveError was raised: this process's groups are broken
    noted: bool = False  # host and pid posted in the default store (`note_process`)
    clean: bool = True  # False once an exception went uncaught: the process is failing


PROCESS = _Process()


def collective_timeout() -> timedelta:
    """Timeout of every collective shardwise issues (env `SHARDWISE_COLLECTIVE_TIMEOUT`, seconds)."""
    return timedelta(seconds=float(os.environ.get("SHARDWISE_COLLECTIVE_TIMEOUT", "300")))


def init_default_group(device_type: str, world_size: int) -> None:
    """Start the default group for a mesh of `world_size` ranks (gloo for cpu, nccl for cuda)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        store = _attempt_store()
        if store is None:
            dist.init_process_group(backend, timeout=collective_timeout())
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=collective_timeout())
    elif world_size == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=collective_timeout())
    else:
        raise RuntimeError(
            f"a mesh of {world_size} ranks needs {world_size} processes: launch with "
            f"`torchrun --nproc-per-node={world_size} script.py` (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    atexit.register(_leave)
    _note_uncaught_exceptions()


def _attempt_store() -> Any:
    """Under torchrun's agent store, a store of this attempt's own (None otherwise).

    torchrun's agent hosts one store for its whole run (`--standalone` and c10d rendezvous),
    restarts included, and torch's env:// rendezvous uses it unprefixed: after a restart
    (`--max-restarts`) the new ranks read the addresses their dead predecessors wrote there,
    and gloo fails with "connection refused" (torch 2.13, any script). Each attempt's keys go
    under `shardwise/attempt_<TORCHELASTIC_RESTART_COUNT>/` instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    client = dist.TCPStore(os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]),  # type: ignore[attr-defined]
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=collective_timeout())
    return dist.PrefixStore(f"shardwise/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",  # type: ignore[attr-defined]
                            client)


def note_process() -> None:
    """Write this process's host and pid to the default store, once, so that peers diagnosing a
    failed collective can tell whether it died (read by `_comm._fault`). Best effort: a world
    started without a store of ours (or one already torn down) has nowhere to write it, and
    the diagnosis then says it could not tell."""
    if PROCESS.noted:
        return
    PROCESS.noted = True
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"shardwise/fault/pid/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")
    except (RuntimeError, ValueError):  # no default group or store (ValueError), or the store failed (DistStoreError)
        return


def _note_uncaught_exceptions() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        PROCESS.clean = False
        previous(kind, value, tb)

    sys.excepthook = hook


def _leave() -> None:
    """At exit, shut down the group `init_default_group` started, after every rank got there.

    Left to the interpreter's teardown, a rank that finished first took the group down under
    the others' feet, and one in six runs of a 2-process script aborted after it had finished
    ("terminate called without an active exception"). A process failing with an uncaught
    exception skips the barrier (its peers may be blocked in a collective that now fails
    fast because this process leaves) and only shuts its group down; so does a process in
    which a collective failed (a `CollectiveError`, even one it caught): a peer is gone or
    stuck, and the barrier would only wait out a second timeout.
    """
    if not dist.is_initialized():
        return
    try:
        if PROCESS.clean and not PROCESS.collective_failed:
            dist.barrier()
    finally:
        dist.destroy_process_group()
