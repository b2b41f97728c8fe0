"""A dry run's memory report of a `fully_shard` model: each unit unsharded only from its gather
to its reshard, and named by its module path.

A unit frees its unsharded parameters with `resize_(0)`, so their storages never die: a
tracker that waits for a storage's death counted every unit as unsharded until the end of
the step, the whole model at once, which is what sharding by units avoids. The real run
(tests/fsdp/test_memory.py) holds one block at a time in the first step (the forward order
is not known yet, so nothing is prefetched) and two from the second on (the one computing
and the one prefetched), besides the root, which stays unsharded from its forward to its
backward.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.debug import dry_run
from shardwise.debug._report import CATEGORIES
from shardwise.fsdp import fully_shard

WIDTH, DEPTH, BATCH, RANKS = 64, 8, 128, 4
LINEAR = (WIDTH * WIDTH + WIDTH) * 4  # bytes of one unsharded Linear(64, 64), float32
BLOCK, ROOT = 2 * LINEAR, LINEAR  # a block's unit (two Linears), the root's (the head)
SHARDED = (2 * DEPTH + 1) * LINEAR // RANKS  # this rank's pieces of every parameter
ACTIVATION = BATCH * WIDTH * 4  # one (BATCH, WIDTH) float32 activation
UNITS = ["", *(f"layers.{i}" for i in range(DEPTH))]  # in the order first gathered: the root first


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # type: ignore[no-any-return]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]


def _sharded() -> tuple[Stack, torch.optim.Optimizer, sw.AbstractMesh]:
    mesh = sw.AbstractMesh((RANKS,), ("dp",))
    with torch.device("meta"):
        model = Stack()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def _dry(steps: int, ranks: Any = None) -> tuple[Any, Stack, torch.optim.Optimizer]:
    model, opt, mesh = _sharded()
    return dry_run(_steps, model, opt, torch.randn(BATCH, WIDTH), steps, mesh=mesh, ranks=ranks), model, opt


def _blocks_at_peak(units: dict[str, int]) -> list[str]:
    return [path for path, n in units.items() if n and path]


def _held_after(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's pieces of the parameters, their gradients and the optimizer state."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.ndim]
    local = [t._local_tensor if isinstance(t, sw.DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def test_a_dry_run_counted_every_fully_shard_unit_as_unsharded_until_the_end_of_the_step() -> None:
    # the regression: the peak was the sharded state plus the whole model unsharded (9 units)
    report, model, opt = _dry(steps=2)
    memory = report.memory
    held = _held_after(model, opt)
    activations = (2 * DEPTH + 4) * ACTIVATION  # saved: each block's input and ReLU output; the head's in and out
    assert memory.peak <= held + ROOT + 3 * BLOCK + activations, (memory.peak, held, memory.at_peak)
    assert memory.peak >= held - memory.at_peak["gradients"] + ROOT + BLOCK  # the backward: a block gathered


def test_a_dry_run_reports_at_most_two_blocks_unsharded_at_the_peak_as_a_real_run_holds() -> None:
    first, _, _ = _dry(steps=1)  # nothing prefetched while the forward order is learnt: one block
    assert _blocks_at_peak(first.memory.units) == ["layers.7"], first.memory.units
    steady, _, _ = _dry(steps=2)  # the block computing and the one prefetched (its gather buffer)
    assert _blocks_at_peak(steady.memory.units) == ["layers.6", "layers.7"], steady.memory.units
    assert steady.memory.units_unsharded_at_peak == 3  # and the root, unsharded until its backward
    assert steady.memory.peaks["unsharded"] == ROOT + 2 * BLOCK
    assert steady.memory.peaks["parameters"] == SHARDED  # the pieces alone, as in a real run's parameters


def test_a_dry_run_memory_report_names_every_fully_shard_unit_by_its_module_path() -> None:
    report, _, _ = _dry(steps=2, ranks=[0, 3])  # each simulated rank follows its own units
    for rank in report.ranks:
        units = rank.memory.units
        assert list(units) == UNITS, units
        assert units == {**dict.fromkeys(UNITS, 0), "": ROOT, "layers.6": BLOCK, "layers.7": BLOCK}, rank.rank
        assert rank.memory.modules["layers.7"]["unsharded"] == BLOCK  # the unit's row: its unsharded bytes
        assert rank.memory.modules["layers.7.fc1"]["parameters"] == LINEAR // RANKS  # a piece's row: the piece
    text = str(report)
    assert "fsdp units unsharded at the peak: 3 of 9: (model) 16.2 KiB, layers.6 32.5 KiB, layers.7 32.5 KiB" in text
    assert re.search(r"\n  layers\.7 +0 B +0 B +0 B +0 B +32\.5 KiB ", text), text  # params .. activ., unshard.


def test_a_dry_run_of_a_program_without_fully_shard_reports_no_units() -> None:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.AbstractMesh((RANKS,), ("tp",))
    with torch.device("meta"):
        model = Block()
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = dry_run(_steps, model, opt, torch.randn(BATCH, WIDTH), 1, mesh=mesh)
    assert report.memory.units == {} and report.memory.units_unsharded_at_peak == 0
    assert tuple(report.memory.at_peak) == CATEGORIES == tuple(report.memory.peaks)  # no unsharded category
    assert "fsdp units" not in str(report) and "unshard" not in str(report)
