"""MegatronPlanner's derived plans, and GPT training parity through tensor-parallel plans.

The unit tests pin the plan derived for the reference GPT (tests/models.py), for a
Llama-like and a Hugging Face GPT-2-like model built from plain modules, and for the
shape-only rule. The multi-rank tests train the reference GPT on 4 ranks, sharded by a
hand-written `parallelize_module` plan and by the planner's plan through `shard_module`,
next to single-device training: every step's loss, the first step's gradients and the
final parameters must match within 1e-5.

Both runs are in float64. In float32 one element of the token embedding ends 1.87e-5 off
(with a vocab-sharded or a replicated embedding alike), and in float64 every parameter is
within 3e-11: rows of tokens absent from a batch get gradients of ~1e-10 (softmax tails),
where Adam's update g / (|g| + eps) turns float32 rounding noise (a different summation
order once the blocks are sharded) into parameter differences. That is a property of the
model and optimizer, not of the sharding; float64 keeps the 1e-5 bound meaningful.
"""

from __future__ import annotations

import copy
import dataclasses
import doctest
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import AbstractMesh, DTensor, Replicate, Shard
from shardwise._placement import _StridedShard
from shardwise.parallel import (
    ColwiseParallel,
    FusedColwiseParallel,
    MegatronPlanner,
    RowwiseParallel,
    ShardingPlanner,
    parallelize_module,
    shard_module,
)
from shardwise.parallel import _megatron
from shardwise.testing import distributed

from ..models import GPT, GPTConfig, gpt_batch

COL = ColwiseParallel(use_local_output=False)
ROW = RowwiseParallel(use_local_output=False)
EMBED = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False)
HEAD = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
QKV = FusedColwiseParallel(parts=3, use_local_output=False)


# -- plain-module stand-ins for the model families the planner knows ------------------------------


class Conv1D(nn.Module):
    """Hugging Face GPT-2's linear layer: weight (in, out), `nf` output features."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.split_size = heads, d
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)  # fused qkv, split across shards
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(b, t, d))


class GPT2MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * d, d), Conv1D(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), GPT2Attention(d, heads), nn.LayerNorm(d), GPT2MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)


class GPT2LMHeadModel(nn.Module):
    """The module tree of transformers' GPT-2 (names, Conv1D, tied head), small."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 4, layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.transformer = GPT2Model(vocab, d, heads, layers, seq)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LlamaAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))


class LlamaMLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = LlamaAttention(d), LlamaMLP(d, 3 * d)  # 3d: not a 4x expansion
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaDecoderLayer(d) for _ in range(layers))
        self.norm = nn.RMSNorm(d)


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.model, self.lm_head = LlamaModel(vocab, d, layers), nn.Linear(d, vocab, bias=False)


# -- derived plans (no processes) ------------------------------------------------------------------


def _items(module: nn.Module) -> list[tuple[str, Any]]:
    return list(MegatronPlanner().build_plan(module).plan.items())


def test_plan_for_the_reference_gpt() -> None:
    block = lambda i: [(f"blocks.{i}.{n}", COL) for n in "qkv"] + [  # noqa: E731
        (f"blocks.{i}.proj", ROW), (f"blocks.{i}.up", COL), (f"blocks.{i}.down", ROW)
    ]
    assert _items(GPT()) == [("tok", EMBED), *block(0), *block(1), ("head", HEAD)]
    MegatronPlanner().build_plan(GPT()).validate(GPT(), AbstractMesh((4,), ("tp",)))  # tied tok / head agree: S(0)


def test_plan_for_a_llama_like_model() -> None:
    layer = lambda i: [  # noqa: E731
        *((f"model.layers.{i}.self_attn.{n}_proj", COL) for n in "qkv"),
        (f"model.layers.{i}.self_attn.o_proj", ROW),
        (f"model.layers.{i}.mlp.gate_proj", COL), (f"model.layers.{i}.mlp.up_proj", COL),
        (f"model.layers.{i}.mlp.down_proj", ROW),
    ]
    assert _items(LlamaForCausalLM()) == [("model.embed_tokens", EMBED), *layer(0), *layer(1), ("lm_head", HEAD)]


def test_plan_for_a_hugging_face_gpt2_like_model() -> None:
    block = lambda i: [  # noqa: E731
        (f"transformer.h.{i}.attn.c_attn", QKV), (f"transformer.h.{i}.attn.c_proj", ROW),
        (f"transformer.h.{i}.mlp.c_fc", COL), (f"transformer.h.{i}.mlp.c_proj", ROW),
    ]
    model = GPT2LMHeadModel()
    assert _items(model) == [("transformer.wte", EMBED), *block(0), *block(1), ("lm_head", HEAD)]
    MegatronPlanner().build_plan(model).validate(model, AbstractMesh((4,), ("tp",)))


class _Pair(nn.Module):
    def __init__(self, first: tuple[int, int], second: tuple[int, int]) -> None:
        super().__init__()
        self.fc_a, self.act, self.fc_b = nn.Linear(*first), nn.GELU(), nn.Linear(*second)


