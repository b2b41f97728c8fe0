"""dp x pp: `fully_shard` inside the stages of every schedule, against torch's and one process.

The program torchtitan runs (its `parallelize` and `pipeline_llm`), written once and run
twice on 4 gloo processes, first with torch's imports (`torch.distributed.pipelining`,
`torch.distributed.fsdp.fully_shard`, torch's `init_device_mesh`), then with shardwise's: a
(pp=2, dp=2) mesh; each rank builds its stage modules (two blocks and a head each), applies
`fully_shard` over the dp sub-mesh to each block and then to the stage module, with
torchtitan's policy under pp (`reshard_after_forward=False`: no gather per micro-batch),
wraps them in `PipelineStage` over the pp group, and runs 3 AdamW steps of `schedule.step`
on its dp replica's half of each batch, in float64.

For each schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBV and
DualPipeV; torch runs them all with FSDP on CPU/gloo) the losses and every parameter after
the 3 steps equal torch's within 1e-10, and the one-process run's (the whole model on the
whole batch). Both libraries gather and reduce each unit once per step, whatever the number
of micro-batches (torch's schedules run every backward with gradient sync and the reshard
after backward off, then reduce): counted, one all_gather (torch: two in its first step, whose
shape-inferring forward gathers too) and one reduce_scatter per unit of this rank per step.
Without that (each micro-batch's backward reducing), shardwise's count was m per unit.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import comm_log
from shardwise.testing import distributed

from ._program import CASES

D = 6  # feature width
ROWS = 16  # rows of a whole batch: each dp replica takes half
PP, DP, STEPS, LR, TOL = 2, 2, 3, 0.05, 1e-10
SINGLE = ("ScheduleGPipe", "Schedule1F1B")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
BLOCKS = 2  # fully_shard units per stage: one per block, and the stage module's own (its head)


class Stage(nn.Module):
    """One stage's module, as torchtitan cuts a model: blocks, then a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(BLOCKS))
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stages(num_stages: int) -> list[Stage]:
    """Every stage's module, float64, the same weights on every rank."""
    torch.manual_seed(0)
    return [Stage().double() for _ in range(num_stages)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(ROWS, D, generator=g, dtype=torch.float64),
            torch.randn(ROWS, D, generator=g, dtype=torch.float64))


def stage_indices(schedule: str, rank: int, num_stages: int) -> list[int]:
    """The stages torch puts on pp rank `rank` (one, looped, or in a V)."""
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, num_stages - 1 - rank]
    return list(range(rank, num_stages, PP))


class Libraries:
    """The imports of one side: `pipelining`, `fully_shard` and `init_device_mesh`."""

    def __init__(self, name: str) -> None:
        if name == "torch":
            self.pipelining = importlib.import_module("torch.distributed.pipelining")
            self.fully_shard = importlib.import_module("torch.distributed.fsdp").fully_shard
            self.init_device_mesh = importlib.import_module("torch.distributed.device_mesh").init_device_mesh
        else:
            self.pipelining = importlib.import_module("shardwise.pipelining")
            self.fully_shard = importlib.import_module("shardwise.fsdp").fully_shard
            self.init_device_mesh = importlib.import_module("shardwise").init_device_mesh
        self.name = name


KINDS = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),  # torch's FSDP2 calls, by torch version
         "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


