"""Which keys each query sees under context parallelism, in global terms.

A rank's tokens are not contiguous under load balancing, so every rule is applied by
global position (`SequenceLayout` gives the positions of any rank's tokens):

- causal: the key's position <= the query's;
- documents: several documents packed in one sample (position ids restarting, as
  transformers detects them: a new document wherever a position is not the previous one
  plus 1): only keys of the query's own document;
- a sliding window of W (Mistral, Qwen2's and Gemma's sliding layers): the key's position
  is less than W before the query's;
- chunks of C (Llama 4's chunked layers): key and query in the same chunk of C positions
  (`position // C`). The open session notes the window or chunk of the layer running
  (`LayerRule`, `_cp_session`);
- an explicit mask given by the caller over the whole sequence's keys: rows of this
  rank's queries, columns in sequence order (boolean, or additive floats).

The result is one boolean mask, or an additive one when the caller's mask is additive,
shaped to broadcast against (batch, heads, queries, keys).

A model that builds its own mask from the position ids it was given (transformers does,
when it sees no padding mask and no cache) builds it from this rank's tokens only: a mask
of (local queries x local keys) in which a head-tail piece looks like two documents. Such
a mask is recognised (it equals what the position ids imply locally, causal or not, with the
layer's sliding window or chunks, by local index or by position) and replaced by the global
rule; any other local mask is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["LayerRule", "Masking", "documents_of", "model_mask_kind"]


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, tokens) document index of each token: a new document wherever the position is
    not the previous position plus 1."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@dataclass(frozen=True)
class LayerRule:
    """What the attention layer running adds to the causal rule: a sliding `window` (keys less
    than `window` positions before the query) and/or `chunk` (keys in the query's chunk of
    `chunk` positions). The default, neither: the whole causal past."""

    window: Optional[int] = None
    chunk: Optional[int] = None

    def near(self, q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
        """(..., len q, len k) whether each key is near enough to each query by this rule, for
        positions (or local indices) `q` and `k`; None when the rule allows every pair."""
        allowed: Optional[torch.Tensor] = None
        if self.window is not None:
            allowed = q.unsqueeze(-1) - k.unsqueeze(-2) < self.window
        if self.chunk is not None:
            same = q.unsqueeze(-1).div(self.chunk, rounding_mode="floor") == k.unsqueeze(-2).div(
                self.chunk, rounding_mode="floor")
            allowed = same if allowed is None else allowed & same
        return allowed


WHOLE_PAST = LayerRule()


@dataclass(frozen=True, eq=False)
class Masking:
    """The rules for one attention call: `causal`, `documents` ((batch, S) document of each
    token, or None), and `explicit` (the caller's mask: rows of the queries in hand, all S
    keys in sequence order; or None)."""

    causal: bool
    documents: Optional[torch.Tensor] = None
    explicit: Optional[torch.Tensor] = None
    layer: LayerRule = WHOLE_PAST  # the sliding window or chunks of the layer running

    @property
    def anything(self) -> bool:
        return self.causal or self.documents is not None or self.explicit is not None or self.layer != WHOLE_PAST

    @property
    def plain(self) -> bool:
        """Causal or full attention over one document and nothing else (the fused kernel's case)."""
        return self.documents is None and self.explicit is None and self.layer == WHOLE_PAST

    def mask(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The mask of queries at global `q_positions` (the rows of `explicit`, in order)
        against keys at `k_positions`."""
        allowed: Optional[torch.Tensor] = None
        if self.causal:
            allowed = k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)  # (sq, sk)
        near = self.layer.near(q_positions, k_positions)
        if near is not None:
            allowed = near if allowed is None else allowed & near
        if self.documents is not None:
            docs = self.documents.to(q_positions.device)
            same = (docs[:, q_positions].unsqueeze(-1) == docs[:, k_positions].unsqueeze(-2)).unsqueeze(1)
            allowed = same if allowed is None else same & allowed  # (b, 1, sq, sk)
        if self.explicit is None:
            return allowed
        given = self.explicit.index_select(-1, k_positions)
        if given.dtype == torch.bool:
            return given if allowed is None else given & allowed
        if allowed is None:
            return given
        return given.masked_fill(~allowed, float("-inf"))


def model_mask_kind(mask: torch.Tensor, local_positions: torch.Tensor, layer: LayerRule = WHOLE_PAST
                    ) -> Optional[bool]:
    """Whether `mask` ((batch or 1, heads or 1, s, s) over this rank's tokens) is the mask a
    model builds from the local position ids (with the `layer`'s sliding window or chunks,
    counted by local index or by position): True for causal, False for bidirectional, None for
    neither (a mask that says something else)."""
    s = local_positions.size(-1)
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (s, s):
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    segments = documents_of(local_positions)
    same = (segments.unsqueeze(-1) == segments.unsqueeze(-2)).unsqueeze(1)  # (b, 1, s, s)
    lower = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    # from the position ids (a model without a cache reads documents from them), or by local
    # index (a model with a cache counts this rank's tokens 0..s-1, one document)
    wants = [(True, same & lower), (False, same), (True, lower)]
    by_position, by_index = layer.near(local_positions, local_positions), layer.near(
        torch.arange(s, device=mask.device), torch.arange(s, device=mask.device))
    if by_position is not None and by_index is not None:
        wants += [(True, same & lower & by_position.unsqueeze(1).to(mask.device)), (True, lower & by_index)]
    for causal, want in wants:
        try:
            a, w = torch.broadcast_tensors(allowed, want)  # type: ignore[no-untyped-call]
        except RuntimeError:  # shapes that do not broadcast: not the model's mask
            return None
        if torch.equal(a, w):
            return causal
    return None
