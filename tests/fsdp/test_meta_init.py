"""A model built on the meta device, `fully_shard`, then `to_empty` + its own init: each rank
materialises only its shards (placement-invariant random numbers: the same global weights on
any mesh), and it trains as one process started from those weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.testing import distributed

from .test_fully_shard import ROWS, Block, Net, _batches, _full, _train


def _peak_allocated(fn: Any) -> int:
    """Highest net bytes torch's CPU allocator handed out while `fn` ran (profiler events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append(e)
    level = peak = 0
    for e in sorted(events, key=lambda e: e.start_time_ns):
        level += e.extra_fields.alloc_size
        peak = max(peak, level)
    return peak


def _materialised(mesh_shape: tuple[int, ...], depth: int = 4) -> tuple[Net, int]:
    with torch.device("meta"):
        model = Net()
        model.blocks = nn.ModuleList(Block() for _ in range(depth))
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(p._local_tensor.is_meta for p in model.parameters())

    def materialise() -> None:
        model.to_empty(device="cpu")
        torch.manual_seed(7)  # (governs shardwise's draws; sw.manual_seed would switch the process for good)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()

    return model, _peak_allocated(materialise)


@distributed(world_size=4)
def test_meta_model_materialises_only_each_ranks_shards_and_trains_as_one_process() -> None:
    import torch.distributed as dist

    model, peak = _materialised((4,), depth=16)
    shards = sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    unit = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    assert peak <= shards + 2 * unit, (peak, shards, unit, whole)  # never the whole model
    assert peak < whole / 2

    # the same global weights on another mesh (and so the same for any number of ranks)
    other, _ = _materialised((2, 2), depth=16)
    for (name, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(_full(p), _full(q)), name
    assert _full(model.blocks[3].fc1.weight).std() > 0  # really drawn, not left empty

    # trains as one process started from those weights
    small, _ = _materialised((4,))
    one = Net().double()
    with torch.no_grad():
        for (_, p), (_, q) in zip(small.named_parameters(), one.named_parameters()):
            q.copy_(_full(p))
    small.double()
    rank = dist.get_rank()
    batches = _batches(4, torch.float64)
    _train(one, batches, slice(None))
    _train(small, batches, slice(rank * ROWS, (rank + 1) * ROWS))
    for (name, p), (_, r) in zip(small.named_parameters(), one.named_parameters()):
        torch.testing.assert_close(_full(p), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")
