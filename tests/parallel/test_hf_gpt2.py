"""A Hugging Face `transformers` GPT-2 (built from a small config, no download) made tensor
parallel with `parallelize_module` trains like the same model in one process.

GPT-2's layers are `Conv1D` (weight stored (in, out)) with a fused q/k/v projection
(`c_attn`); its forward makes position ids and the causal mask as plain tensors, the same
on every rank, so it runs inside `implicit_replication()`. float64: AdamW magnifies float32
rounding in near-zero gradients (see tests/test_demo.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import distributed

transformers = pytest.importorskip("transformers")  # a test dependency (pyproject's [test] extra)


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(torch.float64)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits  # (b, t, vocab)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


PLAN = {
    "transformer.wte": RowwiseParallel(input_layouts=Replicate(), use_local_output=False),  # vocab rows
    "transformer.h.*.attn.c_attn": ColwiseParallel(use_local_output=False),  # fused q, k, v columns
    "transformer.h.*.attn.c_proj": RowwiseParallel(use_local_output=False),
    "transformer.h.*.mlp.c_fc": ColwiseParallel(use_local_output=False),
    "transformer.h.*.mlp.c_proj": RowwiseParallel(use_local_output=False),
    "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # tied to wte
}


@distributed(world_size=4)
def test_hugging_face_gpt2_parallelized_trains_like_one_process() -> None:
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    reference = _gpt2()
    model = parallelize_module(copy.deepcopy(reference), mesh, PLAN, replicate_rest=True)  # every layer on DTensors
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.transformer.h[0].attn.c_attn.weight.placements == (Shard(1),)  # Conv1D: (in, out)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        want = _loss(reference, ids)
        with sw.implicit_replication():  # position ids and the causal mask are plain tensors
            got = _loss(model, ids)
            got.backward()
        want.backward()
        assert abs(got.full_tensor().item() - want.item()) <= 1e-5, (step, got, want)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
