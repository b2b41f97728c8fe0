"""How keys and values reach the queries of the other cp ranks: one small class per rotation.

`set_rotate_method(name)` looks the name up here once (`ROTATIONS`); the `Rotation` it gets
travels in every `CpAttention` made after, which asks it to run a call (`attend`), to check
one (`problems`) and to say what it moves (`kernel`, `moves`). No other module compares
rotation names. Each rank holds the queries, keys and values of its own tokens
(`SequenceLayout`), in SDPA's layout `(batch, heads, tokens, head_dim)`:

| rotation | moves | attention on each rank | K/V bytes in per rank |
|---|---|---|---|
| `allgather` | all_gather K and V along the sequence (backward: reduce_scatter their grads) | local queries x all keys | (cp-1)/cp of K and V |
| `ring` / `alltoall` | K/V blocks passed rank to rank, each hop overlapping a block's compute (`_cp_ring`) | local queries x one block at a time, merged by log-sum-exp | (cp-1)/cp of K and V |
| `ulysses` | all_to_all q, k, v: sequence split -> head split; the output back | all queries x all keys of heads/cp heads | (cp-1)/cp of the rank's q, k, v and output |

Ulysses needs the query heads to divide by cp; grouped-query K/V with fewer heads than
that are repeated to one per query head before the all_to_all (as DeepSpeed does).

>>> ROTATIONS["alltoall"]
Ring(name='alltoall')
>>> ROTATIONS["ulysses"].moves(4).split(";")[0]
'forward: all_to_all of q, k and v over cp (sequence split -> head split) and of the output back (4 collectives)'
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Optional

import torch

from ._cp_comm import CpGroup, all_to_all_heads, gather_pieces, gather_sequence
from ._cp_flash import chunk_pairs, flash_attention, flash_available
from ._cp_layout import SequenceLayout
from ._cp_mask import Masking
from ._cp_ring import Hop, all_to_all_hop, point_to_point, ring_attention

__all__ = ["ALL_GATHER", "ROTATIONS", "AllGather", "Call", "Ring", "Rotation", "Sdpa", "Ulysses"]

Sdpa = Callable[..., torch.Tensor]


@dataclass(frozen=True, eq=False)
class Call:
    """One attention call on this rank, its rules in global terms (`masking`): what a rotation runs."""

    layout: SequenceLayout
    cp: CpGroup
    sdpa: Sdpa  # torch's own SDPA
    query: torch.Tensor  # (b, h, s_r, d): this rank's tokens
    key: torch.Tensor  # (b, hk, s_r, d)
    value: torch.Tensor  # (b, hk, s_r, dv)
    masking: Masking
    scale: Optional[float]
    enable_gqa: bool

    @property
    def plain(self) -> bool:
        """Causal or full attention the fused CPU kernel serves chunk pair by chunk pair (`_cp_flash`)."""
        m = self.masking
        return m.plain and flash_available(self.query)


class Rotation(abc.ABC):
    """One way for keys and values to reach every rank's queries."""

    name: str

    @abc.abstractmethod
    def attend(self, call: Call) -> torch.Tensor:
        """This rank's queries against the keys of every rank: (b, h, s_r, dv)."""

    def problems(self, query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 cp_size: int) -> list[str]:
        """What this rotation cannot run in the call (nothing, unless it says otherwise)."""
        return []

    @abc.abstractmethod
    def kernel(self) -> str:
        """How each rank computes its attention, in words."""

    @abc.abstractmethod
    def moves(self, n: int) -> str:
        """What one attention call moves over `n` cp ranks: 'forward: ...; backward: ...'."""


@dataclass(frozen=True)
class AllGather(Rotation):
    """all_gather K and V along the sequence; every local query against every key."""

    name: str = "allgather"

    def attend(self, call: Call) -> torch.Tensor:
        layout, cp, q = call.layout, call.cp, call.query
        pieces = layout.lengths
        k_all = gather_sequence(call.key, call.key.dim() - 2, pieces, cp)  # (b, hk, S, d), rank by rank
        v_all = gather_sequence(call.value, call.value.dim() - 2, pieces, cp)
        if call.plain:  # causal or full: chunk pairs by the fused kernel, no (queries x keys) mask
            offsets = [sum(pieces[:j]) for j in range(cp.size)]
            pairs = [p for j in range(cp.size)
                     for p in chunk_pairs(layout, cp.rank, j, offsets[j], call.masking.causal)]
            return flash_attention(q, k_all, v_all, pairs, call.scale)
        mask = call.masking.mask(layout.index(cp.rank, q.device), layout.gathered_index(q.device))
        return call.sdpa(q, k_all, v_all, attn_mask=mask, scale=call.scale, enable_gqa=call.enable_gqa)

    def kernel(self) -> str:
        return ("causal or full: each visible pair of chunks by torch's fused CPU flash kernel, merged by "
                "log-sum-exp; with documents or a mask: torch's SDPA with a boolean mask by global position")

    def moves(self, n: int) -> str:
        return ("forward: all_gather of K and of V over cp (2 collectives); backward: reduce_scatter (sum) of their "
                "gradients (2)")


