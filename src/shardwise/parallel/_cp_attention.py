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

A rank's tokens are not contiguous under load balancing, so the causal rule, documents and
explicit masks are applied by global position (`_cp_mask`). Plain causal or full attention
on CPU needs no mask at all: a rank's queries and any rank's keys are one or two chunks of
consecutive positions, and each visible pair of chunks is one call of the fused flash
kernel (`_cp_flash`), so memory never holds a (queries x keys) matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch

from .._comm import all_gather_ints
from ._cp_comm import CpGroup, all_to_all_heads, gather_pieces, gather_sequence
from ._cp_flash import chunk_pairs, flash_attention, flash_available
from ._cp_layout import SequenceLayout
from ._cp_mask import Masking, current_window, documents_of, model_mask_kind
from ._cp_ring import ring_attention

__all__ = ["CpAttention", "ROTATIONS"]

ROTATIONS = ("allgather", "ring", "alltoall", "ulysses")
Sdpa = Callable[..., torch.Tensor]


@dataclass(frozen=True, eq=False)
class CpAttention:
    """Attention for one sequence layout on one cp group, by `rotate`; `position_ids`
    ((batch, S), whole) when the caller gave them: documents packed in a sample are then
    kept apart, and a model's own mask built from its local position ids is recognised."""

    layout: SequenceLayout
    cp: CpGroup
    rotate: str = "allgather"
    position_ids: Optional[torch.Tensor] = None
    one_document: bool = False  # the position ids are 0..S-1 in every sample (made, not read)

    def __call__(self, sdpa: Sdpa, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        if self.position_ids is not None:  # the ranks may have taken different paths: agree first
            masking, key, value, enable_gqa = self._agree(query, key, value, attn_mask, dropout_p, is_causal,
                                                          enable_gqa)
        else:
            masking = self._masking(query, key, value, attn_mask, dropout_p, is_causal)
        if self.rotate == "ulysses":
            return self._ulysses(sdpa, query, key, value, masking, scale, enable_gqa)
        plain = (masking.documents is None and masking.explicit is None and masking.window is None
                 and flash_available(query))
        if self.rotate in ("ring", "alltoall"):
            mine = self.layout.index(self.cp.rank, query.device)
            me, causal = self.cp.rank, masking.causal
            pairs = (lambda j: chunk_pairs(self.layout, me, j, 0, causal)) if plain else None
            return ring_attention(query, key, value, self.layout, self.cp, self.rotate,
                                  lambda j: masking.mask(mine, self.layout.index(j, query.device)), pairs, scale)
        return self._allgather(sdpa, query, key, value, masking, scale, enable_gqa, plain)

    @cached_property
    def documents(self) -> Optional[torch.Tensor]:
        """(batch, S) document index of each token, from the position ids; None without them or
        when every sample is one document (then causal or full attention keeps the fused kernel).
        Meta position ids (a dry run) hold no values: there documents are assumed unless the
        ids were made as 0..S-1."""
        if self.position_ids is None or self.one_document:
            return None
        documents = documents_of(self.position_ids)
        if documents.is_meta:
            return documents
        return documents if bool(documents.any()) else None

    def explain(self) -> str:
        kernel = {"allgather": "causal or full: each visible pair of chunks by torch's fused CPU flash kernel, "
                               "merged by log-sum-exp; with documents or a mask: torch's SDPA with a boolean mask "
                               "by global position",
                  "ulysses": "over heads/cp heads: torch's SDPA in sequence order with its causal flag; with "
                             "documents or a mask, with a boolean mask",
                  "ring": "point-to-point K/V blocks merged by log-sum-exp: chunk pairs by the fused CPU flash "
                          "kernel (causal or full), or blockwise matmuls under a mask",
                  "alltoall": "the ring's blocks moved by all_to_all"}[self.rotate]
        n = self.cp.size
        moves = {"allgather": "forward: all_gather of K and of V over cp (2 collectives); backward: reduce_scatter "
                              "(sum) of their gradients (2)",
                 "ring": f"forward: {n - 1} hops of the K/V block, send to the next cp rank and receive from the "
                         f"previous (point-to-point); backward: {n} point-to-point hops of the K/V block with its "
                         "gradient sums (the last brings the gradients home)",
                 "alltoall": f"forward: {n - 1} hops of the K/V block, each an all_to_all over cp in which a rank "
                             f"sends only to the next; backward: {n} all_to_all hops of the K/V block with its "
                             "gradient sums",
                 "ulysses": "forward: all_to_all of q, k and v over cp (sequence split -> head split) and of the "
                            "output back (4 collectives); backward: the inverse all_to_all of each (4)"}[self.rotate]
        return (f"context-parallel attention over {n} ranks, {self.layout.length} tokens "
                f"({'head-tail balanced' if self.layout.balanced else 'contiguous'} pieces "
                f"{list(self.layout.lengths)}), rotation {self.rotate!r}: {kernel}. Moves per attention call: "
                f"{moves}")

    # -- rotations ------------------------------------------------------------------------------

    def _allgather(self, sdpa: Sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masking: Masking,
                   scale: Optional[float], enable_gqa: bool, plain: bool) -> torch.Tensor:
        pieces = self.layout.lengths
        k_all = gather_sequence(k, k.dim() - 2, pieces, self.cp)  # (b, hk, S, d), rank by rank
        v_all = gather_sequence(v, v.dim() - 2, pieces, self.cp)
        if plain:  # causal or full: chunk pairs by the fused kernel, no (queries x keys) mask
            offsets = [sum(pieces[:j]) for j in range(self.cp.size)]
            pairs = [p for j in range(self.cp.size)
                     for p in chunk_pairs(self.layout, self.cp.rank, j, offsets[j], masking.causal)]
            return flash_attention(q, k_all, v_all, pairs, scale)
        mask = masking.mask(self.layout.index(self.cp.rank, q.device), self.layout.gathered_index(q.device))
        return sdpa(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)

    def _ulysses(self, sdpa: Sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masking: Masking,
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
        if masking.explicit is not None:  # every query's row of the caller's mask, in gathered order
            rows = gather_pieces(masking.explicit, masking.explicit.dim() - 2, pieces, self.cp)
            masking = Masking(masking.causal, masking.documents, rows)
        order = self.layout.gathered_index(q.device)
        if masking.documents is None and masking.explicit is None and masking.window is None:
            # in sequence order SDPA's own causal flag serves
            back = torch.argsort(order)  # gathered slot of each position
            out = sdpa(q_h.index_select(seq, back), k_h.index_select(seq, back), v_h.index_select(seq, back),
                       is_causal=masking.causal, scale=scale, enable_gqa=enable_gqa).index_select(seq, order)
        else:
            out = sdpa(q_h, k_h, v_h, attn_mask=masking.mask(order, order), scale=scale,
                       enable_gqa=enable_gqa)  # (b, h/cp, S, dv)
        split = (out.size(heads),) * n
        return all_to_all_heads(out, seq, heads, pieces, split, self.cp)  # (b, h, s_r, dv)

    # -- checks ---------------------------------------------------------------------------------

    def _agree(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
               dropout_p: float, is_causal: bool, enable_gqa: bool
               ) -> tuple[Masking, torch.Tensor, torch.Tensor, bool]:
        """With packed documents a model may take different paths on different ranks: it
        builds a mask where its local position ids show a document boundary and none
        elsewhere, and with a mask it repeats grouped-query K/V heads (transformers does).
        The ranks exchange whether the call is valid and their K/V head counts (one small
        all_gather), so an error stops every rank at once, and a rank whose K/V heads were
        repeated passes one copy of each, as the others do."""
        problem: Optional[ValueError] = None
        masking = Masking(is_causal)
        try:
            masking = self._masking(q, k, v, attn_mask, dropout_p, is_causal)
        except ValueError as exc:
            problem = exc
        heads = (k.size(-3), v.size(-3)) if k.dim() >= 3 and v.dim() >= 3 else (0, 0)
        rows = all_gather_ints([int(problem is not None), *heads], self.cp.group, self.cp.size)
        if problem is not None:
            raise problem
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            raise ValueError(f"scaled_dot_product_attention under context_parallel failed on cp rank(s) {failed} "
                             "(see their errors); this rank stops with them")
        fewest = min(row[1] for row in rows), min(row[2] for row in rows)
        if (k.size(-3), v.size(-3)) != fewest:
            k, v = _one_copy(k, fewest[0]), _one_copy(v, fewest[1])
            enable_gqa = True
        return masking, k, v, enable_gqa

    def _masking(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 dropout_p: float, is_causal: bool) -> Masking:
        """The rules of this call in global terms; every problem with the call raised at once."""
        mine, length = self.layout.lengths[self.cp.rank], self.layout.length
        problems = []
        if q.dim() < 3:
            problems.append(f"query has {q.dim()} dims: SDPA's (batch, heads, tokens, head_dim) layout is expected")
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.dim() >= 2 and t.size(-2) != mine:
                problems.append(f"{name} holds {t.size(-2)} tokens, but this rank (cp rank {self.cp.rank}) holds "
                                f"{mine} of the {length}-token sequence (pieces {list(self.layout.lengths)})"
                                ": attention under context_parallel must be self-attention over the buffers' sequence")
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
            if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.size(-3) != 1:
                problems.append(f"an attn_mask with {attn_mask.size(-3)} heads under the ulysses rotation, which "
                                "splits the heads: give one mask for all heads (size 1 in the heads dim)")
        documents, window = self.documents, current_window()
        masking = Masking(is_causal, documents, window=window)
        if attn_mask is not None and not problems:
            masking, problem = self._explicit(attn_mask, is_causal, documents, mine, window)
            if problem:
                problems.append(problem)
        if problems:
            raise ValueError("scaled_dot_product_attention under context_parallel:\n" +
                             "\n".join(f"  - {p}" for p in problems))
        return masking

    def _explicit(self, attn_mask: torch.Tensor, is_causal: bool, documents: Optional[torch.Tensor], mine: int,
                  window: Optional[int]) -> tuple[Masking, str]:
        shape, length = tuple(attn_mask.shape), self.layout.length
        if len(shape) >= 2 and shape[-2:] == (mine, length):  # the caller's rows over every key: taken as they are
            return Masking(is_causal, documents, attn_mask, window), ""
        if len(shape) >= 2 and shape[-2:] == (mine, mine):  # the model's own mask of this rank's tokens
            if self.position_ids is None:
                return Masking(is_causal), (
                    f"the model built a mask of shape {shape} over this rank's tokens only (transformers does so from "
                    "position_ids when it has no cache): pass the same position ids to "
                    "context_parallel(..., position_ids=...) so the mask is rebuilt by global position")
            local = self.position_ids[:, self.layout.index(self.cp.rank, self.position_ids.device)]
            causal = model_mask_kind(attn_mask, local, window)
            if causal is None:
                return Masking(is_causal), (
                    f"an attn_mask of shape {shape} over this rank's tokens that is not what the position ids imply "
                    "(causal within each document): a padding mask or other rule cannot be read from one rank's "
                    f"tokens; give a mask over the whole sequence's keys, of shape (..., {mine}, {length})")
            return Masking(causal, documents, window=window), ""
        return Masking(is_causal), (
            f"an attn_mask of shape {shape}: under context_parallel a mask gives this rank's {mine} queries' rows "
            f"over all {length} keys in sequence order, shape (..., {mine}, {length}) (a mask over the whole "
            "sequence, passed as a buffer with its query dim, -2, in buffer_seq_dims)")


def _one_copy(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`x` ((b, h, s, d), each of `heads` heads repeated h/heads times in a row) with one copy of each."""
    group = x.size(-3) // heads if heads else 0
    if not group or x.size(-3) % heads:
        raise ValueError(f"a K/V of {x.size(-3)} heads where another cp rank has {heads}: the ranks disagree on "
                         "the attention's heads")
    single = x[..., ::group, :, :]
    if not torch.equal(single.repeat_interleave(group, dim=-3), x):
        raise ValueError(f"a K/V of {x.size(-3)} heads where another cp rank has {heads}, and they are not "
                         f"{heads} heads repeated {group} times: the ranks disagree on the attention's heads")
    return single
