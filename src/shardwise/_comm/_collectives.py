"""Collectives as values: one frozen record per collective, and how each is issued.

A record says everything about one collective as this rank sees it: its kind, the
process group and its size, the mesh dims the group spans, this rank's input piece
(shape and dtype) and the sizes that make pieces uneven. So its bytes are known before
it runs, a log or a trace can describe it, and a redistribute plan can build its
collectives once and replay them. `issue(local, async_op)` makes the `torch.distributed`
call; only `_door.run` / `_door.start` call it.

gloo's all_gather and reduce_scatter need equal sizes, so uneven pieces are padded to the
largest and trimmed after. Inner tensor dims travel as they are laid out (packed into
blocks, not transposed).

| record | moves | bytes received per rank |
|---|---|---|
| `AllGather(tensor_dim, pieces)` | every rank's piece, concatenated along `tensor_dim` | (n-1) * largest piece |
| `AllToAll(split_dim, cat_dim, ...)` | piece j of `split_dim` to rank j, arrivals along `cat_dim` | exact: what arrives from others |
| `AllToAllBoxes(out_shape, sends, recvs, keep)` | boxes of the local piece to the group's ranks | exact: what arrives |
| `AllReduce(op)` | the reduction, on every rank | 2(n-1)/n * local (ring) |
| `ReduceScatter(tensor_dim, pieces, index, op)` | the reduction, piece `index` kept | (n-1) * largest piece |
| `Broadcast(src)` | `src`'s tensor, in place | local (on the receivers) |
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from .._mesh import DryGroup, simulated_rank

__all__ = [
    "AllGather",
    "AllReduce",
    "AllToAll",
    "AllToAllBoxes",
    "Box",
    "Broadcast",
    "Collective",
    "Finish",
    "Issued",
    "ReduceScatter",
]

Finish = Callable[[], torch.Tensor]
Issued = tuple[Any, Finish]  # (the Work handle, or None when synchronous; what builds the result after it)
Box = tuple[tuple[int, int], ...]  # (start, length) per tensor dim

# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "prod": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
             "bxor": dist.ReduceOp.BXOR}


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective over `group` (`size` ranks), on a local piece of `shape` and `dtype`.

    `mesh_dims`: the mesh dims the group spans (empty when it is not a mesh's group)."""

    kind: ClassVar[str] = "collective"
    group: Any
    size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_dims: tuple[int, ...] = ()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_received(self) -> int:
        """Bytes this rank receives (the cost model of the redistribute planner)."""
        raise NotImplementedError

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        raise NotImplementedError

    def __str__(self) -> str:
        dims = f" over mesh dims {list(self.mesh_dims)}" if self.mesh_dims else ""
        return f"{self.kind} of {list(self.shape)} {self.dtype} on {self.size} ranks{dims} ({self.bytes_received} B in)"


def _rank(group: Any) -> int:
    """This process's global rank, or the rank a dry mesh's group plays."""
    return simulated_rank() if type(group) is DryGroup else dist.get_rank()


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


def _finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op == "avg":
        return t.div_(n) if t.is_floating_point() or t.is_complex() else t.div(n, rounding_mode="floor")
    return t


