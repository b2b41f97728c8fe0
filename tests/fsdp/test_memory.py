"""How many units are unsharded at once: about two with the default prefetch, as in FSDP2,
under `fully_shard` and under `data_parallel(shard_parameters=True)` (the same engine).

Sampled at every linear layer's forward and backward in a 16-block model: a block's unit
counts while its unsharded storage is allocated or its gather is in flight. The root
(kept unsharded after forward, as torch keeps it) is not a block and is not counted.
"""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.fsdp._state import state_of
from shardwise.testing import distributed

from .test_fully_shard import Block, Net

DEPTH = 16


def _alive(model: Net) -> int:
    count = 0
    for block in model.blocks:
        state = state_of(block)
        assert state is not None and state.unit is not None
        unit = state.unit
        held = any(p.full is not None and p.full.untyped_storage().nbytes() > 0 for p in unit.params)
        count += bool(held or unit.inflight)
    return count


def _samples(model: Net, x: torch.Tensor) -> list[int]:
    seen: list[int] = []
    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(lambda *_: seen.append(_alive(model))))
            handles.append(m.register_full_backward_pre_hook(lambda *_: seen.append(_alive(model))))
    model(x).square().mean().backward()
    for h in handles:
        h.remove()
    return seen


def _model(reshard: bool | None, zero: bool = False) -> Net:
    torch.manual_seed(0)
    model = Net()
    model.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
    mesh = sw.init_device_mesh("cpu", (4,))
    if zero:
        from shardwise.parallel import data_parallel

        return data_parallel(model, mesh, shard_parameters=True)  # type: ignore[return-value]
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


@distributed(world_size=4)
def test_at_most_two_blocks_are_unsharded_at_once_in_a_16_block_model() -> None:
    x = torch.randn(2, 6)
    model = _model(None)
    first = _samples(model, x)  # the first step learns the forward order: no prefetch yet
    assert max(first) == 1, first
    steady = _samples(model, x)
    assert max(steady) == 2, steady  # this block and the one prefetched
    assert _alive(model) == 0  # everything resharded after backward
    kept = _samples(_model(False), x)  # without resharding every block stays until backward ends
    assert max(kept) == DEPTH, kept


@distributed(world_size=4)
def test_data_parallel_with_sharded_parameters_holds_two_blocks_unsharded_not_the_model() -> None:
    x = torch.randn(2, 6)
    model = _model(None, zero=True)
    assert max(_samples(model, x)) == 1
    assert max(_samples(model, x)) == 2
    assert _alive(model) == 0
    with torch.no_grad():  # the root's unit (the parameters outside the blocks) is freed after a no-grad forward
        model(x)
    root = state_of(model)
    assert root is not None and root.unit is not None and not root.unit.gathered
