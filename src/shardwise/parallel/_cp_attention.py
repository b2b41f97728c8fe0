"""Attention over a sequence split between the cp ranks: each rank's queries against every key.

A `CpAttention` is the attention of one open context-parallel block: the sequence layout,
the cp group, the rotation chosen when the block was made (`_cp_rotation`: how K/V reach
the queries), and the caller's position ids. Called with one SDPA call's arguments, it
checks the call, states its rules in global terms (`Masking`) and hands it to the rotation.

A rank's tokens are not contiguous under load balancing, so the causal rule, documents and
explicit masks are applied by global position (`_cp_mask`). Plain causal or full attention
on CPU needs no mask at all: a rank's queries and any rank's keys are one or two chunks of
consecutive positions, and each visible pair of chunks is one call of the fused flash
kernel (`_cp_flash`), so memory never holds a (queries x keys) matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

from .._comm import all_gather_ints
from ._cp_comm import CpGroup
from ._cp_layout import SequenceLayout
from ._cp_mask import LayerRule, Masking, documents_of, model_mask_kind
from ._cp_rotation import ALL_GATHER, Call, Rotation, Sdpa

__all__ = ["CpAttention"]


@dataclass(frozen=True, eq=False)
class CpAttention:
    """Attention for one sequence layout on one cp group, by `rotation`; `position_ids`
    ((batch, S), whole) when the caller gave them: documents packed in a sample are then
    kept apart, and a model's own mask built from its local position ids is recognised."""

    layout: SequenceLayout
    cp: CpGroup
    rotation: Rotation = ALL_GATHER
    position_ids: Optional[torch.Tensor] = None
    one_document: bool = False  # the position ids are 0..S-1 in every sample (made, not read)

    @property
    def rotate(self) -> str:
        """The rotation's name, as `set_rotate_method` takes it."""
        return self.rotation.name

    def __call__(self, sdpa: Sdpa, layer: LayerRule, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        """One SDPA call's arguments (this rank's tokens), `sdpa` torch's own, `layer` the sliding
        window or chunks of the attention layer running."""
        if self.position_ids is not None:  # the ranks may have taken different paths: agree first
            masking, key, value, enable_gqa = self._agree(query, key, value, attn_mask, dropout_p, is_causal,
                                                          enable_gqa, layer)
        else:
            masking = self._masking(query, key, value, attn_mask, dropout_p, is_causal, layer)
        return self.rotation.attend(Call(self.layout, self.cp, sdpa, query, key, value, masking, scale, enable_gqa))

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
        n = self.cp.size
        return (f"context-parallel attention over {n} ranks, {self.layout.length} tokens "
                f"({'head-tail balanced' if self.layout.balanced else 'contiguous'} pieces "
                f"{list(self.layout.lengths)}), rotation {self.rotate!r}: {self.rotation.kernel()}. Moves per "
                f"attention call: {self.rotation.moves(n)}")

    # -- checks ---------------------------------------------------------------------------------

    def _agree(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
               dropout_p: float, is_causal: bool, enable_gqa: bool, layer: LayerRule
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
            masking = self._masking(q, k, v, attn_mask, dropout_p, is_causal, layer)
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
                 dropout_p: float, is_causal: bool, layer: LayerRule) -> Masking:
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
        problems += self.rotation.problems(q, k, attn_mask, self.cp.size)
        documents = self.documents
        masking = Masking(is_causal, documents, layer=layer)
        if attn_mask is not None and not problems:
            masking, problem = self._explicit(attn_mask, is_causal, documents, mine, layer)
            if problem:
                problems.append(problem)
        if problems:
            raise ValueError("scaled_dot_product_attention under context_parallel:\n" +
                             "\n".join(f"  - {p}" for p in problems))
        return masking

    def _explicit(self, attn_mask: torch.Tensor, is_causal: bool, documents: Optional[torch.Tensor], mine: int,
                  layer: LayerRule) -> tuple[Masking, str]:
        shape, length = tuple(attn_mask.shape), self.layout.length
        if len(shape) >= 2 and shape[-2:] == (mine, length):  # the caller's rows over every key: taken as they are
            return Masking(is_causal, documents, attn_mask, layer), ""
        if len(shape) >= 2 and shape[-2:] == (mine, mine):  # the model's own mask of this rank's tokens
            if self.position_ids is None:
                return Masking(is_causal), (
                    f"the model built a mask of shape {shape} over this rank's tokens only (transformers does so from "
                    "position_ids when it has no cache): pass the same position ids to "
                    "context_parallel(..., position_ids=...) so the mask is rebuilt by global position")
            local = self.position_ids[:, self.layout.index(self.cp.rank, self.position_ids.device)]
            causal = model_mask_kind(attn_mask, local, layer)
            if causal is None:
                return Masking(is_causal), (
                    f"an attn_mask of shape {shape} over this rank's tokens that is not what the position ids imply "
                    "(causal within each document): a padding mask or other rule cannot be read from one rank's "
                    f"tokens; give a mask over the whole sequence's keys, of shape (..., {mine}, {length})")
            return Masking(causal, documents, layer=layer), ""
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
