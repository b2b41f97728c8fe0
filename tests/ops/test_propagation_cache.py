"""The propagation cache, mixed plain/DTensor inputs and replicated-by-design ops, on real ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise._ops import strategy_calls
from shardwise.testing import distributed

from ..dist_helpers import seeded


@distributed(world_size=4)
def test_a_repeated_op_calls_no_strategy_function_after_the_first() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = sw.distribute_tensor(seeded(8, 6), mesh, [Shard(0), Shard(1)])
    w = sw.distribute_tensor(seeded(6, 4, seed=1), mesh, [Replicate(), Shard(0)])
    ((x * 2).relu() @ w).sum()  # warm: every op's strategy runs once
    before = strategy_calls()
    for _ in range(5):
        ((x * 2).relu() @ w).sum()
    assert strategy_calls() == before  # cache hits only: no strategy function ran again


@distributed(world_size=4)
def test_data_dependent_ops_run_replicated_by_design_without_a_warning() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    full = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0], [0.0, 0.0, 4.0], [5.0, 0.0, 0.0], [0.0, 6.0, 0.0]])
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    sw.set_strict(True)  # by design, not a missing strategy: strict mode lets them run
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            nz = torch.nonzero(x)
            picked = torch.masked_select(x, x > 1)
            total = x.sum().item()
    finally:
        sw.set_strict(False)
    torch.testing.assert_close(nz.full_tensor(), torch.nonzero(full))
    torch.testing.assert_close(picked.full_tensor(), torch.masked_select(full, full > 1))
    assert total == pytest.approx(float(full.sum()))
