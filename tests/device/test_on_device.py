"""The tests that follow the device: `SHARDWISE_TEST_DEVICE=cuda` runs them on CUDA tensors.

On CPU (the default, and CI) they run on gloo like the rest of the suite; on a machine with
a GPU, `SHARDWISE_TEST_DEVICE=cuda pytest tests/device` (what `scripts/gpu_check.sh` runs)
puts every tensor on the GPU:

- a 1-rank mesh on the device's own backend (NCCL on CUDA), in a fresh process: ops,
  redistribute, a tensor-parallel MLP's forward and backward, a `fully_shard` train step, a
  replayed (`shardwise.compile`) step, a checkpoint saved and loaded back, each against the
  same computation on plain tensors;
- 2 ranks sharing the one device through gloo (which takes CUDA tensors for some
  collectives; NCCL refuses two ranks on one GPU): every redistribute between Shard(0),
  Shard(1), Replicate and Partial, a tensor-parallel train step, `fully_shard` units (on
  CUDA their gathers run on a side stream), a 1F1B pipeline and a dry run of the TP step.

Every result is compared with one process on plain tensors (float64, 1e-10). What fails on
CUDA is what the GPU check reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.testing import run_distributed

DEVICE = os.environ.get("SHARDWISE_TEST_DEVICE", "cpu")
ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-10

pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="SHARDWISE_TEST_DEVICE=cuda on a machine without CUDA")


def _device() -> torch.device:
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double().to(_device())


def _batch(rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 8, generator=g, dtype=torch.float64), torch.randn(rows, 8, generator=g, dtype=torch.float64)
    return x.to(_device()), y.to(_device())


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3,
           step_fn: Any = None) -> list[torch.Tensor]:
    """`steps` AdamW steps of mse(model(x), y); the parameters after, whole."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()

    run = step_fn(step) if step_fn is not None else step
    for _ in range(steps):
        run(model, opt, x, y)
    return [_full(p).detach() for p in model.parameters()]


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


# -- one rank, the device's own backend ---------------------------------------------------------

def one_rank(out: str) -> None:
    """In a fresh process: a 1-rank mesh made by `init_device_mesh` (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    from shardwise import checkpoint
    from shardwise.fsdp import fully_shard
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.init_device_mesh(DEVICE, (1,))
    results: dict[str, Any] = {"backend": str(dist.get_backend())}
    x, y = _batch()
    a = sw.distribute_tensor(x, mesh, [Shard(0)])
    w = torch.randn(8, 8, dtype=torch.float64, device=_device())
    results["ops"] = max(float(((a @ w).softmax(-1).sum(0).full_tensor() - (x @ w).softmax(-1).sum(0)).abs().max()),
                         float((a.redistribute(mesh, [Replicate()]).to_local() - x).abs().max()))
    ref = _train(_mlp(), x, y)
    tp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    results["tp"] = _worst(_train(tp, x, y), ref)
    results["fully_shard"] = _worst(_train(fully_shard(_mlp(), mesh=mesh), x, y), ref)
    tp2 = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    results["compiled"] = _worst(_train(tp2, x, y, steps=4, step_fn=sw.compile), _train(_mlp(), x, y, steps=4))
    path = tempfile.mkdtemp()
    checkpoint.save({"model": tp.state_dict()}, checkpoint_id=path)
    fresh = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    target = {"model": fresh.state_dict()}
    checkpoint.load(target, checkpoint_id=path)
    fresh.load_state_dict(target["model"])
    results["checkpoint"] = _worst([_full(p) for p in fresh.parameters()], [_full(p) for p in tp.parameters()])
    results["device"] = str(next(fresh.parameters()).to_local().device)  # type: ignore[operator]
    Path(out).write_text(json.dumps(results))


def test_a_one_rank_mesh_on_the_devices_own_backend_computes_like_plain_tensors(tmp_path: Path) -> None:
    out = tmp_path / "one_rank.json"
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.device.test_on_device import one_rank; " \
           f"one_rank({str(out)!r})"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["backend"] == ("nccl" if DEVICE == "cuda" else "gloo"), results
    assert results["device"].startswith(DEVICE), results
    for what in ("ops", "tp", "fully_shard", "compiled", "checkpoint"):
        assert results[what] <= TOL, (what, results)


# -- two ranks sharing the device ---------------------------------------------------------------

def _redistribute_everywhere() -> float:
    mesh = sw.init_device_mesh(DEVICE, (2,))
    full = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(_device())
    layouts = [Shard(0), Shard(1), Replicate(), Partial()]
    worst = 0.0
    for src in layouts:
        for dst in layouts:
            if dst == Partial():
                continue  # (to Partial is a local reinterpretation; its value is only defined summed)
            d = sw.distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [src]) if src != Partial() else \
                sw.DTensor.from_local(full / 2, mesh, [Partial()])
            worst = max(worst, float((d.redistribute(mesh, [dst]).full_tensor() - full).abs().max()))
    return worst


def _tp_step() -> float:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.init_device_mesh(DEVICE, (2,))
    x, y = _batch()
    tp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return _worst(_train(tp, x, y), _train(_mlp(), x, y))


def _fully_shard_units() -> float:
    from shardwise.fsdp import fully_shard

    mesh = sw.init_device_mesh(DEVICE, (2,))
    x, y = _batch(8)
    torch.manual_seed(0)
    model = nn.Sequential(_mlp(), nn.ReLU(), _mlp())
    ref = nn.Sequential(_mlp(), nn.ReLU(), _mlp())
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank = mesh.get_local_rank()
    mine = _train(model, x.chunk(2)[rank], y.chunk(2)[rank])  # each rank its half: the mean of the two losses
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for _ in range(3):
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _worst(mine, [p.detach() for p in ref.parameters()])


def _pipeline() -> float:
    from shardwise.pipeline import DistributedPipe

    mesh = sw.init_device_mesh(DEVICE, (2,), mesh_dim_names=("pp",))
    x, y = _batch(8)
    ref = _mlp()
    pipe = DistributedPipe(_mlp(), [2, 1], mesh, schedule="1f1b", chunks=4, loss_fn=F.mse_loss, device=_device())
    try:
        mine = _train(pipe, x, y, step_fn=lambda _: lambda p, o, a, b: (p.step(a, b), o.step(), o.zero_grad()))
    finally:
        pipe.close()
    want = _train(ref, x, y)
    held = want[:2] if mesh.get_local_rank() == 0 else want[2:]
    return _worst(mine, held)


def _dry_run_of_the_tp_step() -> int:
    """A dry run knows no device: the same on every one (it runs on meta tensors)."""
    from shardwise.debug import dry_run
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.AbstractMesh((2,), ("tp",))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(6, 8, device="meta")
    report = dry_run(lambda: model(x).sum().backward(), mesh=mesh, ranks=range(2))
    return len(report.rank(0).collectives)


@pytest.mark.parametrize("body", [_redistribute_everywhere, _tp_step, _fully_shard_units, _pipeline],
                         ids=["redistribute", "tp", "fully_shard", "pipeline"])
def test_two_ranks_sharing_the_device_compute_like_one_process(body: Any) -> None:
    for rank, worst in enumerate(run_distributed(body, 2, timeout=300)):
        assert worst <= TOL, (rank, worst)


def test_a_dry_run_of_the_tp_step_sees_its_all_reduce() -> None:
    # the row-parallel output's sum; the input takes no gradient, so its backward sends nothing
    assert run_distributed(_dry_run_of_the_tp_step, 1, timeout=120) == [1]
