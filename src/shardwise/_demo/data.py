"""The demo's data: the text shipped with the package, as character ids, in seeded batches.

Every rank builds the same global batch for a step from the step number alone, then keeps
its data-parallel share (rows `[r * b / dp, (r + 1) * b / dp)`), so the sharded run and the
single-process reference see exactly the same characters.
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["CharData"]


class CharData:
    """Character-level corpus: `vocab` distinct characters, `batch(step, size, seq)` windows."""

    def __init__(self) -> None:
        text = resources.files("shardwise._demo").joinpath("text.txt").read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.int64)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, step: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next characters), each (size, seq) int64: the same for one step everywhere."""
        g = torch.Generator().manual_seed(10_000 + step)
        starts = torch.randint(0, len(self.ids) - seq - 1, (size,), generator=g)
        rows = torch.stack([self.ids[s : s + seq + 1] for s in starts.tolist()])  # (size, seq + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())
