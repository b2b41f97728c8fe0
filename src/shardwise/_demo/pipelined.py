"""`shardwise demo --mesh PPxDPxTP`: the same training, 3-D: a pipeline of tensor-parallel,
ZeRO-3 data-parallel stages.

The CharGPT is cut into layers (`pipeline_layers`: embeddings, blocks, final norm and
head, the head tied to the token embedding across the first and last stage), split into
`pp` stages of about equal layers, each stage sharded over its tp sub-mesh by the Megatron
cuts and over dp by ZeRO-3, and trained with 1F1B on micro-batches. The loss of a step is
known on the last stage's ranks; every rank learns the mean over dp through one small
reduction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .data import CharData
from .model import CharGPT, CharGPTConfig, loss_fn, pipeline_layers
from .train import DemoConfig, DemoResult

__all__ = ["CHUNKS", "pipeline_plan", "train_pipelined"]

CHUNKS = 4  # micro-batches per step


def pipeline_plan() -> dict[str, Any]:
    """The Megatron cuts, by the names of `pipeline_layers`."""
    from shardwise import Replicate, Shard
    from shardwise.parallel import ColwiseParallel, RowwiseParallel

    colwise, rowwise = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    return {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), use_local_output=False),  # vocab rows
        "block*.attn.[qkv]": colwise, "block*.attn.proj": rowwise,
        "block*.mlp.up": colwise, "block*.mlp.down": rowwise,
        "final.head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # vocab-split logits
    }


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from shardwise.parallel import loss_parallel

    with loss_parallel():
        return loss_fn(logits, targets)


def _balance(layers: int, pp: int) -> list[int]:
    return [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]


def train_pipelined(cfg: DemoConfig, progress: Callable[[int, float, float], None] | None = None) -> tuple[DemoResult, Any]:
    """Run on every rank of a (pp, dp, tp) mesh; returns this rank's view and the pipe."""
    import shardwise as sw
    from shardwise import DTensor, Partial
    from shardwise.parallel import memory_report
    from shardwise.pipeline import DistributedPipe

    pp, dp, tp = cfg.mesh
    mesh = sw.init_device_mesh(cfg.device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    data = CharData()
    torch.manual_seed(cfg.seed)
    model = CharGPT(CharGPTConfig(vocab=data.vocab)).to(device=cfg.device, dtype=cfg.dtype)
    # the whole model's parameters, gradients and AdamW's two moments (a rank's pipe holds one stage)
    unsharded = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    layers = pipeline_layers(model)
    pipe = DistributedPipe(layers, _balance(len(layers), pp), mesh, tp_plan=pipeline_plan(),
                           shard_parameters=cfg.shard_parameters and dp > 1, schedule="1f1b", chunks=CHUNKS,
                           checkpoint="never", loss_fn=_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr, weight_decay=0.01)
    d = mesh.get_local_rank("dp")
    result = DemoResult(mesh=mesh)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = data.batch(step, cfg.batch, model.cfg.seq)
        share = slice(d * cfg.batch // dp, (d + 1) * cfg.batch // dp)
        loss = pipe.step(x[share].to(cfg.device), y[share].to(cfg.device))
        opt.step()
        if step == cfg.steps - 1:
            result.memory = {**memory_report(pipe, opt), "unsharded_total": unsharded}
        opt.zero_grad(set_to_none=True)
        # the last stage's ranks hold the loss of their replica's batch: the mean over them all
        mine = torch.tensor([float(loss) if loss is not None else 0.0, 1.0 if loss is not None else 0.0],
                            dtype=torch.float64, device=cfg.device)
        total = DTensor.from_local(mine, mesh, [Partial()] * 3).full_tensor().cpu()
        result.losses.append(float(total[0] / total[1]))
        result.tokens += cfg.batch * model.cfg.seq
        if progress is not None:
            progress(step, result.losses[-1], result.tokens / (time.perf_counter() - t0))
    result.seconds = time.perf_counter() - t0
    return result, pipe

