"""A DTensor's strides describe the global tensor, and its piece is laid out the same way;
a cast of a pending sum rounds the summed value, as on one device.

Regressions from Hugging Face models under tensor parallelism: sdpa's CPU kernel laid out
its output by its inputs' memory order, and a moved (contiguous) piece gave a contiguous
local output where the global output was transposed, so `.contiguous()` did nothing and
the next view failed; and float64 gradients were cast to float32 term by term, before their
sum across ranks, so parity with one process was float32-level.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import seeded


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, seq, heads * dim) -> (batch, heads, seq, dim), a transposed view, as models write it."""
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)


@distributed(world_size=2)
def test_attention_output_pieces_are_laid_out_as_the_global_tensor_says() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    q, k, v = seeded(3, 5, 32), seeded(3, 5, 16, seed=1), seeded(3, 5, 16, seed=2)
    want = F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 2), _heads(v, 2), is_causal=True, enable_gqa=True)
    want = want.transpose(1, 2).contiguous().view(3, 5, -1)
    for placements in ([Shard(2)], [Shard(0)], [Replicate()]):
        dq, dk, dv = (sw.distribute_tensor(t, mesh, placements) for t in (q, k, v))
        out = F.scaled_dot_product_attention(_heads(dq, 4), _heads(dk, 2), _heads(dv, 2), is_causal=True, enable_gqa=True)
        if placements == [Shard(2)]:  # 4 query heads, 2 key/value heads: each rank holds one whole group
            assert out.placements == (Shard(1),), out.placements
        assert out.is_contiguous() == out.to_local().is_contiguous(), (placements, out.stride(), out.to_local().stride())
        t = out.transpose(1, 2)
        assert t.is_contiguous() == t.to_local().is_contiguous(), (placements, t.stride(), t.to_local().stride())
        got = t.contiguous().view(3, 5, -1)  # HF: attn_output.reshape(*input_shape, -1).contiguous()
        torch.testing.assert_close(got.full_tensor(), want)


@distributed(world_size=4)
def test_a_cast_of_a_pending_sum_rounds_the_sum_not_each_term() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = torch.distributed.get_rank()
    term = (seeded(64, seed=rank) * 1e3).to(torch.float64) / 3  # far from float32-representable
    x = DTensor.from_local(term, mesh, [Partial()])
    down = x.to(torch.float32)
    assert down.placements == (Replicate(),)  # summed first, in float64
    assert torch.equal(down.full_tensor(), x.full_tensor().to(torch.float32))
    up = DTensor.from_local(term.to(torch.float32), mesh, [Partial()])
    assert torch.equal(up.to(torch.float64).full_tensor(), up.full_tensor().to(torch.float64))
    biggest = DTensor.from_local(term, mesh, [Partial("max")])
    assert biggest.to(torch.float32).placements == (Partial("max"),)  # rounding is monotone: max survives
    assert torch.equal(biggest.to(torch.float32).full_tensor(), biggest.full_tensor().to(torch.float32))
    same = x.to(torch.float64)
    assert same.placements == (Partial(),)  # no dtype change: nothing to reduce