def _with(shape: Sequence[int], tensor_dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[tensor_dim] = size
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class AllGather(Collective):
    """Concatenate every rank's piece along `tensor_dim`; `pieces[j]` is rank j's size there.

    `in_place` (1-D pieces, `tensor_dim` 0): the local tensor given is the whole output
    buffer, `size` blocks of `max(pieces)` elements, with this rank's piece already written at
    the start of block `index`; it is gathered into there, so no separate send buffer lives
    while the collective is in flight (`as_piece` gives the ordinary form)."""

    kind: ClassVar[str] = "all_gather"
    tensor_dim: int
    pieces: tuple[int, ...]
    in_place: bool = False
    index: int = 0

    @property
    def bytes_received(self) -> int:
        return (self.size - 1) * math.prod(_with(self.shape, self.tensor_dim, max(self.pieces))) * self.itemsize

    def as_piece(self, buffer: torch.Tensor) -> tuple[AllGather, torch.Tensor]:
        """The ordinary form of an in-place gather: this rank's piece out of the output buffer."""
        start = self.index * max(self.pieces)
        return replace(self, in_place=False), buffer.narrow(0, start, self.pieces[self.index])

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        n, d, pieces = self.size, self.tensor_dim, self.pieces
        biggest = max(pieces)
        if self.in_place:
            out = local.view(n, biggest)
            mine = out[self.index]
        else:
            mine = _pad_to(local, d, biggest).contiguous()
            out = mine.new_empty((n,) + tuple(mine.shape))
        work = _all_gather_single(out.view(_stacked(n, mine.shape)), mine, group=self.group, async_op=async_op)

        def finish() -> torch.Tensor:
            if d == 0 and all(p == biggest for p in pieces):
                return out.view(_stacked(n, mine.shape))
            return torch.cat([out[j].narrow(d, 0, p) for j, p in enumerate(pieces)], dim=d)

        return work, finish


@dataclass(frozen=True, kw_only=True, slots=True)
class AllToAll(Collective):
    """Split the local piece along `split_dim` (`split_sizes[j]` to rank j) and concatenate
    what arrives along `cat_dim` (`cat_pieces[j]` from rank j); `index`: this rank's place.
    Moves (n-1)/n of the local piece, the all_to_all lower bound."""

    kind: ClassVar[str] = "all_to_all"
    split_dim: int
    cat_dim: int
    split_sizes: tuple[int, ...]
    cat_pieces: tuple[int, ...]
    index: int

    def _recv_shapes(self) -> list[tuple[int, ...]]:
        mine = _with(self.shape, self.split_dim, self.split_sizes[self.index])
        return [_with(mine, self.cat_dim, p) for p in self.cat_pieces]

    @property
    def bytes_received(self) -> int:
        shapes = self._recv_shapes()
        return sum(math.prod(s) for j, s in enumerate(shapes) if j != self.index) * self.itemsize

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        sends = torch.split(local, list(self.split_sizes), dim=self.split_dim)
        send_numels = [p.numel() for p in sends]
        flat_in = local.new_empty(sum(send_numels))
        for piece, chunk in zip(sends, torch.split(flat_in, send_numels)):
            chunk.view(piece.shape).copy_(piece)
        recv_shapes = self._recv_shapes()
        recv_numels = [math.prod(s) for s in recv_shapes]
        flat_out = local.new_empty(sum(recv_numels))
        work = dist.all_to_all_single(flat_out, flat_in, output_split_sizes=recv_numels,
                                      input_split_sizes=send_numels, group=self.group, async_op=async_op)

        def finish() -> torch.Tensor:
            arrived = [chunk.view(s) for chunk, s in zip(torch.split(flat_out, recv_numels), recv_shapes)]
            return torch.cat(arrived, dim=self.cat_dim)

        return work, finish


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (start, length) in enumerate(box):
        t = t.narrow(d, start, length)
    return t


@dataclass(frozen=True, kw_only=True, slots=True)
class AllToAllBoxes(Collective):
    """One all_to_all over the group that builds a new piece of `out_shape`.

    `sends`: (group rank, box of the local piece) to send there; `recvs`: (group rank, box
    of the result) that arrives from there; `keep`: (box of the local piece, box of the
    result) copied locally. Exact sizes, no padding."""

    kind: ClassVar[str] = "all_to_all"
    out_shape: tuple[int, ...]
    sends: tuple[tuple[int, Box], ...]
    recvs: tuple[tuple[int, Box], ...]
    keep: Optional[tuple[Box, Box]]

    @property
    def bytes_received(self) -> int:
        return sum(math.prod(length for _, length in box) for _, box in self.recvs) * self.itemsize

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        n = self.size
        send_numels, recv_numels = [0] * n, [0] * n
        for rank, box in self.sends:
            send_numels[rank] = math.prod(length for _, length in box)
        for rank, box in self.recvs:
            recv_numels[rank] = math.prod(length for _, length in box)
        flat_in = local.new_empty(sum(send_numels))
        offsets = list(itertools.accumulate(send_numels, initial=0))
        for rank, box in self.sends:
            piece = _region(local, box)
            flat_in.narrow(0, offsets[rank], send_numels[rank]).view(piece.shape).copy_(piece)
        flat_out = local.new_empty(sum(recv_numels))
        out = local.new_empty(self.out_shape)
        if self.keep is not None:  # before the collective: the local part needs no wait
            _region(out, self.keep[1]).copy_(_region(local, self.keep[0]))
        work = dist.all_to_all_single(flat_out, flat_in, output_split_sizes=recv_numels,
                                      input_split_sizes=send_numels, group=self.group, async_op=async_op)

        def finish() -> torch.Tensor:
            starts = list(itertools.accumulate(recv_numels, initial=0))
            for rank, box in self.recvs:
                target = _region(out, box)
                target.copy_(flat_out.narrow(0, starts[rank], recv_numels[rank]).view(target.shape))
            return out

        return work, finish


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduce(Collective):
    """Reduce over the group with `op` (sum, avg, max, min); every rank gets the result (a new tensor)."""

    kind: ClassVar[str] = "all_reduce"
    op: str

    @property
    def bytes_received(self) -> int:
        return int(2 * (self.size - 1) / self.size * math.prod(self.shape) * self.itemsize)

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        out = local.contiguous().clone()
        work = dist.all_reduce(out, op=_DIST_OPS[self.op], group=self.group, async_op=async_op)
        return work, lambda: _finish_avg(out, self.op, self.size)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReduceScatter(Collective):
    """Reduce over the group and keep piece `index` along `tensor_dim` (`pieces[j]` sizes).
    The pieces are packed one after another (padded to the largest), not transposed.

    `donated`: the caller gives up `local` (a packed buffer it made for this). gloo's
    reduce_scatter clones its input and all-reduces the clone; a donated contiguous CPU
    buffer split along dim 0 is all-reduced in place instead and this rank's piece copied
    out: the same collective on the wire, one whole buffer fewer at the peak."""

    kind: ClassVar[str] = "reduce_scatter"
    tensor_dim: int
    pieces: tuple[int, ...]
    index: int
    op: str
    donated: bool = False

    @property
    def bytes_received(self) -> int:
        return (self.size - 1) * math.prod(_with(self.shape, self.tensor_dim, max(self.pieces))) * self.itemsize

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        d, pieces, n = self.tensor_dim, self.pieces, self.size
        if self.donated and d == 0 and local.device.type == "cpu" and local.is_contiguous():
            work = dist.all_reduce(local, op=_DIST_OPS[self.op], group=self.group, async_op=async_op)
            start = sum(pieces[: self.index])

            def finish_in_place() -> torch.Tensor:
                return _finish_avg(local.narrow(0, start, pieces[self.index]).clone(), self.op, n)

            return work, finish_in_place
        biggest = max(pieces)
        packed = _blocks(local, d, pieces, biggest)  # (n * biggest, ...) or (n, ..., biggest, ...)
        shape = _with(local.shape, d, biggest)
        out = local.new_empty(shape)
        work = _reduce_scatter_single(out, packed.view(_stacked(n, shape)) if d else packed,
                                      op=_DIST_OPS[self.op], group=self.group, async_op=async_op)

        def finish() -> torch.Tensor:
            mine = _finish_avg(out, self.op, n)
            return mine if pieces[self.index] == biggest else mine.narrow(d, 0, pieces[self.index]).contiguous()

        return work, finish


@dataclass(frozen=True, kw_only=True, slots=True)
class Broadcast(Collective):
    """Global rank `src`'s tensor on every rank of the group (in place on a contiguous copy)."""

    kind: ClassVar[str] = "broadcast"
    src: int

    @property
    def bytes_received(self) -> int:
        return 0 if _rank(self.group) == self.src else math.prod(self.shape) * self.itemsize

    def issue(self, local: torch.Tensor, async_op: bool) -> Issued:
        t = local.contiguous()
        work = dist.broadcast(t, src=self.src, group=self.group, async_op=async_op)
        return work, lambda: t
