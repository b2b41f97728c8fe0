"""A small U-Net trains across 2 processes exactly as it trains in one.

Two encoder/decoder pairs, each pair's skip isolated in its own `Namespace` (both skips
are named 'skip'), cut into stages so that both skips cross from one rank to the other
(1F1B) or between stages that are interleaved over the ranks. Every rank trains the
single-process reference on the whole batch beside its pipeline stages; after each of 5
AdamW steps the pipeline's loss (last stage) and, at the end, every parameter must match.

Float64, because AdamW divides each gradient by the root of its running square: on the
first step every weight moves by about `lr * sign(grad)`, so a gradient that float32
rounding leaves near zero with the other sign moves that weight by up to `2 * lr` from the
reference. In float64 the pipeline and the reference agree to about 1e-15, and the check
uses 1e-9.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.pipeline._runtime import DistributedPipe
from shardwise.pipeline.skip import Namespace, pop, skippable, stash
from shardwise.testing import distributed

STEPS = 5
TOL = 1e-9


@skippable(stash=["skip"])
class Down(nn.Module):
    """Encoder block: convolve, keep the features for the decoder, halve the resolution."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        h = torch.relu(self.conv(x))
        yield stash("skip", h)
        return F.avg_pool2d(h, 2)


@skippable(pop=["skip"])
class Up(nn.Module):
    """Decoder block: double the resolution, join the encoder's features, convolve."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin + cskip, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        skip = yield pop("skip")
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        return torch.relu(self.conv(torch.cat([x, skip], dim=1)))


def unet() -> nn.Sequential:
    torch.manual_seed(0)
    outer, inner = Namespace("outer"), Namespace("inner")
    return nn.Sequential(
        Down(1, 4).isolate(outer),  # (B, 1, 8, 8) -> (B, 4, 4, 4); stashes (B, 4, 8, 8)
        Down(4, 8).isolate(inner),  # -> (B, 8, 2, 2); stashes (B, 8, 4, 4)
        nn.Conv2d(8, 8, 3, padding=1),  # bottleneck
        nn.ReLU(),
        Up(8, 8, 4).isolate(inner),  # -> (B, 4, 4, 4)
        Up(4, 4, 4).isolate(outer),  # -> (B, 4, 8, 8)
        nn.Conv2d(4, 1, 1),  # -> (B, 1, 8, 8)
    ).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, F.avg_pool2d(x, 3, stride=1, padding=1)  # learn to blur


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y, t)


@pytest.mark.parametrize("schedule, balance", [
    ("1f1b", [3, 4]),  # both skips from rank 0 to rank 1
    ("interleaved", [1, 2, 2, 2]),  # 'inner': stage 1 (rank 1) to 2 (rank 0); 'outer': stage 0 (rank 0) to 3 (rank 1)
])
@distributed(world_size=2)
def test_unet_trains_across_two_processes_like_one(schedule: str, balance: list[int]) -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    ref = unet()
    pipe = DistributedPipe(copy.deepcopy(ref), balance, mesh, schedule=schedule, chunks=4,
                           checkpoint="except_last", loss_fn=mse)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    x, t = data()
    losses = []
    for step in range(STEPS):
        ref_opt.zero_grad()
        ref_loss = mse(ref(x), t)
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss = pipe.step(x, t)
        opt.step()
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss.detach(), atol=TOL, rtol=0, msg=f"loss of step {step}")
            losses.append(loss.item())
    want = dict(ref.named_parameters())
    for part in pipe.partitions.values():
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, want[name], atol=TOL, rtol=0, msg=f"{name} after {STEPS} steps")
    if losses:
        assert losses[-1] < losses[0], losses  # it does learn
    pipe.close()
