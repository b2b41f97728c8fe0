"""Small reference models for the parity tests: a GPT-2-style transformer and a CNN.

Both are plain single-device PyTorch modules: nothing in them knows about meshes. The
parity tests deep-copy them, turn parameters (and buffers) into DTensors with
`distribute_params`, and train both copies side by side. Sizes are tiny so that a
training step on four CPU ranks takes milliseconds, yet every op family a real model
needs is exercised: embeddings, layer norm, causal attention through
`F.scaled_dot_product_attention`, GELU, a tied LM head and cross-entropy for the GPT;
convolution, batch norm (running statistics included), pooling and a linear head for
the CNN.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CNN", "GPT", "GPTConfig", "ResidualMLP", "distribute_params", "gpt_batch", "cnn_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    seq: int = 8
    layers: int = 2


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(d)
        # No key bias: it adds the same q.b_k to every score of a query, which softmax ignores,
        # so its gradient is rounding noise and Adam would turn that noise into +-lr steps.
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # (b, heads, t, d/heads)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d/heads)
        a = a.transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ResidualMLP(nn.Module):
    """x + down(relu(up(x))), 16 -> 32 -> 16: the block the compile tests shard, by TP
    (`up` column-split, `down` row-split) and by `fully_shard`."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class GPT(nn.Module):
    """Token + position embedding, `layers` blocks, final LayerNorm, LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token logits against `targets`, both (batch, seq) int64."""
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t))  # (b, t, d); the positions are the same on every rank
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (b, t, vocab)
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t))


class CNN(nn.Module):
    """conv -> batch norm -> relu -> max-pool -> conv -> adaptive avg-pool -> linear; cross-entropy."""

    def __init__(self, channels: int = 3, classes: int = 10) -> None:
        super().__init__()
        # No bias before batch norm: the batch mean cancels it, so its gradient is rounding
        # noise (the same reason the GPT has no key bias).
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(images))), 2)  # (b, 8, h/2, w/2)
        x = F.adaptive_avg_pool2d(self.conv2(x), 1).flatten(1)  # (b, 16)
        return F.cross_entropy(self.fc(x), labels)


def gpt_batch(step: int, batch: int = 4, cfg: GPTConfig = GPTConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, next tokens) for a step: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def cnn_batch(step: int, batch: int = 8, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (images, labels) for a step: the same on every rank."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


Placements = Sequence[Any]
PlanFn = Callable[[str, torch.Tensor], Optional[Placements]]


def distribute_params(model: nn.Module, mesh: Any, plan: PlanFn, buffers: Optional[PlanFn] = None) -> nn.Module:
    """A deep copy of `model` whose parameters are DTensors placed by `plan(name, tensor)`.

    Each parameter becomes `nn.Parameter(distribute_tensor(p, mesh, plan(name, p)))`;
    a parameter shared by several modules (a tied embedding) is distributed once and the
    same new parameter is put back everywhere it was used. `plan` returning None keeps a
    parameter as a plain tensor. Buffers with at least one dim (batch-norm running
    statistics) go through `buffers` (default: replicated); scalar buffers stay plain.
    """
    import shardwise as sw

    copy_ = copy.deepcopy(model)
    made: dict[int, nn.Parameter] = {}
    for name, p in list(copy_.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            placements = plan(name, p)
            made[id(p)] = p if placements is None else nn.Parameter(sw.distribute_tensor(p.detach(), mesh, placements))
        owner, attr = _owner(copy_, name)
        setattr(owner, attr, made[id(p)])
    for name, b in list(copy_.named_buffers()):
        if b.ndim == 0:
            continue
        placements = buffers(name, b) if buffers is not None else [sw.Replicate()] * mesh.ndim
        if placements is not None:
            owner, attr = _owner(copy_, name)
            setattr(owner, attr, sw.distribute_tensor(b, mesh, placements))
    return copy_


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
