"""The buffers a context-parallel block cuts to this rank's tokens, and gives back whole.

On entry every buffer (input ids, position ids, labels, rotary tables) is cut in place
along its sequence dim to the tokens this rank holds (`SequenceLayout`). On a normal exit
each buffer not kept cut is gathered from the ranks: what the block wrote into its pieces,
whole. On an exit by exception each gets back the whole value saved on entry instead: the
ranks may then be out of step, and a collective to gather the pieces could wait for ranks
that never come.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from .._describe import describe
from .._tensor import DTensor
from ._cp_comm import CpGroup, gather_pieces
from ._cp_layout import SequenceLayout

__all__ = ["SplitBuffers", "check_buffers", "unshard", "whole_positions"]


@dataclass(eq=False)
class SplitBuffers:
    """`buffers`, each split along its dim in `dims` by `layout` over `cp`; `keep`: the ids of
    those left cut on exit (`no_restore_buffers`)."""

    buffers: list[torch.Tensor]
    dims: list[int]
    keep: set[int]
    layout: SequenceLayout
    cp: CpGroup
    saved: list[Optional[torch.Tensor]] = field(default_factory=list)  # the whole values, taken by `cut`

    def cut(self) -> None:
        """Each buffer in place to this rank's tokens (the whole values saved first)."""
        self.saved = [b.clone() if id(b) not in self.keep else None for b in self.buffers]
        for b, d in zip(self.buffers, self.dims):
            _set(b, b.index_select(d, self.layout.index(self.cp.rank, b.device)))

    def restore(self, failed: bool) -> None:
        """Each buffer not kept whole again: gathered from the ranks, or, when the block `failed`,
        the value saved on entry (no collective)."""
        for b, d, whole in zip(self.buffers, self.dims, self.saved):
            if whole is not None:
                _set(b, whole if failed else unshard(b, d % b.dim(), self.layout, self.cp))
        self.saved = []


def check_buffers(buffers: Sequence[torch.Tensor], dims: Sequence[int]) -> int:
    """The sequence length the buffers share; every problem with them raised at once."""
    problems: list[str] = []
    if len(buffers) != len(dims):
        problems.append(f"{len(buffers)} buffers but {len(dims)} buffer_seq_dims: give one sequence dim per buffer")
    lengths = {}
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if not isinstance(b, torch.Tensor) or isinstance(b, DTensor):
            problems.append(f"buffers[{i}] is {describe(b)}: buffers are plain tensors, whole on every rank")
            continue
        if not -b.dim() <= d < b.dim():
            problems.append(f"buffer_seq_dims[{i}]={d} is out of range for buffers[{i}] of shape {tuple(b.shape)}")
            continue
        lengths[i] = b.size(d)
    if len(set(lengths.values())) > 1:
        problems.append("the buffers' sequence dims differ in length: " +
                        ", ".join(f"buffers[{i}] {n}" for i, n in lengths.items()) +
                        ": list buffers of one sequence, with the dim that runs along it")
    if problems:
        raise ValueError("context_parallel:\n" + "\n".join(f"  - {p}" for p in problems))
    return next(iter(lengths.values()), 0)


def whole_positions(position_ids: Optional[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    """A copy of the whole (batch, seq) position ids (taken before the buffers are cut)."""
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or isinstance(position_ids, DTensor):
        raise TypeError(f"context_parallel(position_ids=...) takes a plain tensor, got {describe(position_ids)}")
    positions = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    if positions.dim() != 2 or positions.size(-1) != length or positions.is_floating_point():
        raise ValueError(f"context_parallel(position_ids=...) takes integer position ids of shape (batch, {length}) "
                         f"(the buffers' sequence length), got {positions.dtype} of shape {tuple(position_ids.shape)}")
    return positions.detach().clone()


def unshard(local: torch.Tensor, dim: int, layout: SequenceLayout, cp: CpGroup) -> torch.Tensor:
    """The whole buffer from every rank's piece (gathered rank by rank, then put in sequence order)."""
    gathered = gather_pieces(local, dim, layout.lengths, cp)
    whole = torch.empty_like(gathered)
    return whole.index_copy_(dim, layout.gathered_index(local.device), gathered)


def _set(buffer: torch.Tensor, value: torch.Tensor) -> None:
    if buffer.requires_grad:  # a leaf the block made require grad: autograd refuses resize_ on it
        buffer.data = value.detach().clone()
        return
    with torch.no_grad():
        buffer.resize_(value.shape)
        buffer.copy_(value)
