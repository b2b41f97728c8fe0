"""Answering the collectives of a dry mesh (`_mesh_dry.DryGroup`): no process, no data.

A meta (or fake) piece gets an empty meta result of the shape the real collective would
return, so a dry run's shapes, layouts and memory are those of a real run. A real piece (a
bookkeeping exchange of ints: shapes, seeds, fingerprints) gets the result it would have if
every rank of the group held the same piece, which is what a dry run assumes of them.
"""

from __future__ import annotations

import torch

from ._collectives import AllGather, AllReduce, AllToAll, AllToAllBoxes, Broadcast, Collective, ReduceScatter

__all__ = ["answer", "result_shape"]


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
        reduced = local * c.size if c.op == "sum" else local ** c.size if c.op == "prod" else local.clone()
        if isinstance(c, AllReduce):
            return reduced
        start = sum(c.pieces[: c.index])
        return reduced.narrow(c.tensor_dim, start, c.pieces[c.index]).contiguous()
    if isinstance(c, Broadcast):
        return local.contiguous()
    return local.new_zeros(shape)
