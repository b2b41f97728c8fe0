"""The program each test runs twice, once through torch.distributed.pipelining and once
through shardwise.pipelining: the same model, seeds, batch and schedule."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# (schedule, stages, micro-batches): one stage per pp rank, or two (DualPipeV needs 2 * pp micro-batches)
CASES = [
    ("ScheduleGPipe", 2, 4),
    ("Schedule1F1B", 2, 4),
    ("ScheduleInterleaved1F1B", 4, 4),
    ("ScheduleLoopedBFS", 4, 4),
    ("ScheduleInterleavedZeroBubble", 4, 4),
    ("ScheduleZBVZeroBubble", 4, 4),
    ("ScheduleDualPipeV", 4, 8),
]

D = 6  # feature width
ROWS = 8  # batch rows

SINGLE = ("ScheduleGPipe", "Schedule1F1B")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def library(name: str) -> Any:
    return importlib.import_module("torch.distributed.pipelining" if name == "torch" else "shardwise.pipelining")


def layers(num_stages: int) -> list[nn.Module]:
    """One small block per stage, float64, the same weights on every rank."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()).double() for _ in range(num_stages)]


def batch(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, D, generator=g, dtype=torch.float64), torch.randn(rows, D, generator=g, dtype=torch.float64)


def stage_indices(schedule: str, rank: int, pp: int, num_stages: int) -> list[int]:
    """The stages torch puts on `rank`: one for single-stage schedules, `rank + k pp` for
    looped/interleaved ones, `rank` and `2 pp - 1 - rank` for the V-shaped ones."""
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, num_stages - 1 - rank]
    return list(range(rank, num_stages, pp))


class Scaled(nn.Module):
    """A block that takes a keyword argument, which every stage gets cut per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


def run(lib_name: str, schedule: str, num_stages: int, n_microbatches: int, rows: int = ROWS,
        mode: str = "step", group: Any = None) -> dict[str, Any]:
    """One step on this rank (`mode`: "step", "eval" (forward only), or "kwargs" (every block
    takes a `scale` keyword argument)): the losses, the last stage's output and the gradients
    of this rank's parameters (by stage and name)."""
    lib = library(lib_name)
    rank, pp = dist.get_rank(group), dist.get_world_size(group)
    blocks = layers(num_stages)
    if mode == "kwargs":
        torch.manual_seed(0)
        blocks = [Scaled().double() for _ in range(num_stages)]
    mine = stage_indices(schedule, rank, pp, num_stages)
    stages = [lib.PipelineStage(blocks[j], j, num_stages, torch.device("cpu"), group=group) for j in mine]
    cls = getattr(lib, schedule)
    sched = cls(stages[0] if schedule in SINGLE else stages, n_microbatches, loss_fn=nn.functional.mse_loss)
    x, y = batch(rows)
    losses: list[torch.Tensor] = []
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine
    kwargs = {"scale": torch.linspace(0.5, 1.5, rows, dtype=torch.float64).unsqueeze(1)} if mode == "kwargs" else {}
    call = sched.eval if mode == "eval" else sched.step
    out = call(*((x,) if holds_first else ()), target=y if holds_last else None,
               losses=losses if holds_last else None, **kwargs)
    grads = {f"{j}.{name}": p.grad.clone() for j in mine for name, p in blocks[j].named_parameters()
             if p.grad is not None}
    return {"losses": [float(t.detach()) for t in losses], "output": None if out is None else out.detach().clone(),
            "grads": grads}


def side_by_side(schedule: str, num_stages: int, n_microbatches: int, rows: int = ROWS,
                 mode: str = "step") -> tuple[dict[str, Any], dict[str, Any]]:
    """The same step through torch's pipelining, then through shardwise's, on this rank."""
    return (run("torch", schedule, num_stages, n_microbatches, rows, mode),
            run("shardwise", schedule, num_stages, n_microbatches, rows, mode))


class Chain(nn.Module):
    """A model whose forward runs its blocks in order: an input layer, a ModuleList of blocks
    and a head; with `split`, it calls `split()` (a library's `pipe_split`) after block 1."""

    def __init__(self, split: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(D, D)
        self.split = split
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k == 1 and self.split is not None:
                self.split()
        return self.head(x)


def run_split(lib_name: str, marks: bool, n_microbatches: int = 4) -> dict[str, Any]:
    """A `Chain` cut by `pipeline(...)` (at `split_spec` or at its `pipe_split()` call) into 2
    stages, one per rank, trained one step with 1F1B."""
    lib = library(lib_name)
    rank = dist.get_rank()
    model = Chain(lib.pipe_split if marks else None)
    x, y = batch()
    spec = None if marks else {"layers.2": lib.SplitPoint.BEGINNING}
    pipe = lib.pipeline(model, (x.tensor_split(n_microbatches)[0],), split_spec=spec)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = lib.Schedule1F1B(stage, n_microbatches, loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    out = sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses if rank == 1 else None)
    module = pipe.get_stage_module(rank)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return {"num_stages": pipe.num_stages, "losses": [float(t.detach()) for t in losses],
            "output": None if out is None else out.detach().clone(), "grads": grads}


def split_side_by_side(marks: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    return run_split("torch", marks), run_split("shardwise", marks)


def reference(num_stages: int, n_microbatches: int, rows: int = ROWS) -> dict[str, Any]:
    """The step in one process, without a pipeline: the blocks chained on each micro-batch
    (`tensor_split`'s), the gradients of the mean of the micro-batches' losses."""
    blocks = layers(num_stages)
    x, y = batch(rows)
    outputs, losses = [], []
    for xi, yi in zip(x.tensor_split(n_microbatches), y.tensor_split(n_microbatches)):
        for block in blocks:
            xi = block(xi)
        outputs.append(xi)
        losses.append(nn.functional.mse_loss(xi, yi))
    (sum(losses) / n_microbatches).backward()
    return {"losses": [float(t.detach()) for t in losses], "output": torch.cat(outputs).detach(),
            "grads": {f"{j}.{name}": p.grad for j, block in enumerate(blocks) for name, p in block.named_parameters()}}


def pipelines_side_by_side(schedule: str, num_stages: int, n_microbatches: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two pipelines of 2 processes each ({0, 1} and {2, 3}), each over its own group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[dist.get_rank() // 2]
    return (run("torch", schedule, num_stages, n_microbatches, group=group),
            run("shardwise", schedule, num_stages, n_microbatches, group=group))
