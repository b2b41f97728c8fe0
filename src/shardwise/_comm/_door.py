"""The door every collective goes through, and the one interface for hooking into it.

`run(collective, local)` issues one collective record (see `_collectives`) and returns
its result; `start(collective, local)` issues it without waiting. Before either, the
door waits for background jobs submitted earlier (`_async`), so every rank issues
collectives in program order.

Everything that wants to see or change collectives installs an `Interceptor` for the
length of a block with `intercept(hook)`; hooks stack, innermost last:

| hook method | called | used by |
|---|---|---|
| `observe(record)` | once per collective issued, with its `CommRecord` | `comm_log()` (counting) |
| `takes_over(collective)` / `run(collective, local)` | instead of issuing it | `shardwise.compile` (a trace records a graph node) |
| `synchronous` | read by `start` and the background path | a trace: collectives complete where issued |

A hook that takes a collective over and wants it to run after all (a graph node's
kernel) calls `run` again inside `suspended(hook)`, so the hooks below it see it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
from collections.abc import Iterator
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .._mesh import collective_timeout
from .._mesh import DryGroup
from . import _dry
from ._async import has_pending, wait_pending
from ._collectives import AllGather, AllReduce, Broadcast, Collective, Finish, ReduceScatter
from ._fault import CollectiveError, checking, diagnose, group_ranks, next_number, note_process, verify_agreement
from ._traced import LIB, as_node, is_traced, record

__all__ = [
    "CommRecord",
    "Interceptor",
    "Started",
    "comm_log",
    "intercept",
    "must_be_synchronous",
    "notify",
    "run",
    "start",
    "suspended",
]


@dataclass(frozen=True)
class CommRecord:
    """One collective as this rank saw it: its kind, group size and bytes received."""

    op: str
    group_size: int
    bytes_received: int
    mesh_dims: tuple[int, ...] = field(default=(), kw_only=True)  # the mesh dims the group spans, when known


class Interceptor:
    """A hook on the door (see the module docstring); the defaults do nothing."""

    synchronous: bool = False

    def observe(self, record: CommRecord) -> None:
        """Told of each collective as it is issued, on this rank."""

    def takes_over(self, collective: Collective) -> bool:
        """Whether `run` below replaces issuing this collective."""
        return False

    def run(self, collective: Collective, local: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


_HOOKS: contextvars.ContextVar[tuple[Interceptor, ...]] = contextvars.ContextVar("shardwise_comm_hooks", default=())


@contextlib.contextmanager
def intercept(hook: Interceptor) -> Iterator[Interceptor]:
    """Install `hook` on the door for the block (innermost last)."""
    token = _HOOKS.set(_HOOKS.get() + (hook,))
    try:
        yield hook
    finally:
        _HOOKS.reset(token)


@contextlib.contextmanager
def suspended(hook: Interceptor) -> Iterator[None]:
    """Inside the block, `hook` is not installed (the hooks below it still are)."""
    token = _HOOKS.set(tuple(h for h in _HOOKS.get() if h is not hook))
    try:
        yield
    finally:
        _HOOKS.reset(token)


def must_be_synchronous() -> bool:
    """Whether an installed hook needs collectives to complete where they are issued."""
    return any(h.synchronous for h in _HOOKS.get())


def notify(record: CommRecord) -> None:
    """Tell the installed hooks of a collective issued outside `run` / `start` (point-to-point)."""
    for hook in _HOOKS.get():
        hook.observe(record)


def _record(collective: Collective) -> CommRecord:
    group = collective.group
    dims = group.dims if type(group) is DryGroup else collective.mesh_dims
    return CommRecord(collective.kind, collective.size, collective.bytes_received, mesh_dims=dims)


def _ordinary(collective: Collective, local: torch.Tensor, hooks: tuple[Interceptor, ...]
              ) -> tuple[Collective, torch.Tensor]:
    """An in-place all_gather as its ordinary form (this rank's piece) where a dry run answers
    it or a hook runs it; anything else as it is."""
    if isinstance(collective, AllGather) and collective.in_place and (
            type(collective.group) is DryGroup or any(h.synchronous or h.takes_over(collective) for h in hooks)):
        return collective.as_piece(local)
    return collective, local


def _answer_dry(collective: Collective, local: torch.Tensor) -> torch.Tensor:
    """A dry mesh's collective: told to every hook, answered without a process (`_dry`)."""
    record = _record(collective)
    for hook in _HOOKS.get():
        hook.observe(record)
    return _dry.answer(collective, local)


def run(collective: Collective, local: torch.Tensor, *, traceable: bool = True) -> torch.Tensor:
    """Issue `collective` on this rank's `local` piece and return the result.

    `traceable=False` for bookkeeping collectives (ranks agreeing on shapes or seeds): a
    hook never takes those over."""
    if has_pending():
        wait_pending()
    if is_traced(local):  # torch.compile tracing: a graph node, run when the graph runs
        return as_node(collective, local)
    hooks = _HOOKS.get()
    collective, local = _ordinary(collective, local, hooks)
    if type(collective.group) is DryGroup:
        return _answer_dry(collective, local)
    if hooks:
        if traceable:
            for hook in reversed(hooks):
                if hook.takes_over(collective):
                    return hook.run(collective, local)
        record = _record(collective)
        for hook in hooks:
            hook.observe(record)
    number = _number(collective)
    try:
        if local.device.type != "cpu":  # NCCL: a timed wait would block the CPU until the GPU is done
            return collective.issue(local, False)[1]()
        work, finish = collective.issue(local, True)
        work.wait(_timeout())  # at most SHARDWISE_COLLECTIVE_TIMEOUT as it is now, whatever the group's own
        return finish()
    except CollectiveError:
        raise
    except RuntimeError as exc:
        raise diagnose([str(collective)], group_ranks(collective.group), number, exc) from exc


def _number(collective: Collective) -> int:
    """Count the collective on its group (and, under SHARDWISE_CHECK, check the ranks agree on it)."""
    if not _NOTED[0]:
        _NOTED[0] = True
        note_process()
    number = next_number(collective.group)
    if checking():
        verify_agreement([str(collective)], collective.group, collective.size, number, _signature(collective),
                         _timeout())
    return number


_NOTED = [False]
_TIMEOUT: list[Any] = [None, None]  # (the env value read, the timedelta)


def _timeout() -> timedelta:
    raw = os.environ.get("SHARDWISE_COLLECTIVE_TIMEOUT")
    if raw != _TIMEOUT[0] or _TIMEOUT[1] is None:
        _TIMEOUT[0], _TIMEOUT[1] = raw, collective_timeout()
    return _TIMEOUT[1]  # type: ignore[no-any-return]
_KIND_CODES = {"all_gather": 1, "all_to_all": 2, "all_reduce": 3, "reduce_scatter": 4, "broadcast": 5}


def _signature(c: Collective) -> list[int]:
    """What every rank of a collective must agree on, as two ints: its kind, and a digest of
    the sizes and dtype all ranks share (a rank's own piece may legitimately differ)."""
    agreed: tuple[Any, ...] = ()
    if isinstance(c, AllGather):
        agreed = (c.pieces, c.shape[: c.tensor_dim] + c.shape[c.tensor_dim + 1 :])
    elif isinstance(c, ReduceScatter):
        agreed = (c.pieces, c.shape, c.op)
    elif isinstance(c, AllReduce):
        agreed = (c.shape, c.op)
    elif isinstance(c, Broadcast):
        agreed = (c.shape, c.src)
    digest = hashlib.blake2b(repr((agreed, str(c.dtype))).encode(), digest_size=7).digest()
    return [_KIND_CODES.get(c.kind, 0), int.from_bytes(digest, "big")]


class Started:
    """A collective issued asynchronously: `result()` waits for it and builds the result
    (once); `done()` says whether waiting would return at once."""

    __slots__ = ("_work", "_finish", "_value", "_collective", "_number", "_timed")

    def __init__(self, work: object, finish: Optional[Finish], value: Optional[torch.Tensor] = None,
                 collective: Optional[Collective] = None, number: int = 0, timed: bool = False) -> None:
        self._work, self._finish = work, finish
        self._value = value
        self._collective, self._number, self._timed = collective, number, timed

    def done(self) -> bool:
        return self._value is not None or bool(self._work.is_completed())  # type: ignore[attr-defined]

    def result(self) -> torch.Tensor:
        if self._value is None:
            try:
                if self._collective is not None and self._collective.group is not None and self._timed:
                    self._work.wait(_timeout())  # type: ignore[attr-defined]
                else:
                    self._work.wait()  # type: ignore[attr-defined]
            except RuntimeError as exc:
                assert self._collective is not None
                raise diagnose([str(self._collective)], group_ranks(self._collective.group), self._number,
                               exc) from exc
            assert self._finish is not None
            self._value = self._finish()
        return self._value


def start(collective: Collective, local: torch.Tensor) -> Started:
    """Issue `collective` without waiting: the process group runs it in the background, in
    issue order. Under a synchronous hook it runs here, and the handle is already done."""
    if has_pending():
        wait_pending()
    if is_traced(local):
        return Started(None, None, as_node(collective, local))
    hooks = _HOOKS.get()
    collective, local = _ordinary(collective, local, hooks)
    if type(collective.group) is DryGroup:
        return Started(None, None, _answer_dry(collective, local))
    if any(h.synchronous or h.takes_over(collective) for h in hooks):
        return Started(None, None, run(collective, local))
    if hooks:
        record = _record(collective)
        for hook in hooks:
            hook.observe(record)
    number = _number(collective)
    try:
        work, finish = collective.issue(local, True)
    except RuntimeError as exc:
        raise diagnose([str(collective)], group_ranks(collective.group), number, exc) from exc
    return Started(work, finish, None, collective, number, local.device.type == "cpu")


class _Log(Interceptor):
    def __init__(self, records: list[CommRecord]) -> None:
        self.records = records

    def observe(self, record: CommRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def comm_log() -> Iterator[list[CommRecord]]:
    """Record every collective issued inside the block (this rank's view)."""
    records: list[CommRecord] = []
    with intercept(_Log(records)):
        yield records


def _collective_kernel(local: torch.Tensor, call: int) -> torch.Tensor:
    """`shardwise::collective` (`_traced`): run record `call` on `local` through the door."""
    out = run(record(call), local)
    # the op's schema promises a fresh tensor: never hand back the input itself
    return out.clone() if out is local else out


LIB.impl("collective", _collective_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