class _Lonely(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.other = nn.Linear(8, 32), nn.Linear(32, 16)


def test_shape_rule_pairs_an_expanding_and_a_contracting_linear() -> None:
    assert _items(_Pair((8, 32), (32, 8))) == [("fc_a", COL), ("fc_b", ROW)]
    assert _items(_Pair((8, 8), (8, 8))) == []  # no expansion
    assert _items(_Pair((8, 32), (32, 16))) == []  # does not contract back
    assert _items(_Lonely()) == []  # a column name without a row partner is left alone


def test_the_planner_is_a_frozen_sharding_planner() -> None:
    planner = MegatronPlanner()
    assert isinstance(planner, ShardingPlanner) and planner == MegatronPlanner() and hash(planner) == hash(MegatronPlanner())
    assert dataclasses.is_dataclass(planner)
    assert doctest.testmod(_megatron).failed == 0


# -- training parity (4 ranks) ---------------------------------------------------------------------

STEPS = 4
TOL = 1e-5


def _hand_written(model: nn.Module, mesh: sw.DeviceMesh) -> None:
    """Attention keeps DTensors (the model views with global head counts); inside the MLP, gelu runs on
    plain local pieces. The embedding and the head are left out; `replicate_rest` makes them
    replicated DTensors, so the whole model computes on DTensors."""
    parallelize_module(model, mesh, {
        "blocks.*.q": COL, "blocks.*.k": COL, "blocks.*.v": COL,
        "blocks.*.proj": ROW,
        "blocks.*.up": ColwiseParallel(),  # a plain (b, t, 4d/4) piece into gelu
        "blocks.*.down": ROW,  # takes the plain piece as Shard(-1), returns a replicated DTensor
    }, replicate_rest=True)


def _megatron_planner(model: nn.Module, mesh: sw.DeviceMesh) -> None:
    shard_module(model, MegatronPlanner(), mesh)


HOW = {"hand-written parallelize_module": _hand_written, "MegatronPlanner": _megatron_planner}


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float("inf") if got.shape != want.shape else float((got.double() - want.double()).abs().max())


@pytest.mark.parametrize("how", list(HOW))
@distributed(world_size=4)
def test_gpt_trains_like_single_device(how: str) -> None:
    shard = HOW[how]
    torch.set_default_dtype(torch.float64)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = GPT()
    model = copy.deepcopy(ref)
    shard(model, mesh)

    assert model.head.weight is model.tok.weight, "the tied LM head must stay one parameter"
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.blocks[1].q.weight.placements == (Shard(0),) and model.blocks[1].proj.weight.placements == (Shard(1),)
    assert model.tok.weight.placements == ((Shard(0),) if how == "MegatronPlanner" else (Replicate(),))

    opt = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)  # noqa: E731
    ref_opt, dist_opt = opt(ref.parameters()), opt(model.parameters())
    problems: list[str] = []
    for step in range(STEPS):
        x, y = gpt_batch(step)
        want = ref(x, y)
        want.backward()
        with sw.implicit_replication():  # GPT.forward's position ids: a plain tensor, the same on every rank
            got = model(x, y)
            got.backward()
        if not _err(_full(got).detach(), want.detach()) <= TOL:
            problems.append(f"step {step} loss {float(_full(got)):.8f} vs {float(want):.8f}")
        if step == 0:
            for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                if p.grad is None or not _err(_full(p.grad), q.grad) <= TOL:
                    problems.append(f"step 0 grad {name}: error {'missing' if p.grad is None else _err(_full(p.grad), q.grad)}")
        ref_opt.step()
        ref_opt.zero_grad()
        with sw.implicit_replication():
            dist_opt.step()
        dist_opt.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if not _err(_full(p.detach()), q.detach()) <= TOL:
            problems.append(f"final {name}: error {_err(_full(p.detach()), q.detach()):.3g}")
    assert not problems, f"GPT via {how}: {len(problems)} differences from single-device training:\n  " + "\n  ".join(problems)


@distributed(world_size=4)
def test_gpt2_like_model_through_the_planner_matches_single_device() -> None:
    """Conv1D layers, a fused qkv split across shards, and a tied vocab-sharded head: loss and gradients."""
    torch.set_default_dtype(torch.float64)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = GPT2LMHeadModel()
    model = shard_module(copy.deepcopy(ref), MegatronPlanner(), mesh["tp"])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.h[0].attn.c_attn.weight.placements == (_StridedShard(1, split_factor=3),)
    x, y = gpt_batch(0, cfg=GPTConfig(vocab=32))
    want = ref(x, y)
    want.backward()
    with sw.implicit_replication():
        got = model(x, y)
        got.backward()
    torch.testing.assert_close(_full(got), want, atol=TOL, rtol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, atol=TOL, rtol=0, msg=lambda m: f"grad {name}: {m}")
