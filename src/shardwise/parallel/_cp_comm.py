"""The collectives of context parallelism, as autograd functions over the cp group.

| move | forward | backward |
|---|---|---|
| `gather_sequence` (K/V all-gather rotation) | all_gather of the pieces along the sequence dim | reduce_scatter (sum) of the gradient: every rank's queries add to every key's gradient |
| `all_to_all_heads` (Ulysses) | all_to_all: sequence split -> head split | the inverse all_to_all |

Pieces may be uneven (a sequence that does not divide by 2 cp); every collective goes
through `shardwise._comm`, so `comm_log` counts its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _comm as comm

__all__ = ["CpGroup", "all_to_all_heads", "gather_pieces", "gather_sequence"]


@dataclass(frozen=True)
class CpGroup:
    """The cp ranks: their process group, how many, this rank's index, their global ranks
    (in cp order), and the mesh dim."""

    group: Any
    size: int
    rank: int
    ranks: tuple[int, ...] = ()
    mesh_dim: int = 0


def gather_pieces(local: torch.Tensor, dim: int, pieces: tuple[int, ...], cp: CpGroup) -> torch.Tensor:
    """Every rank's piece laid one after another along `dim` (no autograd)."""
    record = comm.AllGather(group=cp.group, size=cp.size, shape=tuple(local.shape), dtype=local.dtype,
                            tensor_dim=dim, pieces=pieces, mesh_dims=(cp.mesh_dim,))
    return comm.run(record, local.contiguous())


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, pieces: tuple[int, ...], cp: CpGroup) -> torch.Tensor:
        ctx.dim, ctx.pieces, ctx.cp = dim, pieces, cp
        return gather_pieces(local, dim, pieces, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        cp: CpGroup = ctx.cp
        record = comm.ReduceScatter(group=cp.group, size=cp.size, shape=tuple(grad.shape), dtype=grad.dtype,
                                    tensor_dim=ctx.dim, pieces=ctx.pieces, index=cp.rank, op="sum",
                                    mesh_dims=(cp.mesh_dim,))
        return comm.run(record, grad.contiguous()), None, None, None


def gather_sequence(local: torch.Tensor, dim: int, pieces: tuple[int, ...], cp: CpGroup) -> torch.Tensor:
    """`local` (this rank's tokens along `dim`) gathered from every cp rank, rank by rank;
    its gradient is summed over the ranks and split back."""
    out: torch.Tensor = _GatherSequence.apply(local, dim, pieces, cp)  # type: ignore[no-untyped-call]
    return out


class _AllToAllHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split_dim: int, cat_dim: int, split_sizes: tuple[int, ...],
                cat_pieces: tuple[int, ...], cp: CpGroup) -> torch.Tensor:
        ctx.args = (split_dim, cat_dim, split_sizes, cat_pieces, cp)
        return _all_to_all(x, split_dim, cat_dim, split_sizes, cat_pieces, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        split_dim, cat_dim, split_sizes, cat_pieces, cp = ctx.args
        back = _all_to_all(grad, cat_dim, split_dim, cat_pieces, split_sizes, cp)
        return back, None, None, None, None, None


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, split_sizes: tuple[int, ...],
                cat_pieces: tuple[int, ...], cp: CpGroup) -> torch.Tensor:
    record = comm.AllToAll(group=cp.group, size=cp.size, shape=tuple(x.shape), dtype=x.dtype, split_dim=split_dim,
                           cat_dim=cat_dim, split_sizes=split_sizes, cat_pieces=cat_pieces, index=cp.rank,
                           mesh_dims=(cp.mesh_dim,))
    return comm.run(record, x.contiguous())


def all_to_all_heads(x: torch.Tensor, split_dim: int, cat_dim: int, split_sizes: tuple[int, ...],
                     cat_pieces: tuple[int, ...], cp: CpGroup) -> torch.Tensor:
    """Split `x` along `split_dim` (`split_sizes[j]` to rank j) and concatenate what every rank
    sends along `cat_dim` (`cat_pieces[j]` from rank j); the backward is the inverse move."""
    out: torch.Tensor = _AllToAllHeads.apply(  # type: ignore[no-untyped-call]
        x, split_dim, cat_dim, split_sizes, cat_pieces, cp)
    return out
