"""Ring attention: K/V blocks passed around the cp ranks, merged by log-sum-exp.

At step t rank r holds the K/V block of rank (r - t) mod cp; it starts sending that block
on to rank r+1 (and receiving the next one from r-1), computes its queries against the
block while the transfer runs, and merges the result into its running output:

    lse = logaddexp(lse, lse_b)
    out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse)

The backward recomputes each block's probabilities from the final `lse` (nothing per
block is kept) and passes the block around again with its K/V gradients, each rank adding
its queries' share; after cp hops the gradients are home:

    P = exp(S - lse)   dV += P^T dO   dS = P (dO V^T - rowsum(dO O))   dQ += dS K s   dK += dS^T Q s

A block no local query sees (causal: its keys all come later) is skipped. Two hops
move a block: `point_to_point` (send to r+1, receive from r-1; the `"ring"` rotation) and
`all_to_all_hop` (torch's: an all_to_all in which each rank sends only to r+1; the
`"alltoall"` rotation). The rotation hands its hop in (`_cp_rotation`); either is started
before the block's compute and waited on after it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from .. import _comm as comm
from .._compile import current_trace
from ._cp_comm import CpGroup
from ._cp_flash import Pair, fold_heads, merge_into, pair_backward, repeat_heads
from ._cp_layout import SequenceLayout

__all__ = ["Hop", "all_to_all_hop", "point_to_point", "ring_attention"]

MaskFor = Callable[[int], Optional[torch.Tensor]]
PairsFor = Callable[[int], list[Pair]]


Wait = Callable[[], torch.Tensor]  # waits for a block in flight and returns it
Hop = Callable[[torch.Tensor, tuple[int, ...], CpGroup, int], Wait]  # (block, incoming shape, cp, tag) -> wait


def point_to_point(x: torch.Tensor, shape: tuple[int, ...], cp: CpGroup, tag: int) -> Wait:
    """Start sending `x` to the next cp rank and receiving the previous rank's block of `shape`.

    Under `shardwise.compile`'s trace the two are host steps of the graph (see
    `shardwise._compile`'s `Trace.host`), posted where eager posts them and waited where eager
    waits, so the replay overlaps the transfer with the block's compute as eager does."""
    trace = current_trace()
    if trace is None:
        return _exchange(x, shape, cp, tag)
    held: list[Wait] = []

    def start(parts: list[torch.Tensor]) -> list[torch.Tensor]:  # at the trace and at every replay
        held.append(_exchange(parts[0], shape, cp, tag))
        return []

    def wait(_: list[torch.Tensor]) -> list[torch.Tensor]:
        return [held.pop()()]

    trace.host(start, [x.contiguous()])
    return lambda: trace.host(wait, [])[0]


def _exchange(x: torch.Tensor, shape: tuple[int, ...], cp: CpGroup, tag: int) -> Wait:
    n, r = cp.size, cp.rank
    buffer = torch.empty(shape, dtype=x.dtype, device=x.device)
    works = [comm.irecv(buffer, cp.ranks[(r - 1) % n], cp.group, tag=tag, label="a K/V block"),
             comm.isend(x.contiguous(), cp.ranks[(r + 1) % n], cp.group, tag=tag, label="a K/V block")]

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return buffer
    return wait


def all_to_all_hop(x: torch.Tensor, shape: tuple[int, ...], cp: CpGroup, tag: int) -> Wait:
    """The same hop as one all_to_all over cp in which each rank sends only to the next (torch's)."""
    n, r = cp.size, cp.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    dim = x.dim() - 2
    record = comm.AllToAll(group=cp.group, size=n, shape=tuple(x.shape), dtype=x.dtype, split_dim=dim,
                           cat_dim=dim, split_sizes=tuple(x.size(dim) if j == nxt else 0 for j in range(n)),
                           cat_pieces=tuple(shape[dim] if j == prv else 0 for j in range(n)), index=r,
                           mesh_dims=(cp.mesh_dim,))
    return comm.start(record, x.contiguous()).result


