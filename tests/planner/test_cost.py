"""`CostModel`: modelled seconds from a dry run's FLOPs and collectives; calibration on real groups."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from shardwise.debug import dry_run
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.planner import CostModel
from shardwise.testing import run_distributed


def test_a_step_costs_its_flops_and_each_collective_by_its_mesh_dims() -> None:
    mesh = sw.AbstractMesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    report = dry_run(lambda m, x: m(x).sum().backward(), model, torch.randn(8, 16), mesh=mesh).ranks[0]
    cost = CostModel(flops_per_second=1e9, default_bandwidth=1e6, bandwidth={"tp": 1e8}, latency=1e-3)
    step = cost.step(report)
    # forward: 2 matmuls of 8 x 16 x 32 (this rank's half of 64); backward: 3 more
    assert step.flops == 5 * 2 * 8 * 16 * 32 and report.flops["forward"] == 2 * 2 * 8 * 16 * 32
    expected = sum(1e-3 + c.bytes / (1e8 if c.mesh_dims == ("tp",) else 1e6) for c in report.collectives)
    assert abs(step.comm_seconds - expected) < 1e-12 and step.collectives == len(report.collectives) > 0
    assert abs(step.seconds - (step.flops / 1e9 + expected)) < 1e-12
    gpu = CostModel.gpu_cluster()
    assert gpu.bandwidth_of(("tp",)) > gpu.bandwidth_of(("dp", "tp")) == gpu.bandwidth_of(("dp",))


def _calibrated() -> list[float]:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    c = CostModel.calibrate(mesh, nbytes=1 << 18, repeats=2)
    return [c.flops_per_second, c.bandwidth["dp"], c.bandwidth["tp"], c.latency]


def test_calibration_measures_each_mesh_dim_and_every_rank_agrees() -> None:
    results = run_distributed(_calibrated, 4)
    assert all(r == results[0] for r in results), results
    flops, dp, tp, latency = results[0]
    assert flops > 1e6 and dp > 1e5 and tp > 1e5 and 0 <= latency < 1.0
