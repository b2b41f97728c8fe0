"""Which tokens of a sequence each context-parallel rank holds (pure arithmetic).

A sequence of `length` tokens is cut into chunks as even as possible (the first
`length % chunks` one token longer). Without load balancing there are `cp` chunks and
rank r holds chunk r. Causal attention gives late tokens more keys than early ones, so by
default (head-tail) there are `2 cp` chunks and rank r holds chunks r and 2cp-1-r: every
rank gets one early and one late chunk, and about the same work.

    length 10, cp 2, head-tail: chunks [0 1 2] [3 4 5] [6 7] [8 9]
                                 rank 0 holds 0 1 2 8 9, rank 1 holds 3 4 5 6 7

Lengths that do not divide by 2 cp are fine: the pieces are then uneven, and nothing is
padded.

>>> layout = SequenceLayout(10, 2, balanced=True)
>>> layout.positions(0), layout.positions(1)
((0, 1, 2, 8, 9), (3, 4, 5, 6, 7))
>>> layout.lengths
(5, 5)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["SequenceLayout"]


@dataclass(frozen=True)
class SequenceLayout:
    """The tokens of a `length`-long sequence that each of `cp` ranks holds."""

    length: int
    cp: int
    balanced: bool = True

    def __post_init__(self) -> None:
        if self.length < self.cp:
            raise ValueError(f"a sequence of {self.length} tokens cannot be split over cp={self.cp} ranks (every "
                             f"rank needs at least one token): use a sequence of at least {self.cp} tokens, or a "
                             "smaller cp mesh")

    @cached_property
    def _chunks(self) -> tuple[tuple[int, int], ...]:
        """(start, size) of each chunk, in sequence order."""
        n = 2 * self.cp if self.balanced else self.cp
        base, extra = divmod(self.length, n)
        out, start = [], 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            out.append((start, size))
            start += size
        return tuple(out)

    def chunk_size(self, chunk: int) -> int:
        return self._chunks[chunk][1]

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank `rank` holds, in the order its piece lays them out."""
        return (rank, 2 * self.cp - 1 - rank) if self.balanced else (rank,)

    def positions(self, rank: int) -> tuple[int, ...]:
        """The global positions of rank `rank`'s tokens, in the order of its piece."""
        out: list[int] = []
        for c in self.chunks_of(rank):
            start, size = self._chunks[c]
            out.extend(range(start, start + size))
        return tuple(out)

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        """Tokens per rank."""
        return tuple(sum(self._chunks[c][1] for c in self.chunks_of(r)) for r in range(self.cp))

    @cached_property
    def gathered(self) -> tuple[int, ...]:
        """The global positions of the tokens of every rank's piece laid one after another
        (rank 0's, then rank 1's, ...): the order an all_gather of the pieces gives."""
        return tuple(p for r in range(self.cp) for p in self.positions(r))

    def index(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.positions(rank), dtype=torch.long, device=device)

    def gathered_index(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.gathered, dtype=torch.long, device=device)
