"""The demo's model: a small character-level GPT, written as plain single-device PyTorch.

Nothing in it knows about meshes: the demo shards it from the outside (tensor parallel by
the built-in planner's plan, data parallel over the other mesh dim) and the same code runs
on DTensors. Module names follow the common GPT layout (`tok`, `q`/`k`/`v`/`proj`, `up`/
`down`, `head`) so the planner recognises the Megatron cuts. Position ids are a buffer, so
sharding the module turns them into a DTensor like everything else it holds (a plain
`torch.arange` made inside forward would meet sharded tensors as a stranger).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharGPT", "CharGPTConfig", "loss_fn", "pipeline_layers"]


@dataclass(frozen=True)
class CharGPTConfig:
    vocab: int
    d_model: int = 64
    heads: int = 4
    seq: int = 32
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        # no key bias: it shifts every score of a query equally, which softmax ignores
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # (b, heads, t, d/heads)

        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        out: torch.Tensor = self.proj(a.transpose(1, 2).reshape(b, t, d))  # (b, t, d)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))  # (b, t, d)
        return out


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class CharGPT(nn.Module):
    """Token + position embeddings, `layers` blocks, final LayerNorm, LM head tied to the tokens."""

    positions: torch.Tensor

    def __init__(self, cfg: CharGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.register_buffer("positions", torch.arange(cfg.seq), persistent=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for m in self.modules():  # GPT-2's initialisation: small weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-character logits (batch, seq, vocab) for int64 ids (batch, seq)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:t])  # (b, t, d)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))  # (b, t, vocab)
        return logits


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Embed(nn.Module):
    """The first pipeline layer: token + position embeddings (the model's own modules)."""

    positions: torch.Tensor

    def __init__(self, model: CharGPT) -> None:
        super().__init__()
        self.tok, self.pos = model.tok, model.pos
        self.register_buffer("positions", model.positions.clone(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tok(idx) + self.pos(self.positions[: idx.shape[1]])
        return out


class Final(nn.Module):
    """The last pipeline layer: final LayerNorm and the LM head (tied to `Embed.tok`)."""

    def __init__(self, model: CharGPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def pipeline_layers(model: CharGPT) -> nn.Sequential:
    """`model` as a sequence of layers for a pipeline (`embed`, `block0`, ..., `final`),
    sharing its modules and parameters: the same function, cut where stages may begin."""
    layers = [("embed", Embed(model))] + [(f"block{i}", b) for i, b in enumerate(model.blocks)]
    return nn.Sequential(OrderedDict(layers + [("final", Final(model))]))
