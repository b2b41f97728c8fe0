"""The training job of `shardwise demo`, as every rank runs it, and its single-process reference.

Each rank builds the same CharGPT from one seed, cuts it with the built-in Megatron
planner over the `tp` mesh dim, makes it data parallel over `dp` (parameters, gradients
and optimizer state sharded ZeRO-3 style unless told otherwise), and trains it with AdamW
on its share of each global batch, the cross-entropy computed on vocab-sharded logits
under `loss_parallel()`. Rank 0 then trains the unsharded model on whole batches in one
process and compares the two loss curves step by step.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..parallel import ParallelStyle
from .data import CharData
from .model import CharGPT, CharGPTConfig, loss_fn

__all__ = ["DemoConfig", "DemoResult", "manual_plan", "progress_bar", "train_reference", "train_sharded"]


@dataclass(frozen=True)
class DemoConfig:
    mesh: tuple[int, ...] = (2, 2)  # (dp, tp), or (pp, dp, tp) for the pipelined run (see `pipelined`)
    steps: int = 150
    batch: int = 16  # global: split over dp
    lr: float = 3e-3
    device: str = "cpu"
    shard_parameters: bool = True
    plan: str = "planner"  # "planner": MegatronPlanner's plan; "manual": MANUAL_PLAN
    dtype: torch.dtype = torch.float32
    seed: int = 0


@dataclass
class DemoResult:
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # this rank: params, grads, optimizer, unsharded
    layouts: list[object] = field(default_factory=list)
    mesh: object = None  # the DeviceMesh it ran on
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)  # full values after training


def _model(cfg: DemoConfig, data: CharData, device: str) -> CharGPT:
    torch.manual_seed(cfg.seed)
    return CharGPT(CharGPTConfig(vocab=data.vocab)).to(device=device, dtype=cfg.dtype)


def manual_plan() -> dict[str, ParallelStyle]:
    """The Megatron cuts written by hand (what MegatronPlanner derives for this model)."""
    from shardwise import Replicate, Shard
    from shardwise.parallel import ColwiseParallel, RowwiseParallel

    colwise = ColwiseParallel(use_local_output=False)  # q, k, v, up: output split by columns
    rowwise = RowwiseParallel(use_local_output=False)  # proj, down: partial sums reduced once
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), use_local_output=False),  # vocab rows
        "blocks.*.attn.[qkv]": colwise,
        "blocks.*.attn.proj": rowwise,
        "blocks.*.mlp.up": colwise,
        "blocks.*.mlp.down": rowwise,
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # vocab-split logits
    }


def _optimizer(model: nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)


def train_sharded(cfg: DemoConfig, progress: Callable[[int, float, float], None] | None = None) -> DemoResult:
    """Run on every rank of a (dp, tp) mesh; returns this rank's view (losses averaged over dp)."""
    import shardwise as sw
    from shardwise import DTensor, Partial
    from shardwise.parallel import (
        MegatronPlanner, data_parallel, loss_parallel, memory_report, parallelize_module, shard_module,
    )

    dp, tp = cfg.mesh
    mesh = sw.init_device_mesh(cfg.device, (dp, tp), mesh_dim_names=("dp", "tp"))
    data = CharData()
    model = _model(cfg, data, cfg.device)
    if cfg.plan == "manual":
        parallelize_module(model, mesh["tp"], manual_plan(), replicate_rest=True)  # the whole model on DTensors
    else:
        shard_module(model, MegatronPlanner().build_plan(model), mesh["tp"])
    data_parallel(model, mesh, dp_dim="dp", shard_parameters=cfg.shard_parameters)
    opt = _optimizer(model, cfg)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    share = slice(coordinate[0] * cfg.batch // dp, (coordinate[0] + 1) * cfg.batch // dp)
    result = DemoResult(mesh=mesh)
    seq = model.cfg.seq
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = data.batch(step, cfg.batch, seq)
        x, y = x[share].to(cfg.device), y[share].to(cfg.device)  # this dp rank's rows
        with loss_parallel():
            loss = loss_fn(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step == cfg.steps - 1:  # parameters, gradients and optimizer state all present
            result.memory = memory_report(model, opt)
        opt.zero_grad(set_to_none=True)
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        mean = DTensor.from_local(local.detach().reshape(1), mesh["dp"], [Partial("avg")]).full_tensor()
        result.losses.append(float(mean))
        result.tokens += cfg.batch * seq
        if progress is not None:
            progress(step, result.losses[-1], result.tokens / (time.perf_counter() - t0))
    result.seconds = time.perf_counter() - t0
    result.parameters = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                         for n, p in model.named_parameters()}
    result.layouts = _layouts(model)
    return result


def _layouts(model: nn.Module) -> list[object]:
    from shardwise import DTensor

    from ..debug._picture import ParamLayout

    out: list[object] = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out.append(ParamLayout(name, tuple(p.shape), tuple(p.placements), p._spec.shard_order))
    return out


def train_reference(cfg: DemoConfig, model_out: list[nn.Module] | None = None) -> list[float]:
    """The same training in one process on whole batches: the loss of every step (the
    trained model is appended to `model_out` when given)."""
    data = CharData()
    model = _model(cfg, data, "cpu")
    opt = _optimizer(model, cfg)
    losses = []
    for step in range(cfg.steps):
        x, y = data.batch(step, cfg.batch, model.cfg.seq)
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if model_out is not None:
        model_out.append(model)
    return losses


def progress_bar(total: int, width: int = 30) -> Callable[[int, float, float], None]:
    """A one-line progress bar with loss and tokens/s (a line per 10 steps when not a terminal)."""
    tty = sys.stdout.isatty()

    def show(step: int, loss: float, tokens_per_s: float) -> None:
        done = step + 1
        bar = "#" * math.floor(width * done / total) + "." * (width - math.floor(width * done / total))
        line = f"step {done:>4}/{total} [{bar}] loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s"
        if tty:
            print("\r" + line, end="\n" if done == total else "", flush=True)
        elif done % 10 == 0 or done == total:
            print(line, flush=True)

    return show
