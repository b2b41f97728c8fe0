"""Causal or full attention of a rank's queries over key blocks, by the fused CPU flash kernel.

Under head-tail (or contiguous) pieces a rank's queries are one or two chunks of
consecutive positions, and so are any rank's keys. Chunk against chunk, causal attention
is one of three things: all visible (the key chunk comes first), the diagonal (the same
chunk: causal, square, aligned), or nothing (the key chunk comes later). So no mask is
needed: each visible pair of chunks is one call of torch's flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`, which also returns the log-sum-exp), and
the pairs of a query chunk are merged by log-sum-exp. The backward calls the kernel's own
backward per pair with the merged output and log-sum-exp, which gives each pair's exact
share of the gradients. Memory stays at one pair's working set, never (queries x keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ._cp_layout import SequenceLayout

__all__ = ["Pair", "chunk_pairs", "flash_attention", "flash_available", "fold_heads", "merge_into", "pair_backward",
           "repeat_heads"]


@dataclass(frozen=True)
class Pair:
    """Queries [q_start, q_start + q_len) of the local piece against keys [k_start, k_start + k_len)
    of the key tensor; `causal`: the diagonal chunk (same positions)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    causal: bool


def chunk_pairs(layout: SequenceLayout, q_rank: int, k_rank: int, k_offset: int, causal: bool) -> list[Pair]:
    """The visible chunk pairs of rank `q_rank`'s queries against rank `k_rank`'s keys, whose
    piece starts at `k_offset` in the key tensor."""
    out = []
    q_at = 0
    for qa in layout.chunks_of(q_rank):
        q_len = layout.chunk_size(qa)
        k_at = k_offset
        for kb in layout.chunks_of(k_rank):
            k_len = layout.chunk_size(kb)
            if q_len and k_len and (not causal or kb <= qa):
                out.append(Pair(q_at, q_len, k_at, k_len, causal and kb == qa))
            k_at += k_len
        q_at += q_len
    return out


def flash_available(q: torch.Tensor) -> bool:
    """Whether the fused kernel serves these tensors (CPU, floating point)."""
    return q.device.type in ("cpu", "meta") and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(b, hk, s, d) with each K/V head repeated `group` times in a row (grouped-query attention)."""
    return x.repeat_interleave(group, dim=-3) if group > 1 else x


def fold_heads(grad: torch.Tensor, group: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share one K/V head."""
    if group == 1:
        return grad
    b, h, s, e = grad.shape
    return grad.view(b, h // group, group, s, e).sum(2)


def merge_into(out: torch.Tensor, lse: torch.Tensor, pair: Pair, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scale: float) -> None:
    """Merge one pair's attention (keys `k`, `v` already cut to the pair, heads repeated) into the
    running `out` and `lse` of its query rows (in place)."""
    rows = slice(pair.q_start, pair.q_start + pair.q_len)
    o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[..., rows, :].contiguous(), k.contiguous(), v.contiguous(), 0.0, pair.causal, scale=scale)
    old = lse[..., rows]
    new = torch.logaddexp(old, l)
    keep = torch.where(torch.isfinite(old), torch.exp(old - new), 0.0).unsqueeze(-1)
    out[..., rows, :] = out[..., rows, :] * keep + o * torch.exp(l - new).unsqueeze(-1)
    lse[..., rows] = new


def pair_backward(pair: Pair, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq of the pair's query rows, dk, dv of its keys) from the merged `out` and `lse`."""
    rows = slice(pair.q_start, pair.q_start + pair.q_len)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out[..., rows, :].contiguous(), q[..., rows, :].contiguous(), k.contiguous(), v.contiguous(),
        out[..., rows, :].contiguous(), lse[..., rows].contiguous(), 0.0, pair.causal, scale=scale)
    return dq, dk, dv


class _FlashPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: list[Pair],
                scale: float) -> torch.Tensor:
        group = q.size(-3) // k.size(-3)
        out = q.new_zeros(q.shape[:-1] + (v.size(-1),))
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for p in pairs:
            keys = slice(p.k_start, p.k_start + p.k_len)
            merge_into(out, lse, p, q, repeat_heads(k[..., keys, :], group), repeat_heads(v[..., keys, :], group),
                       scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pairs, ctx.scale = pairs, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group = q.size(-3) // k.size(-3)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for p in ctx.pairs:
            keys = slice(p.k_start, p.k_start + p.k_len)
            gq, gk, gv = pair_backward(p, grad_out, q, repeat_heads(k[..., keys, :], group),
                                       repeat_heads(v[..., keys, :], group), out, lse, ctx.scale)
            dq[..., p.q_start:p.q_start + p.q_len, :] += gq
            dk[..., keys, :] += fold_heads(gk, group)
            dv[..., keys, :] += fold_heads(gv, group)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: list[Pair],
                    scale: Optional[float]) -> torch.Tensor:
    """`q` against the chunk pairs of `k`, `v` (see the module docstring)."""
    s = scale if scale is not None else q.size(-1) ** -0.5
    out: torch.Tensor = _FlashPairs.apply(q, k, v, pairs, s)  # type: ignore[no-untyped-call]
    return out