def _block_shape(like: torch.Tensor, length: int) -> tuple[int, ...]:
    shape = list(like.shape)
    shape[-2] = length
    return tuple(shape)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, group: int) -> torch.Tensor:
    """(b, h, sq, sk) scores of q against k, K heads repeated for grouped-query attention."""
    return torch.matmul(q, repeat_heads(k, group).transpose(-1, -2)) * scale


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, cp: CpGroup,
                hop: Hop, mask_for: MaskFor, pairs_for: Optional[PairsFor], scale: float) -> torch.Tensor:
        n, r = cp.size, cp.rank
        group = q.size(-3) // k.size(-3)
        kv = torch.cat([k, v], dim=-1)  # one message per block: (b, hk, s_j, d + dv)
        d = k.size(-1)
        out = q.new_zeros(q.shape[:-1] + (v.size(-1),))
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for t in range(n):
            j = (r - t) % n  # the rank whose block this is
            incoming = hop(kv, _block_shape(kv, layout.lengths[(j - 1) % n]), cp, t) if t < n - 1 else None
            if pairs_for is not None:  # chunk pairs by the fused kernel, merged in place
                for p in pairs_for(j):
                    keys = slice(p.k_start, p.k_start + p.k_len)
                    merge_into(out, lse, p, q, repeat_heads(kv[..., keys, :d], group),
                               repeat_heads(kv[..., keys, d:], group), scale)
            else:
                mask = mask_for(j)
                if _sees_some(mask):
                    out, lse = _merge(out, lse, q, kv[..., :d], kv[..., d:], mask, scale, group)
            if incoming is not None:
                kv = incoming()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, cp, hop, mask_for, pairs_for, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        layout, cp, hop, mask_for, pairs_for, scale = ctx.args
        n, r = cp.size, cp.rank
        group = q.size(-3) // k.size(-3)
        d, dv = k.size(-1), v.size(-1)
        rowsum = (grad_out * out).sum(-1, keepdim=True)  # (b, h, sq, 1)
        grad_q = torch.zeros_like(q)
        block = torch.cat([k, v, torch.zeros_like(k), torch.zeros_like(v)], dim=-1)  # K | V | dK | dV
        for t in range(n):
            j = (r - t) % n
            if pairs_for is not None:
                block = block.clone()
                for p in pairs_for(j):
                    keys = slice(p.k_start, p.k_start + p.k_len)
                    gq, gk, gv = pair_backward(p, grad_out, q, repeat_heads(block[..., keys, :d], group),
                                               repeat_heads(block[..., keys, d:d + dv], group), out, lse, scale)
                    grad_q[..., p.q_start:p.q_start + p.q_len, :] += gq
                    block[..., keys, d + dv:2 * d + dv] += fold_heads(gk, group)
                    block[..., keys, 2 * d + dv:] += fold_heads(gv, group)
            elif _sees_some(mask := mask_for(j)):
                kb, vb = block[..., :d], block[..., d:d + dv]
                s = _masked(_scores(q, kb, scale, group), mask)
                p = torch.exp(s - lse.unsqueeze(-1))  # (b, h, sq, sk)
                grad_v = p.transpose(-1, -2) @ grad_out  # (b, h, sk, dv)
                grad_s = p * (grad_out @ repeat_heads(vb, group).transpose(-1, -2) - rowsum)
                grad_q += grad_s @ repeat_heads(kb, group) * scale
                grad_k = grad_s.transpose(-1, -2) @ q * scale
                block = block.clone()
                block[..., d + dv:2 * d + dv] += fold_heads(grad_k, group)
                block[..., 2 * d + dv:] += fold_heads(grad_v, group)
            # after the last step the block goes one hop further: back to its rank
            block = hop(block, _block_shape(block, layout.lengths[(j - 1) % n]), cp, n + t)()
        return grad_q, block[..., d + dv:2 * d + dv], block[..., 2 * d + dv:], None, None, None, None, None, None


def _sees_some(mask: Optional[torch.Tensor]) -> bool:
    """Whether any query sees any key of the block (a boolean mask that is all False: skip it)."""
    return mask is None or mask.dtype != torch.bool or bool(mask.any())


def _masked(s: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return s
    return s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask


def _merge(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: Optional[torch.Tensor], scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (output, log-sum-exp) with one more block of keys merged in."""
    s = _masked(_scores(q, k, scale, group), mask)
    block_lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees none of this block
    seen = torch.isfinite(block_lse)
    p = torch.exp(s - torch.where(seen, block_lse, 0.0).unsqueeze(-1))
    block_out = p @ repeat_heads(v, group)
    new = torch.logaddexp(lse, block_lse)
    keep = torch.where(torch.isfinite(lse), torch.exp(lse - new), 0.0)
    take = torch.where(seen, torch.exp(block_lse - new), 0.0)
    return out * keep.unsqueeze(-1) + block_out * take.unsqueeze(-1), new


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, cp: CpGroup,
                   hop: Hop, mask_for: MaskFor, pairs_for: Optional[PairsFor], scale: Optional[float]
                   ) -> torch.Tensor:
    """`q` (this rank's queries, (b, h, s_r, d)) against the keys of every rank (see the
    module docstring); `mask_for(j)` is the mask of those queries against rank j's keys
    (boolean or additive, None for none). With `pairs_for` (plain causal or full attention
    on CPU) each block is instead its visible chunk pairs, by the fused kernel (`_cp_flash`)."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    out: torch.Tensor = _RingAttention.apply(q, k, v, layout, cp, hop, mask_for,  # type: ignore[no-untyped-call]
                                             pairs_for, s)
    return out
