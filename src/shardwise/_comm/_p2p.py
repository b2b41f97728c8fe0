"""Point-to-point messages: pipeline stages talk to one peer at a time.

Each message is recorded (for `comm_log()` and the other door hooks) with its peer, tag
and a label saying what it carries, so a test can tell which rank received what; a wait
that fails (timeout, or the peer's process gone) raises a `P2PError` naming the peer, the
tag and the label. Like every collective, a send or receive first waits for the
background jobs submitted before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._mesh import collective_timeout
from .._mesh import DryGroup, simulated_rank
from . import _dry
from ._async import has_pending, wait_pending
from ._door import CommRecord, notify
from ._fault import CollectiveError, diagnose, group_ranks

__all__ = ["P2PRecord", "P2PError", "P2PWork", "isend", "irecv", "received", "send", "recv"]


@dataclass(frozen=True)
class P2PRecord(CommRecord):
    """One point-to-point message as this rank saw it: `op` is "send" or "recv", `peer` the
    global rank at the other end, `label` what the message carries; a send receives 0 bytes
    and moves `bytes_sent`."""

    peer: int
    tag: int
    label: str
    bytes_sent: int


class P2PError(CollectiveError):
    """A point-to-point send or receive that did not complete (timed out, or the peer died);
    `reason` is the message without the operation's description."""


class P2PWork:
    """A posted send or receive; `wait()` blocks until it completes or raises `P2PError`."""

    def __init__(self, work: Any, op: str, peer: int, tag: int, label: str, tensor: torch.Tensor,
                 group: Any = None) -> None:
        self._work = work
        self.op, self.peer, self.tag, self.label = op, peer, tag, label
        self.tensor = tensor  # the buffer; kept alive until the work completes
        self.group = group

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Wait at most `timeout` seconds (default `collective_timeout()`); return the buffer."""
        seconds = collective_timeout().total_seconds() if timeout is None else timeout
        try:
            self._work.wait(timedelta(seconds=seconds))
        except RuntimeError as exc:
            raise self.error(exc) from exc
        return self.tensor

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def error(self, exc: BaseException) -> P2PError:
        """The error for a failure whose backend error is `exc`: the peer named, and which ranks
        of the group died, stalled or failed alongside (see `_fault`)."""
        direction = "from" if self.op == "recv" else "to"
        what = f"{self.op} of {self.label} {direction} rank {self.peer} (tag {self.tag})"
        if type(self.group) is DryGroup:  # a dry run's message that never came: no process to diagnose
            return P2PError([what], _me(self.group), cause=str(exc), reason=str(exc))
        ranks = group_ranks(self.group) if self.group is not None else ()
        if not ranks:
            ranks = tuple(sorted({_me(self.group), self.peer}))
        found = diagnose([what], ranks, None, exc, kind=P2PError)
        assert isinstance(found, P2PError)
        return found


def _me(group: Any) -> int:
    return simulated_rank() if type(group) is DryGroup else dist.get_rank()


def _check_peer(op: str, peer: int, tensor: torch.Tensor, group: Any = None) -> None:
    me = _me(group)
    if peer == me:
        raise ValueError(f"{op} to or from rank {peer}, which is this rank: keep the tensor locally instead")
    if op == "irecv" and not tensor.is_contiguous():
        raise ValueError(f"irecv needs a contiguous buffer, got one of shape {tuple(tensor.shape)} and "
                         f"stride {tensor.stride()}: pass torch.empty(shape) or .contiguous()")


def isend(tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0, label: str = "a tensor") -> P2PWork:
    """Post a send of `tensor` to global rank `dst` of `group`; the buffer must not change until `wait()`."""
    if has_pending():
        wait_pending()
    _check_peer("isend", dst, tensor, group)
    buf = tensor.contiguous()
    try:
        work = (_dry.post_send(buf, _me(group), dst, tag, group) if type(group) is DryGroup else
                dist.isend(buf, dst, group=group, tag=tag))
    except RuntimeError as exc:
        raise P2PWork(None, "send", dst, tag, label, buf, group).error(exc) from exc
    nbytes = buf.numel() * buf.element_size()
    notify(P2PRecord("send", 2, 0, dst, tag, label, nbytes))
    return P2PWork(work, "send", dst, tag, label, buf, group)


def irecv(tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0, label: str = "a tensor",
          record: bool = True) -> P2PWork:
    """Post a receive into `tensor` (contiguous) from global rank `src` of `group`. With
    `record=False` the message is not recorded now: a caller whose buffer may be longer than
    the message (which fills its front) calls `received(work, nbytes)` once it knows the size."""
    if has_pending():
        wait_pending()
    _check_peer("irecv", src, tensor, group)
    try:
        work = (_dry.post_recv(tensor, src, _me(group), tag, group) if type(group) is DryGroup else
                dist.irecv(tensor, src, group=group, tag=tag))
    except RuntimeError as exc:
        raise P2PWork(None, "recv", src, tag, label, tensor, group).error(exc) from exc
    if record:
        notify(P2PRecord("recv", 2, tensor.numel() * tensor.element_size(), src, tag, label, 0))
    return P2PWork(work, "recv", src, tag, label, tensor, group)


def received(work: P2PWork, nbytes: int) -> None:
    """Record the receive `work` (posted with `record=False`) as a message of `nbytes` bytes."""
    notify(P2PRecord("recv", 2, nbytes, work.peer, work.tag, work.label, 0))


def send(tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0, label: str = "a tensor",
         timeout: Optional[float] = None) -> None:
    """Send `tensor` to global rank `dst` and wait until it is received (see `P2PWork.wait`)."""
    isend(tensor, dst, group, tag=tag, label=label).wait(timeout)


def recv(tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0, label: str = "a tensor",
         timeout: Optional[float] = None) -> torch.Tensor:
    """Receive into `tensor` from global rank `src`; returns it (see `P2PWork.wait`)."""
    return irecv(tensor, src, group, tag=tag, label=label).wait(timeout)