@contextmanager
def counting(name: str) -> Iterator[dict[str, int]]:
    """The all_gathers and reduce_scatters over a mesh dim this rank issues inside the block:
    shardwise's from `comm_log()`, torch's at the `torch.distributed` functions its FSDP2 calls."""
    count = dict.fromkeys(KINDS, 0)
    if name == "shardwise":
        with comm_log() as log:
            yield count
        for kind in KINDS:  # (the pipe's own exchange of each step's outcome, over pp, names no mesh dim)
            count[kind] = sum(r.op == kind and bool(r.mesh_dims) for r in log)
        return
    originals = {(kind, f): getattr(dist, f) for kind, fs in KINDS.items() for f in fs if hasattr(dist, f)}

    def counted(kind: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[kind] += 1
            return original(*args, **kwargs)
        return call

    for (kind, f), original in originals.items():
        setattr(dist, f, counted(kind, original))
    try:
        yield count
    finally:
        for (_, f), original in originals.items():
            setattr(dist, f, original)


def train(name: str, schedule: str, num_stages: int, n_microbatches: int) -> dict[str, Any]:
    """`STEPS` AdamW steps on this rank: each step's losses (last stage's rank), its
    all_gathers and reduce_scatters, and this rank's parameters after them, whole."""
    lib = Libraries(name)
    mesh = lib.init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    modules = stages(num_stages)
    mine = stage_indices(schedule, pp_rank, num_stages)
    for j in mine:  # torchtitan's order and policy under pp: each block, then the stage; no reshard after forward
        for block in modules[j].blocks:
            lib.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        lib.fully_shard(modules[j], mesh=mesh["dp"], reshard_after_forward=False)
    built = [lib.pipelining.PipelineStage(modules[j], j, num_stages, torch.device("cpu"), group=mesh.get_group("pp"))
             for j in mine]
    cls = getattr(lib.pipelining, schedule)
    sched = cls(built[0] if schedule in SINGLE else built, n_microbatches, loss_fn=nn.functional.mse_loss)
    params = [p for j in mine for p in modules[j].parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine
    losses, counts = [], []
    for step in range(STEPS):
        x, y = (t.chunk(DP)[dp_rank] for t in batch(step))
        opt.zero_grad()
        got: list[torch.Tensor] = []
        with counting(name) as count:
            sched.step(*((x,) if holds_first else ()), target=y if holds_last else None,
                       losses=got if holds_last else None)
        opt.step()
        losses.append([float(t.detach()) for t in got])
        counts.append(count)
    final = {f"{j}.{n}": p.full_tensor().detach().clone() for j in mine for n, p in modules[j].named_parameters()}
    if name == "shardwise":
        sched.close()
    return {"losses": losses, "collectives": counts, "params": final, "stages": mine}


def reference(num_stages: int, n_microbatches: int) -> dict[str, Any]:
    """The same steps in one process: every stage chained on the whole batch; each dp replica's
    micro-batches' losses, and the gradients of the mean of all of them (equal micro-batches)."""
    modules = stages(num_stages)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=LR)
    losses: list[list[list[float]]] = []  # step, dp replica, micro-batch
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        per_replica, terms = [], []
        for xr, yr in zip(x.chunk(DP), y.chunk(DP)):
            mb = []
            for xi, yi in zip(xr.tensor_split(n_microbatches), yr.tensor_split(n_microbatches)):
                for m in modules:
                    xi = m(xi)
                loss = nn.functional.mse_loss(xi, yi)
                terms.append(loss)
                mb.append(float(loss.detach()))
            per_replica.append(mb)
        (sum(terms) / len(terms)).backward()
        opt.step()
        losses.append(per_replica)
    return {"losses": losses,
            "params": {f"{j}.{n}": p.detach() for j, m in enumerate(modules) for n, p in m.named_parameters()}}




@pytest.mark.parametrize("schedule, num_stages, n_microbatches", CASES)
@distributed(world_size=4)
def test_fully_shard_inside_stages_trains_as_torchs_and_one_process(schedule: str, num_stages: int,
                                                                     n_microbatches: int) -> None:
    theirs = train("torch", schedule, num_stages, n_microbatches)
    ours = train("shardwise", schedule, num_stages, n_microbatches)
    whole = reference(num_stages, n_microbatches)
    assert ours["stages"] == theirs["stages"]
    holds_last = num_stages - 1 in ours["stages"]
    dp_rank = dist.get_rank() % DP
    expected = [per_replica[dp_rank] if holds_last else [] for per_replica in whole["losses"]]
    for step in range(STEPS):
        assert ours["losses"][step] == pytest.approx(theirs["losses"][step], abs=TOL, rel=0), f"step {step}"
        assert ours["losses"][step] == pytest.approx(expected[step], abs=TOL, rel=0), f"step {step}"
    assert sorted(ours["params"]) == sorted(theirs["params"])
    for key, p in theirs["params"].items():
        torch.testing.assert_close(ours["params"][key], p, atol=TOL, rtol=0, msg=lambda m: f"{key} vs torch: {m}")
        torch.testing.assert_close(ours["params"][key], whole["params"][key], atol=TOL, rtol=0,
                                   msg=lambda m: f"{key} vs one process: {m}")
    units = len(ours["stages"]) * (BLOCKS + 1)
    # each unit gathered once per step (kept through the micro-batches: no reshard after forward, nor after
    # backward until the step's end) and reduced once; torch's first step gathers each unit once more, for the
    # forward that infers its stages' shapes
    assert ours["collectives"] == [{"all_gather": units, "reduce_scatter": units}] * STEPS
    assert [c["reduce_scatter"] for c in theirs["collectives"]] == [units] * STEPS
    assert [c["all_gather"] for c in theirs["collectives"]] == [2 * units] + [units] * (STEPS - 1)
