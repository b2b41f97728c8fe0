"""Every collective shardwise issues, in one place: the one door to `torch.distributed`.

Each function works on one rank's local tensor and a process group of `n` ranks (one
slice of one mesh dim), handles uneven pieces (gloo's all_gather and reduce_scatter need
equal sizes, so pieces are padded to the largest and trimmed after), and records what it
moved when a `comm_log()` is active. Timeouts are those of the process groups
(`collective_timeout()`), so a rank that dies or disagrees surfaces as an error, not a hang.

| transition on one mesh dim | collective here | bytes received per rank |
|---|---|---|
| S(d) -> R | `all_gather_cat` | (n-1) * piece |
| S(d) -> S(e) | `all_to_all_cat` (gloo's all_to_all_single) | (n-1)/n * local (exact sizes) |
| P -> R | `all_reduce` | 2(n-1)/n * local (ring) |
| P -> S(d) | `reduce_scatter_cat` | (n-1) * piece |
| several mesh dims at once, no Partial | `all_to_all_boxes` over the whole mesh | exactly what the rank lacks |
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, ParamSpec, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "CommRecord",
    "comm_log",
    "all_gather_cat",
    "all_to_all_cat",
    "all_to_all_boxes",
    "all_reduce",
    "reduce_scatter_cat",
    "broadcast",
    "all_gather_ints",
    "gather_over_mesh",
    "run_async",
    "wait_pending",
    "Started",
    "start",
]


P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class CommRecord:
    """One collective as this rank saw it."""

    op: str
    group_size: int
    bytes_received: int


_LOG: contextvars.ContextVar[Optional[list[CommRecord]]] = contextvars.ContextVar("shardwise_comm_log", default=None)


@contextlib.contextmanager
def comm_log() -> Iterator[list[CommRecord]]:
    """Record every collective issued inside the block (this rank's view)."""
    records: list[CommRecord] = []
    token = _LOG.set(records)
    try:
        yield records
    finally:
        _LOG.reset(token)


def _record(op: str, n: int, nbytes: float) -> None:
    log = _LOG.get()
    if log is not None:
        log.append(CommRecord(op, n, int(nbytes)))


# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases only have the old names.
# -- asynchronous collectives ----------------------------------------------------------------
# `run_async(fn)` runs `fn` (a function issuing collectives through this module) on one
# background thread per process, so compute on the calling thread overlaps it. Collectives
# must reach every rank's process groups in the same order: the worker runs jobs first in,
# first out, and every collective called from any other thread first waits for the jobs
# already submitted (`_in_order`). So the order on every rank is program order, as if
# everything ran synchronously; only the waiting moves to the first use of a result.

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


def wait_pending() -> None:
    """Wait until every asynchronous collective submitted so far is done (their errors are
    raised where their results are used, not here)."""
    last = _LAST[0]
    if last is not None and not getattr(_ON_WORKER, "active", False):
        concurrent.futures.wait([last])
        _LAST[0] = None


def _in_order(fn: Callable[P, T]) -> Callable[P, T]:
    """A collective that first waits for the asynchronous ones issued before it."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        if _LAST[0] is not None:
            wait_pending()
        return fn(*args, **kwargs)

    return call


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op == "avg":
        return t.div_(n) if t.is_floating_point() or t.is_complex() else t.div(n, rounding_mode="floor")
    return t


def _pad_to(t: torch.Tensor, tensor_dim: int, size: int) -> torch.Tensor:
    """Pad `t` along `tensor_dim` with zeros to `size`."""
    if t.size(tensor_dim) == size:
        return t
    shape = list(t.shape)
    shape[tensor_dim] = size - shape[tensor_dim]
    return torch.cat([t, t.new_zeros(shape)], dim=tensor_dim)


def _stacked(n: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of `n` blocks of `shape` laid one after another along dim 0."""
    return (n * shape[0],) + tuple(shape[1:])


def _blocks(t: torch.Tensor, tensor_dim: int, sizes: Sequence[int], block: int) -> torch.Tensor:
    """Pack the pieces of `t` along `tensor_dim` (`sizes`), each padded to `block`, one after
    another in one contiguous buffer of shape (n * block, ...) in `t`'s other dims order: the
    layout gloo's equal-size collectives read. One copy; none when `tensor_dim` is 0 and even."""
    if tensor_dim == 0 and all(s == block for s in sizes):
        return t.contiguous()
    shape = list(t.shape)
    shape[tensor_dim] = block
    make = t.new_zeros if any(s != block for s in sizes) else t.new_empty
    out = make((len(sizes),) + tuple(shape))
    start = 0
    for j, size in enumerate(sizes):
        out[j].narrow(tensor_dim, 0, size).copy_(t.narrow(tensor_dim, start, size))
        start += size
    return out.view(_stacked(len(sizes), shape)) if tensor_dim == 0 else out


Finish = Callable[[], torch.Tensor]
Issued = tuple[Any, Finish]  # (the Work handle, or None when synchronous; what builds the result after it)


def _gather(local: torch.Tensor, group: Any, n: int, tensor_dim: int, pieces: Sequence[int],
            async_op: bool) -> Issued:
    biggest = max(pieces)
    mine = _pad_to(local, tensor_dim, biggest).contiguous()
    out = mine.new_empty((n,) + tuple(mine.shape))
    work = _all_gather_single(out.view(_stacked(n, mine.shape)), mine, group=group, async_op=async_op)
    _record("all_gather", n, (n - 1) * mine.numel() * mine.element_size())

    def finish() -> torch.Tensor:
        if tensor_dim == 0 and all(p == biggest for p in pieces):
            return out.view(_stacked(n, mine.shape))
        return torch.cat([out[j].narrow(tensor_dim, 0, p) for j, p in enumerate(pieces)], dim=tensor_dim)

    return work, finish


@_in_order
def all_gather_cat(local: torch.Tensor, group: Any, n: int, tensor_dim: int, pieces: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's piece along `tensor_dim`; `pieces[j]` is rank j's size there.

    The pieces travel as they are laid out (padded to the largest along `tensor_dim`) and
    are stitched together after: no transposing copy for a split on an inner dim."""
    return _gather(local, group, n, tensor_dim, pieces, False)[1]()


def _to_all(local: torch.Tensor, group: Any, n: int, split_dim: int, cat_dim: int, split_sizes: Sequence[int],
            cat_pieces: Sequence[int], index: int, async_op: bool) -> Issued:
    me = index
    sends = torch.split(local, list(split_sizes), dim=split_dim)
    send_numels = [p.numel() for p in sends]
    flat_in = local.new_empty(sum(send_numels))
    for piece, chunk in zip(sends, torch.split(flat_in, send_numels)):
        chunk.view(piece.shape).copy_(piece)
    mine_shape = list(local.shape)
    mine_shape[split_dim] = split_sizes[me]
    recv_shapes = []
    for p in cat_pieces:
        s = list(mine_shape)
        s[cat_dim] = p
        recv_shapes.append(s)
    recv_numels = [int(torch.Size(s).numel()) for s in recv_shapes]
    flat_out = local.new_empty(sum(recv_numels))
    work = dist.all_to_all_single(
        flat_out, flat_in, output_split_sizes=recv_numels, input_split_sizes=send_numels, group=group, async_op=async_op
    )
    _record("all_to_all", n, (sum(recv_numels) - recv_numels[me]) * local.element_size())

    def finish() -> torch.Tensor:
        pieces = [chunk.view(s) for chunk, s in zip(torch.split(flat_out, recv_numels), recv_shapes)]
        return torch.cat(pieces, dim=cat_dim)

    return work, finish


@_in_order
def all_to_all_cat(
    local: torch.Tensor,
    group: Any,
    n: int,
    split_dim: int,
    cat_dim: int,
    split_sizes: Sequence[int],
    cat_pieces: Sequence[int],
    index: int,
) -> torch.Tensor:
    """Split `local` along `split_dim` (piece j to rank j) and concatenate what arrives along `cat_dim`.

    `split_sizes[j]`: size along `split_dim` of the piece sent to rank j; `cat_pieces[j]`:
    size along `cat_dim` of the piece received from rank j; `index`: this rank's
    place in the group. Moves (n-1)/n of the local
    tensor, the all_to_all lower bound, where an all_gather would move (n-1) times it.
    """
    return _to_all(local, group, n, split_dim, cat_dim, split_sizes, cat_pieces, index, False)[1]()


def _region(t: torch.Tensor, box: Sequence[tuple[int, int]]) -> torch.Tensor:
    for d, (start, length) in enumerate(box):
        t = t.narrow(d, start, length)
    return t


def _boxes(local: torch.Tensor, group: Any, n: int, out_shape: Sequence[int],
           sends: Sequence[tuple[int, Sequence[tuple[int, int]]]], recvs: Sequence[tuple[int, Sequence[tuple[int, int]]]],
           keep: Optional[tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]], async_op: bool) -> Issued:
    send_numels, recv_numels = [0] * n, [0] * n
    for rank, box in sends:
        send_numels[rank] = math.prod(length for _, length in box)
    for rank, box in recvs:
        recv_numels[rank] = math.prod(length for _, length in box)
    flat_in = local.new_empty(sum(send_numels))
    offsets = list(itertools.accumulate(send_numels, initial=0))
    for rank, box in sends:
        piece = _region(local, box)
        flat_in.narrow(0, offsets[rank], send_numels[rank]).view(piece.shape).copy_(piece)
    flat_out = local.new_empty(sum(recv_numels))
    out = local.new_empty(tuple(out_shape))
    if keep is not None:  # before the collective: the local part needs no wait
        _region(out, keep[1]).copy_(_region(local, keep[0]))
    work = dist.all_to_all_single(flat_out, flat_in, output_split_sizes=recv_numels, input_split_sizes=send_numels,
                                  group=group, async_op=async_op)
    _record("all_to_all", n, flat_out.numel() * local.element_size())

    def finish() -> torch.Tensor:
        starts = list(itertools.accumulate(recv_numels, initial=0))
        for rank, box in recvs:
            target = _region(out, box)
            target.copy_(flat_out.narrow(0, starts[rank], recv_numels[rank]).view(target.shape))
        return out

    return work, finish


@_in_order
def all_to_all_boxes(
    local: torch.Tensor,
    group: Any,
    n: int,
    out_shape: Sequence[int],
    sends: Sequence[tuple[int, Sequence[tuple[int, int]]]],
    recvs: Sequence[tuple[int, Sequence[tuple[int, int]]]],
    keep: Optional[tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]]],
) -> torch.Tensor:
    """One all_to_all over `group` (n ranks) that builds a new piece of `out_shape`.

    `sends`: (group rank, box of `local`) to send there; `recvs`: (group rank, box of the
    result) that arrives from there; `keep`: (box of `local`, box of the result) copied
    locally. A box is (start, length) per tensor dim. Exact sizes, no padding.
    """
    return _boxes(local, group, n, out_shape, sends, recvs, keep, False)[1]()


def _reduce(local: torch.Tensor, group: Any, n: int, op: str, async_op: bool) -> Issued:
    out = local.contiguous().clone()
    work = dist.all_reduce(out, op=_DIST_OPS[op], group=group, async_op=async_op)
    _record("all_reduce", n, 2 * (n - 1) / n * out.numel() * out.element_size())
    return work, lambda: _finish_avg(out, op, n)


@_in_order
def all_reduce(local: torch.Tensor, group: Any, n: int, op: str) -> torch.Tensor:
    """Reduce over the group; every rank gets the result (a new tensor)."""
    return _reduce(local, group, n, op, False)[1]()


def _scatter(local: torch.Tensor, group: Any, n: int, tensor_dim: int, pieces: Sequence[int], index: int, op: str,
             async_op: bool) -> Issued:
    biggest = max(pieces)
    packed = _blocks(local, tensor_dim, pieces, biggest)  # (n * biggest, ...) or (n, ..., biggest, ...)
    shape = list(local.shape)
    shape[tensor_dim] = biggest
    out = local.new_empty(shape)
    work = _reduce_scatter_single(out, packed.view(_stacked(n, shape)) if tensor_dim else packed,
                                  op=_DIST_OPS[op], group=group, async_op=async_op)
    _record("reduce_scatter", n, (n - 1) * out.numel() * out.element_size())

    def finish() -> torch.Tensor:
        mine = _finish_avg(out, op, n)
        return mine if pieces[index] == biggest else mine.narrow(tensor_dim, 0, pieces[index]).contiguous()

    return work, finish


@_in_order
def reduce_scatter_cat(
    local: torch.Tensor, group: Any, n: int, tensor_dim: int, pieces: Sequence[int], index: int, op: str
) -> torch.Tensor:
    """Reduce over the group and keep piece `index` along `tensor_dim` (`pieces[j]` sizes).

    The pieces are packed one after another (padded to the largest), not transposed."""
    return _scatter(local, group, n, tensor_dim, pieces, index, op, False)[1]()


class Started:
    """A collective issued asynchronously: `result()` waits for it and builds the result
    (once); `done()` says whether waiting would return at once."""

    __slots__ = ("_work", "_finish", "_value")

    def __init__(self, work: Any, finish: Finish) -> None:
        self._work, self._finish = work, finish
        self._value: Optional[torch.Tensor] = None

    def done(self) -> bool:
        return self._value is not None or bool(self._work.is_completed())

    def result(self) -> torch.Tensor:
        if self._value is None:
            self._work.wait()
            self._value = self._finish()
        return self._value


_ISSUE: dict[str, Callable[..., Issued]] = {
    "all_gather_cat": _gather, "all_to_all_cat": _to_all, "all_to_all_boxes": _boxes,
    "all_reduce": _reduce, "reduce_scatter_cat": _scatter,
}


@_in_order
def start(name: str, *args: Any) -> Started:
    """Issue the collective `name` (one of the tensor collectives above, same arguments)
    without waiting: the process group runs it in the background, in issue order."""
    work, finish = _ISSUE[name](*args, True)
    return Started(work, finish)


@_in_order
def broadcast(tensor: torch.Tensor, group: Any, n: int, src: int) -> torch.Tensor:
    """Broadcast from global rank `src` (in place on a contiguous tensor, which is returned)."""
    t = tensor.contiguous()
    dist.broadcast(t, src=src, group=group)
    if dist.get_rank() != src:
        _record("broadcast", n, t.numel() * t.element_size())
    return t


@_in_order
def all_gather_ints(values: Sequence[int], group: Any, n: int) -> list[list[int]]:
    """Every rank's list of ints (all lists the same length): for metadata checks."""
    t = torch.tensor(list(values), dtype=torch.int64)
    out = t.new_empty(n * len(values))
    _all_gather_single(out, t, group=group)
    _record("all_gather", n, (n - 1) * t.numel() * t.element_size())
    return out.view(n, len(values)).tolist()


def gather_over_mesh(values: Sequence[int], groups: Sequence[Any], mesh_shape: Sequence[int]) -> list[list[int]]:
    """Every mesh rank's `values` (same length everywhere), in row-major order of mesh coordinates.

    Gathers along the last mesh dim first, then each earlier one, so no whole-mesh group is needed.
    """
    flat = list(values)
    for i in reversed(range(len(mesh_shape))):
        n = mesh_shape[i]
        rows = all_gather_ints(flat, groups[i], n) if n > 1 else [flat]
        flat = [v for row in rows for v in row]
    width = len(values)
    return [flat[k : k + width] for k in range(0, len(flat), width)]


# -- point-to-point ---------------------------------------------------------------------------
# Pipeline stages talk to one peer at a time. Each message is recorded with its peer, tag and a
# label saying what it carries, so a test can tell which rank received what; a wait that fails
# (timeout, or the peer's process gone) raises a `P2PError` naming the peer, the tag and the label.

__all__ += ["P2PRecord", "P2PError", "P2PWork", "isend", "irecv", "send", "recv"]


@dataclass(frozen=True)
class P2PRecord(CommRecord):
    """One point-to-point message as this rank saw it: `op` is "send" or "recv", `peer` the
    global rank at the other end, `label` what the message carries; a send receives 0 bytes
    and moves `bytes_sent`."""

    peer: int
    tag: int
    label: str
    bytes_sent: int


class P2PError(RuntimeError):
    """A point-to-point send or receive that did not complete (timed out, or the peer died);
    `reason` is the message without the operation's description."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class P2PWork:
    """A posted send or receive; `wait()` blocks until it completes or raises `P2PError`."""

    def __init__(self, work: Any, op: str, peer: int, tag: int, label: str, tensor: torch.Tensor) -> None:
        self._work = work
        self.op, self.peer, self.tag, self.label = op, peer, tag, label
        self.tensor = tensor  # the buffer; kept alive until the work completes

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Wait at most `timeout` seconds (default `collective_timeout()`); return the buffer."""
        from datetime import timedelta

        from ._mesh import collective_timeout

        seconds = collective_timeout().total_seconds() if timeout is None else timeout
        try:
            self._work.wait(timedelta(seconds=seconds))
        except RuntimeError as exc:
            raise P2PError(*self._explain(str(exc), seconds)) from exc
        return self.tensor

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def _explain(self, cause: str, seconds: float) -> tuple[str, str]:
        """(message, reason) for a failure whose backend error says `cause`."""
        direction = "from" if self.op == "recv" else "to"
        what = f"{self.op} of {self.label} {direction} rank {self.peer} (tag {self.tag})"
        if "timed out" in cause.lower():
            reason = (f"nothing came within {seconds:g} s (SHARDWISE_COLLECTIVE_TIMEOUT): rank {self.peer} is stuck, "
                      f"waiting for something else, or never posted the matching {'send' if self.op == 'recv' else 'recv'}")
            return f"{what} did not complete: {reason}", reason
        if "closed" in cause.lower() or "reset" in cause.lower():
            reason = f"the connection to rank {self.peer} closed, so its process has probably died ({cause.strip()})"
        else:
            reason = cause.strip()
        return f"{what} failed: {reason}", reason


def _check_peer(op: str, peer: int, tensor: torch.Tensor) -> None:
    me = dist.get_rank()
    if peer == me:
        raise ValueError(f"{op} to or from rank {peer}, which is this rank: keep the tensor locally instead")
    if op == "irecv" and not tensor.is_contiguous():
        raise ValueError(f"irecv needs a contiguous buffer, got one of shape {tuple(tensor.shape)} and "
                         f"stride {tensor.stride()}: pass torch.empty(shape) or .contiguous()")


@_in_order
def isend(tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0, label: str = "a tensor") -> P2PWork:
    """Post a send of `tensor` to global rank `dst` of `group`; the buffer must not change until `wait()`."""
    _check_peer("isend", dst, tensor)
    buf = tensor.contiguous()
    try:
        work = dist.isend(buf, dst, group=group, tag=tag)
    except RuntimeError as exc:
        raise P2PError(*P2PWork(None, "send", dst, tag, label, buf)._explain(str(exc), 0.0)) from exc
    nbytes = buf.numel() * buf.element_size()
    log = _LOG.get()
    if log is not None:
        log.append(P2PRecord("send", 2, 0, dst, tag, label, nbytes))
    return P2PWork(work, "send", dst, tag, label, buf)


@_in_order
def irecv(tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0, label: str = "a tensor") -> P2PWork:
    """Post a receive into `tensor` (contiguous) from global rank `src` of `group`."""
    _check_peer("irecv", src, tensor)
    try:
        work = dist.irecv(tensor, src, group=group, tag=tag)
    except RuntimeError as exc:
        raise P2PError(*P2PWork(None, "recv", src, tag, label, tensor)._explain(str(exc), 0.0)) from exc
    log = _LOG.get()
    if log is not None:
        log.append(P2PRecord("recv", 2, tensor.numel() * tensor.element_size(), src, tag, label, 0))
    return P2PWork(work, "recv", src, tag, label, tensor)


def send(tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0, label: str = "a tensor",
         timeout: Optional[float] = None) -> None:
    """Send `tensor` to global rank `dst` and wait until it is received (see `P2PWork.wait`)."""
    isend(tensor, dst, group, tag=tag, label=label).wait(timeout)


def recv(tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0, label: str = "a tensor",
         timeout: Optional[float] = None) -> torch.Tensor:
    """Receive into `tensor` from global rank `src`; returns it (see `P2PWork.wait`)."""
    return irecv(tensor, src, group, tag=tag, label=label).wait(timeout)