@dataclass(frozen=True)
class Ring(Rotation):
    """K/V blocks passed rank to rank by `hop`, merged by log-sum-exp (`_cp_ring`)."""

    name: str
    hop: Hop = field(repr=False)
    kernel_text: str = field(repr=False)
    moves_text: str = field(repr=False)  # with {n} (cp) and {hops} (cp - 1)

    def attend(self, call: Call) -> torch.Tensor:
        layout, cp, q, masking = call.layout, call.cp, call.query, call.masking
        mine = layout.index(cp.rank, q.device)
        me, causal = cp.rank, masking.causal
        pairs = (lambda j: chunk_pairs(layout, me, j, 0, causal)) if call.plain else None
        return ring_attention(q, call.key, call.value, layout, cp, self.hop,
                              lambda j: masking.mask(mine, layout.index(j, q.device)), pairs, call.scale)

    def kernel(self) -> str:
        return self.kernel_text

    def moves(self, n: int) -> str:
        return self.moves_text.format(n=n, hops=n - 1)


@dataclass(frozen=True)
class Ulysses(Rotation):
    """all_to_all q, k and v from a sequence split to a head split, attend, and the output back."""

    name: str = "ulysses"

    def attend(self, call: Call) -> torch.Tensor:
        layout, cp, masking = call.layout, call.cp, call.masking
        q, k, v = call.query, call.key, call.value
        n, pieces, seq = cp.size, layout.lengths, q.dim() - 2
        heads = q.dim() - 3

        def to_heads(x: torch.Tensor) -> torch.Tensor:  # (b, h, s_r, d) -> (b, h/cp, S, d)
            split = (x.size(heads) // n,) * n
            return all_to_all_heads(x, heads, seq, split, pieces, cp)

        if k.size(heads) % n:  # fewer K/V heads than cp (grouped-query): each query head gets its own copy
            group = q.size(heads) // k.size(heads)
            k, v = k.repeat_interleave(group, dim=heads), v.repeat_interleave(group, dim=heads)
        q_h, k_h, v_h = to_heads(q), to_heads(k), to_heads(v)
        if masking.explicit is not None:  # every query's row of the caller's mask, in gathered order
            rows = gather_pieces(masking.explicit, masking.explicit.dim() - 2, pieces, cp)
            masking = Masking(masking.causal, masking.documents, rows)
        order = layout.gathered_index(q.device)
        if masking.plain:
            # in sequence order SDPA's own causal flag serves
            back = torch.argsort(order)  # gathered slot of each position
            out = call.sdpa(q_h.index_select(seq, back), k_h.index_select(seq, back), v_h.index_select(seq, back),
                            is_causal=masking.causal, scale=call.scale,
                            enable_gqa=call.enable_gqa).index_select(seq, order)
        else:
            out = call.sdpa(q_h, k_h, v_h, attn_mask=masking.mask(order, order), scale=call.scale,
                            enable_gqa=call.enable_gqa)  # (b, h/cp, S, dv)
        split = (out.size(heads),) * n
        return all_to_all_heads(out, seq, heads, pieces, split, cp)  # (b, h, s_r, dv)

    def problems(self, query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 cp_size: int) -> list[str]:
        if query.dim() < 3:
            return []
        heads, kv_heads = query.size(-3), key.size(-3)
        found = []
        if heads % cp_size:
            found.append(f"the ulysses rotation splits heads over cp={cp_size} ranks, but the query has {heads} "
                         f"heads: use a cp size dividing {heads}, or set_rotate_method('allgather')")
        elif kv_heads == 0 or heads % kv_heads:
            found.append(f"the query's {heads} heads are not groups of the key's {kv_heads}")
        if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.size(-3) != 1:
            found.append(f"an attn_mask with {attn_mask.size(-3)} heads under the ulysses rotation, which splits the "
                         "heads: give one mask for all heads (size 1 in the heads dim)")
        return found

    def kernel(self) -> str:
        return ("over heads/cp heads: torch's SDPA in sequence order with its causal flag; with documents or a mask, "
                "with a boolean mask")

    def moves(self, n: int) -> str:
        return ("forward: all_to_all of q, k and v over cp (sequence split -> head split) and of the output back "
                "(4 collectives); backward: the inverse all_to_all of each (4)")


ALL_GATHER = AllGather()
ROTATIONS: Mapping[str, Rotation] = MappingProxyType({r.name: r for r in (
    ALL_GATHER,
    Ring("ring", point_to_point,
         "point-to-point K/V blocks merged by log-sum-exp: chunk pairs by the fused CPU flash kernel (causal or full), "
         "or blockwise matmuls under a mask",
         "forward: {hops} hops of the K/V block, send to the next cp rank and receive from the previous "
         "(point-to-point); backward: {n} point-to-point hops of the K/V block with its gradient sums (the last "
         "brings the gradients home)"),
    Ring("alltoall", all_to_all_hop, "the ring's blocks moved by all_to_all",
         "forward: {hops} hops of the K/V block, each an all_to_all over cp in which a rank sends only to the next; "
         "backward: {n} all_to_all hops of the K/V block with its gradient sums"),
    Ulysses(),
)})
