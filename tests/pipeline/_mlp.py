"""The MLP that the tensor-parallel pipeline tests cut into two stages, and its one-process run.

Each stage is a column- then row-parallel pair (`PLAN`); the activation that crosses the
stage boundary is split by rows (`Shard(0)`), so the tests can count its pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel

D = 8
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
        "3": ColwiseParallel(input_layouts=Shard(0)), "5": RowwiseParallel()}


def mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, D), nn.Linear(D, hidden), nn.ReLU(),
                         nn.Linear(hidden, D)).double()


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, D, generator=g, dtype=torch.float64), torch.randn(rows, D, generator=g, dtype=torch.float64)


def one_process(model: nn.Module, rows: int, steps: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """(loss, every parameter by name, tied ones under each name) after each AdamW step in one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        x, y = batch(step, rows)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append((loss.item(), {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}))
    return out
