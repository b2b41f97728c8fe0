"""Answering the collectives of a dry mesh (`_mesh._dry.DryGroup`): no process, no data.

A meta (or fake) piece gets an empty meta result of the shape the real collective would
return, so a dry run's shapes, layouts and memory are those of a real run. A real piece (a
bookkeeping exchange of ints: shapes, seeds, fingerprints) gets the result it would have if
every rank of the group held the same piece, which is what a dry run assumes of them.

Point-to-point messages (pipeline stages) need their peers: `Simulation` runs the simulated
ranks of a dry run as threads taking turns, with a mailbox between them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ._collectives import AllGather, AllReduce, AllToAll, AllToAllBoxes, Broadcast, Collective, ReduceScatter

__all__ = ["SIMULATION", "DryWork", "Simulation", "answer", "dry_run_number", "post_recv", "post_send", "result_shape"]


def _with(shape: tuple[int, ...], tensor_dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[tensor_dim] = size
    return tuple(out)


def result_shape(c: Collective) -> tuple[int, ...]:
    """The shape of the tensor the collective returns on this rank."""
    if isinstance(c, AllGather):
        return _with(c.shape, c.tensor_dim, sum(c.pieces))
    if isinstance(c, ReduceScatter):
        return _with(c.shape, c.tensor_dim, c.pieces[c.index])
    if isinstance(c, AllToAll):
        mine = _with(c.shape, c.split_dim, c.split_sizes[c.index])
        return _with(mine, c.cat_dim, sum(c.cat_pieces))
    if isinstance(c, AllToAllBoxes):
        return c.out_shape
    return c.shape


def answer(c: Collective, local: torch.Tensor) -> torch.Tensor:
    """The result of `c` on a dry mesh (see the module docstring)."""
    shape = result_shape(c)
    if local.is_meta or isinstance(local, torch._subclasses.FakeTensor):
        return local.new_empty(shape)
    if isinstance(c, AllGather):
        parts = []
        for size in c.pieces:
            piece = local.narrow(c.tensor_dim, 0, min(size, local.size(c.tensor_dim)))
            if piece.size(c.tensor_dim) < size:
                pad = list(piece.shape)
                pad[c.tensor_dim] = size - piece.size(c.tensor_dim)
                piece = torch.cat([piece, piece.new_zeros(pad)], dim=c.tensor_dim)
            parts.append(piece)
        return torch.cat(parts, dim=c.tensor_dim)
    if isinstance(c, (AllReduce, ReduceScatter)):
        # every simulated rank holds the same term
        reduced = (local * c.size if c.op == "sum" else local ** c.size if c.op == "prod"
                   else local.clone() if c.op != "bxor" or c.size % 2 else torch.zeros_like(local))
        if isinstance(c, AllReduce):
            return reduced
        start = sum(c.pieces[: c.index])
        return reduced.narrow(c.tensor_dim, start, c.pieces[c.index]).contiguous()
    if isinstance(c, Broadcast):
        return local.contiguous()
    return local.new_zeros(shape)


# -- point-to-point: simulated ranks taking turns ------------------------------------------------

class Simulation:
    """The simulated ranks of a dry run, one thread each, taking turns on one process: exactly
    one runs at a time. A send never blocks (its payload goes to a mailbox); a receive whose
    message has not been sent yet hands the turn to the next rank that can run, in rank order.
    When no rank can run while some wait, those never get their message: each is told so."""

    made = 0  # dry runs so far; each has its own number (what is checked once per run is keyed by it)

    def __init__(self, ranks: Sequence[int], on_turn: Callable[[int], None]) -> None:
        Simulation.made += 1
        self.number = Simulation.made
        self.ranks = list(ranks)
        self.on_turn = on_turn
        self.cond = threading.Condition()
        self.turn: Optional[int] = None
        self.mailbox: dict[tuple[Any, ...], collections.deque[torch.Tensor]] = {}
        self.waiting: dict[int, tuple[Any, ...]] = {}
        self.finished: set[int] = set()
        self.stuck: dict[int, str] = {}

    def begin(self) -> None:
        with self.cond:
            self.turn = self.ranks[0]
            self.cond.notify_all()

    def wait_turn(self, rank: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == rank)
        self.on_turn(rank)

    def end(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.waiting.pop(rank, None)
            if self.turn == rank:
                self._pass(rank)

    def send(self, key: tuple[Any, ...], payload: torch.Tensor) -> None:
        with self.cond:
            self.mailbox.setdefault(key, collections.deque()).append(payload)

    def receive(self, rank: int, key: tuple[Any, ...]) -> torch.Tensor:
        with self.cond:
            while not self.mailbox.get(key):
                self.waiting[rank] = key
                self._pass(rank)
                self.cond.wait_for(lambda: self.turn == rank or rank in self.stuck)
                if rank in self.stuck:
                    raise RuntimeError(self.stuck[rank])
            self.waiting.pop(rank, None)
            payload = self.mailbox[key].popleft()
        self.on_turn(rank)
        return payload

    def _runnable(self, rank: int) -> bool:
        if rank in self.finished or rank in self.stuck:
            return False
        key = self.waiting.get(rank)
        return key is None or bool(self.mailbox.get(key))

    def _pass(self, me: int) -> None:
        """Give the turn to the next rank after `me` that can run (`me` included, last)."""
        start = self.ranks.index(me)
        order = self.ranks[start + 1:] + self.ranks[: start + 1]
        nxt = next((r for r in order if self._runnable(r)), None)
        if nxt is None:
            for r, (src, _dst, tag, _group) in self.waiting.items():
                self.stuck[r] = (f"simulated rank {r} waits for a message from rank {src} (tag {tag}) that is never "
                                 f"sent" + ("" if src in self.ranks else f": rank {src} is not simulated, pass it in "
                                           f"dry_run(..., ranks=[...])"))
        self.turn = nxt
        self.cond.notify_all()


SIMULATION: list[Optional[Simulation]] = [None]  # the dry run's, while one runs


def dry_run_number() -> int:
    """The number of the dry run under way (0 outside one)."""
    sim = SIMULATION[0]
    return 0 if sim is None else sim.number


def _simulation() -> Simulation:
    sim = SIMULATION[0]
    if sim is None:
        raise RuntimeError("point-to-point messages between ranks of a dry mesh need those ranks simulated: run the "
                           "code inside shardwise.debug.dry_run(fn, ..., mesh=..., ranks=[...])")
    return sim


class DryWork:
    """A send or receive on a dry mesh: a send is done when posted; a receive takes its turn
    until the message is there, then fills the buffer (a real one: a header of ints)."""

    def __init__(self, key: Optional[tuple[Any, ...]], rank: int, buffer: Optional[torch.Tensor]) -> None:
        self.key, self.rank, self.buffer, self.done = key, rank, buffer, key is None

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            assert self.key is not None and self.buffer is not None
            payload = _simulation().receive(self.rank, self.key)
            if not self.buffer.is_meta and not payload.is_meta:
                _fill(self.buffer, payload)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def _fill(buffer: torch.Tensor, payload: torch.Tensor) -> None:
    """Copy a message into a receive buffer as gloo does: a shorter message fills the front of a
    one-dimensional buffer of its dtype; a longer one is an error (gloo aborts the process)."""
    if buffer.shape == payload.shape:
        buffer.copy_(payload)
    elif buffer.dim() == 1 and buffer.dtype == payload.dtype and payload.numel() <= buffer.numel():
        buffer[:payload.numel()].copy_(payload.reshape(-1))
    else:
        raise RuntimeError(f"a message of shape {tuple(payload.shape)} ({payload.dtype}) arrived in a receive buffer of "
                           f"shape {tuple(buffer.shape)} ({buffer.dtype}): the ranks' sends and receives do not match")


def post_send(tensor: torch.Tensor, src: int, dst: int, tag: int, group: Any) -> DryWork:
    payload = tensor if tensor.is_meta else tensor.detach().clone()
    _simulation().send((src, dst, tag, group), payload)
    return DryWork(None, src, None)


def post_recv(tensor: torch.Tensor, src: int, dst: int, tag: int, group: Any) -> DryWork:
    return DryWork((src, dst, tag, group), dst, tensor)
