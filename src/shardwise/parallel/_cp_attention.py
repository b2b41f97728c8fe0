"""Attention over a sequence split between the cp ranks: each rank's queries against every key.

Each rank holds the queries, keys and values of its own tokens (`SequenceLayout`), in
SDPA's layout `(batch, heads, tokens, head_dim)`. The rotations:

| rotation | moves | attention on each rank | K/V bytes in per rank |
|---|---|---|---|
| `allgather` | all_gather K and V along the sequence (backward: reduce_scatter their grads) | local queries x all keys | (cp-1)/cp of K and V |
| `ring` / `alltoall` | K/V blocks passed rank to rank, each hop overlapping a block's compute (`_cp_ring`) | local queries x one block at a time, merged by log-sum-exp | (cp-1)/cp of K and V |
| `ulysses` | all_to_all q, k, v: sequence split -> head split; the output back | all queries x all keys of heads/cp heads | (cp-1)/cp of the rank's q, k, v and output |

Ulysses needs the query heads to divide by cp; grouped-query K/V with fewer heads than
that are repeated to one per query head before the all_to_all (as DeepSpeed does).

A rank's tokens are not contiguous under load balancing, so the causal rule is applied
by position: a query at global position i sees the keys at positions <= i. Every query
sees at least its own key, so no row of the mask is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._cp_comm import CpGroup, all_to_all_heads, gather_sequence
from ._cp_layout import SequenceLayout
from ._cp_ring import ring_attention

__all__ = ["CpAttention", "ROTATIONS"]

ROTATIONS = ("allgather", "ring", "alltoall", "ulysses")
Sdpa = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class CpAttention:
    """Attention for one sequence layout on one cp group, by `rotate`."""

    layout: SequenceLayout
    cp: CpGroup
    rotate: str = "allgather"

    def __call__(self, sdpa: Sdpa, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        self._check(query, key, value, attn_mask, dropout_p)
        if self.rotate == "ulysses":
            return self._ulysses(sdpa, query, key, value, is_causal, scale, enable_gqa)
        if self.rotate in ("ring", "alltoall"):
            return ring_attention(query, key, value, self.layout, self.cp, self.rotate, is_causal, scale)
        return self._allgather(sdpa, query, key, value, is_causal, scale, enable_gqa)

    def explain(self) -> str:
        kernel = {"allgather": "SDPA with a boolean mask by global position (the math kernel)",
                  "ulysses": "SDPA with a boolean mask by global position, over heads/cp heads",
                  "ring": "blockwise attention merged by log-sum-exp, point-to-point K/V blocks",
                  "alltoall": "blockwise attention merged by log-sum-exp, K/V blocks by all_to_all"}[self.rotate]
        return (f"context-parallel attention over {self.cp.size} ranks, {self.layout.length} tokens "
                f"({'head-tail balanced' if self.layout.balanced else 'contiguous'} pieces "
                f"{list(self.layout.lengths)}), rotation {self.rotate!r}: {kernel}")

    # -- rotations ------------------------------------------------------------------------------

    def _allgather(self, sdpa: Sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
        pieces = self.layout.lengths
        k_all = gather_sequence(k, k.dim() - 2, pieces, self.cp)  # (b, hk, S, d), rank by rank
        v_all = gather_sequence(v, v.dim() - 2, pieces, self.cp)
        mask = None
        if is_causal:
            mask = _causal(self.layout.index(self.cp.rank, q.device), self.layout.gathered_index(q.device))
        return sdpa(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)

    def _ulysses(self, sdpa: Sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
        n, pieces, seq = self.cp.size, self.layout.lengths, q.dim() - 2
        heads = q.dim() - 3

        def to_heads(x: torch.Tensor) -> torch.Tensor:  # (b, h, s_r, d) -> (b, h/cp, S, d)
            split = (x.size(heads) // n,) * n
            return all_to_all_heads(x, heads, seq, split, pieces, self.cp)

        if k.size(heads) % n:  # fewer K/V heads than cp (grouped-query): each query head gets its own copy
            group = q.size(heads) // k.size(heads)
            k, v = k.repeat_interleave(group, dim=heads), v.repeat_interleave(group, dim=heads)
        q_h, k_h, v_h = to_heads(q), to_heads(k), to_heads(v)
        mask = None
        if is_causal:
            order = self.layout.gathered_index(q.device)
            mask = _causal(order, order)
        out = sdpa(q_h, k_h, v_h, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)  # (b, h/cp, S, dv)
        split = (out.size(heads),) * n
        return all_to_all_heads(out, seq, heads, pieces, split, self.cp)  # (b, h, s_r, dv)

    # -- checks ---------------------------------------------------------------------------------

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, dropout_p: float) -> None:
        mine = self.layout.lengths[self.cp.rank]
        problems = []
        if q.dim() < 3:
            problems.append(f"query has {q.dim()} dims: SDPA's (batch, heads, tokens, head_dim) layout is expected")
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.dim() >= 2 and t.size(-2) != mine:
                problems.append(f"{name} holds {t.size(-2)} tokens, but this rank (cp rank {self.cp.rank}) holds "
                                f"{mine} of the {self.layout.length}-token sequence (pieces {list(self.layout.lengths)})"
                                ": attention under context_parallel must be self-attention over the buffers' sequence")
        if attn_mask is not None:
            problems.append(f"an explicit attn_mask of shape {tuple(attn_mask.shape)} was given: it describes this "
                            "rank's tokens only, not their global positions; use is_causal=True (a model gets it "
                            "when it is given no padding mask)")
        if dropout_p:
            problems.append(f"dropout_p={dropout_p}: attention dropout under context parallel is not supported; "
                            "train with attention dropout 0 (the default of most causal LMs)")
        if self.rotate == "ulysses" and q.dim() >= 3:
            heads, kv_heads = q.size(-3), k.size(-3)
            if heads % self.cp.size:
                problems.append(f"the ulysses rotation splits heads over cp={self.cp.size} ranks, but the query has "
                                f"{heads} heads: use a cp size dividing {heads}, or set_rotate_method('allgather')")
            elif kv_heads == 0 or heads % kv_heads:
                problems.append(f"the query's {heads} heads are not groups of the key's {kv_heads}")
        if problems:
            raise ValueError("scaled_dot_product_attention under context_parallel:\n" +
                             "\n".join(f"  - {p}" for p in problems))


def _causal(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(queries, keys) boolean mask: True where the key's global position <= the query's."""
    return k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
