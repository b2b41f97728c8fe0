"""Indexing and NN ops on real ranks, forward and backward, against the single-device reference.

Few tests, many checks each (the machine is small): embedding under its three weight
layouts, a batch-split mean cross entropy, batch- and head-split attention, pooling, and
the indexing ops with their gradients. Each also checks what was communicated, so "runs
without gathering" is pinned where it is promised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import seeded

R = Replicate()


def _leaf(full: torch.Tensor, mesh: sw.DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    return sw.distribute_tensor(full.clone().requires_grad_(True), mesh, list(placements))


def _check_grads(leaves: Sequence[DTensor], refs: Sequence[torch.Tensor], what: str) -> None:
    for k, (leaf, ref) in enumerate(zip(leaves, refs)):
        assert isinstance(leaf.grad, DTensor), f"{what}: input {k} got no DTensor grad"
        assert ref.grad is not None
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, rtol=1e-4, atol=1e-5, msg=f"{what} grad {k}")


@distributed(world_size=4)
def test_embedding_under_every_weight_layout_matches_single_device() -> None:
    vocab, dim = 11, 6
    w_full = seeded(vocab, dim, seed=1)
    ids_full = torch.randint(0, vocab, (5, 3), generator=torch.Generator().manual_seed(2))
    ids_full[0, 0] = 3  # the padding row appears
    coef = seeded(5, 3, dim, seed=3)
    cases: list[tuple[tuple[int, ...], list[Placement], list[Placement], tuple[Placement, ...]]] = [
        ((4,), [R], [Shard(0)], (Shard(0),)),                         # (a) table replicated, ids split
        ((4,), [Shard(1)], [R], (Shard(2),)),                         # (b) embedding dim split
        ((4,), [Shard(0)], [R], (Partial(),)),                        # (c) vocab split: masked lookups
        ((2, 2), [Shard(0), R], [R, Shard(0)], (Partial(), Shard(0))),  # vocab x ids
        ((2, 2), [Shard(0), Shard(1)], [R, R], (Partial(), Shard(2))),  # vocab x embedding dim
    ]
    meshes = {shape: sw.init_device_mesh("cpu", shape) for shape in {(4,), (2, 2)}}
    for padding_idx, by_freq in [(None, False), (3, False), (None, True)]:
        ref = w_full.clone().requires_grad_(True)
        (F.embedding(ids_full, ref, padding_idx=padding_idx, scale_grad_by_freq=by_freq) * coef).sum().backward()
        for mesh_shape, wp, ip, out_p in cases:
            what = f"embedding weight {wp} ids {ip} padding {padding_idx} by_freq {by_freq}"
            mesh = meshes[mesh_shape]
            w = _leaf(w_full, mesh, wp)
            ids = sw.distribute_tensor(ids_full, mesh, ip)
            with sw.comm_log() as log:
                out = F.embedding(ids, w, padding_idx=padding_idx, scale_grad_by_freq=by_freq)
            assert log == [] and out.placements == out_p, f"{what}: {out.placements}, {[c.op for c in log]}"
            torch.testing.assert_close(out.full_tensor(), F.embedding(ids_full, w_full), msg=what)
            (out.full_tensor() * coef).sum().backward()
            _check_grads([w], [ref], what)
            # a split table gets its gradient in its own layout (a replicated one may get a
            # pending P(sum): the framework reduces it lazily)
            assert w.grad is not None
            assert all(g == p for g, p in zip(w.grad.placements, w.placements) if isinstance(p, Shard)), what


@distributed(world_size=4)
def test_cross_entropy_on_batch_split_logits_matches_single_device() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    n_classes = 5
    for n in (8, 7, 3):  # even, uneven, fewer samples than ranks
        logits_full = seeded(n, n_classes, seed=4)
        target_full = torch.randint(0, n_classes, (n,), generator=torch.Generator().manual_seed(5))
        target_full[1] = -100
        class_weight = torch.rand(n_classes, generator=torch.Generator().manual_seed(6)) + 0.5
        for reduction in ("mean", "sum", "none"):
            for weight in (None, class_weight):
                for tp in ([Shard(0)], [R]):
                    what = f"cross_entropy n={n} {reduction} weighted={weight is not None} target {tp}"
                    ref = logits_full.clone().requires_grad_(True)
                    want = F.cross_entropy(ref, target_full, weight=weight, reduction=reduction)
                    (want * 1.5 if reduction != "none" else want * torch.arange(n)).sum().backward()
                    logits = _leaf(logits_full, mesh, [Shard(0)])
                    target = sw.distribute_tensor(target_full, mesh, tp)
                    w = None if weight is None else sw.distribute_tensor(weight, mesh, [R])
                    # cross_entropy = log_softmax + nll_loss; log_softmax is another family's,
                    # so pin the layout nll_loss sees
                    log_probs = F.log_softmax(logits, 1).redistribute(mesh, [Shard(0)])
                    with sw.comm_log() as log:
                        loss = F.nll_loss(log_probs, target, weight=w, reduction=reduction)
                    # the log-probabilities stay split: at most the (small) target moves
                    moved = sum(c.bytes_received for c in log)
                    assert moved <= n * 8, f"{what}: {log}"
                    torch.testing.assert_close(loss.full_tensor(), want.detach(), rtol=1e-5, atol=1e-6, msg=what)
                    scale = 1.5 if reduction != "none" else sw.distribute_tensor(torch.arange(n).float(), mesh, [Shard(0)])
                    (loss * scale).sum().full_tensor().backward()
                    _check_grads([logits], [ref], what)


@distributed(world_size=4)
def test_attention_batch_and_head_split_matches_single_device() -> None:
    b, h, length, e = 2, 4, 6, 8
    q_full, k_full, v_full = (seeded(b, h, length, e, seed=s) for s in (7, 8, 9))
    coef = seeded(b, h, length, e, seed=10)
    mask_full = seeded(length, length, seed=11)
    cases: list[tuple[tuple[int, ...], list[Placement]]] = [
        ((4,), [Shard(1)]), ((4,), [Shard(0)]), ((2, 2), [Shard(0), Shard(1)]), ((4,), [Shard(2)]),
    ]
    meshes = {shape: sw.init_device_mesh("cpu", shape) for shape in {(4,), (2, 2)}}
    for causal, use_mask in [(False, False), (True, False), (False, True)]:
        refs = [t.clone().requires_grad_(True) for t in (q_full, k_full, v_full)]
        want = F.scaled_dot_product_attention(*refs, attn_mask=mask_full if use_mask else None, is_causal=causal)
        (want * coef).sum().backward()
        for mesh_shape, placements in cases:
            what = f"sdpa {placements} causal={causal} mask={use_mask}"
            mesh = meshes[mesh_shape]
            q, k, v = (_leaf(t, mesh, placements) for t in (q_full, k_full, v_full))
            mask = sw.distribute_tensor(mask_full, mesh, [R] * mesh.ndim) if use_mask else None
            with sw.comm_log() as log:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            if Shard(2) not in placements:  # batch and heads split: nothing moves
                assert log == [] and out.placements == tuple(placements), f"{what}: {out.placements} {[c.op for c in log]}"
            torch.testing.assert_close(out.full_tensor(), want.detach(), rtol=1e-4, atol=1e-5, msg=what)
            (out.full_tensor() * coef).sum().backward()
            _check_grads([q, k, v], refs, what)


@distributed(world_size=4)
def test_pooling_on_batch_and_channel_splits_matches_single_device() -> None:
    # 3 samples over 4 ranks leaves one empty, which the kernels accept; an empty channel piece
    # they reject (6 channels over 4 ranks would be moved to the batch split)
    x_full = seeded(3, 8, 7, 7, seed=12)
    pools: dict[str, Callable[[Any], Any]] = {
        "max_pool2d": lambda t: F.max_pool2d(t, 2),
        "max_pool2d_strided_padded": lambda t: F.max_pool2d(t, 3, stride=2, padding=1),
        "avg_pool2d": lambda t: F.avg_pool2d(t, 2, ceil_mode=True),
        "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t, (3, 2)),
        "adaptive_max_pool2d": lambda t: F.adaptive_max_pool2d(t, 3),
        "max_pool1d": lambda t: F.max_pool1d(t.flatten(2), 4),
    }
    meshes = {shape: sw.init_device_mesh("cpu", shape) for shape in {(4,), (2, 2)}}
    for name, fn in pools.items():
        ref = x_full.clone().requires_grad_(True)
        want = fn(ref)
        coef = seeded(*want.shape, seed=13)
        (want * coef).sum().backward()
        for mesh_shape, placements in [((4,), [Shard(0)]), ((4,), [Shard(1)]), ((2, 2), [Shard(0), Shard(1)])]:
            what = f"{name} {placements}"
            mesh = meshes[mesh_shape]
            x = _leaf(x_full, mesh, placements)
            out = fn(x)
            if name != "max_pool1d":  # flatten's layout is the view family's business
                assert out.placements == tuple(placements), f"{what}: {out.placements}"
            torch.testing.assert_close(out.full_tensor(), want.detach(), msg=what)
            (out.full_tensor() * coef).sum().backward()
            _check_grads([x], [ref], what)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_indexing_ops_with_gradients_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    nd = len(mesh_shape)
    x_full = seeded(7, 5, seed=14)
    g = torch.Generator().manual_seed(15)
    idx = torch.randint(0, 5, (7, 3), generator=g)
    rows = torch.tensor([6, 0, 2, 2, 5])
    mask_full = seeded(7, 5, seed=16) > 0
    ops: dict[str, Callable[[Any, Any, Any, Any], Any]] = {
        "gather": lambda x, i, r, m: x.gather(1, i),
        "index_select": lambda x, i, r, m: x.index_select(0, r),
        "index": lambda x, i, r, m: x[r],
        "index_cols": lambda x, i, r, m: x[:, r.clamp(max=4)],
        "masked_fill": lambda x, i, r, m: x.masked_fill(m, -2.0),
        "sort": lambda x, i, r, m: x.sort(1)[0],
        "topk": lambda x, i, r, m: x.topk(2, dim=1)[0],
        "scatter_add": lambda x, i, r, m: x.scatter_add(1, i, x[:, :3] * 2),
        "take_along_dim": lambda x, i, r, m: torch.take_along_dim(x, i, 1),
    }
    for name, fn in ops.items():
        ref = x_full.clone().requires_grad_(True)
        want = fn(ref, idx, rows, mask_full)
        coef = seeded(*want.shape, seed=17)
        (want * coef).sum().backward()
        for placements in [(Shard(0),) * nd, (Shard(1),) + (R,) * (nd - 1), (R,) * nd]:
            what = f"{name} {placements}"
            x = _leaf(x_full, mesh, placements)
            # index tensors and masks follow the data along dim 0 where it is split
            follow = [Shard(0) if p == Shard(0) else R for p in placements]
            i = sw.distribute_tensor(idx, mesh, follow)
            m = sw.distribute_tensor(mask_full, mesh, follow)
            r = sw.distribute_tensor(rows, mesh, [R] * nd)
            out = fn(x, i, r, m)
            torch.testing.assert_close(out.full_tensor(), want.detach(), msg=what)
            (out.full_tensor() * coef).sum().backward()
            _check_grads([x], [ref], what)
