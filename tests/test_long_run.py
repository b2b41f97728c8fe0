"""Long runs do not grow: after warm-up, no new shardwise objects and flat caches over 1,000 steps.

Each loop trains a small MLP on 2 gloo ranks, with an optimizer whose scalars change every
step (AdamW's bias corrections, a cosine learning-rate schedule): tensor parallel with
foreach, fused and for-loop AdamW and momentum SGD, and ZeRO-3 (`fully_shard`) with
foreach AdamW. Between step 300 and the last step, the live objects of shardwise's own
types (counted after `gc.collect()`) and every cache in `shardwise.debug.cache_info()` stay
exactly the same. Before the caches keyed elementwise and optimizer ops by their float
arguments' values, foreach AdamW grew by three plans a step (the benchmark runs 10,000).
"""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.debug import cache_info
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

STEPS, WARM = 1000, 300


def _ours() -> Counter[str]:
    gc.collect()
    found: Counter[str] = Counter()
    for o in gc.get_objects():
        module = getattr(type(o), "__module__", None)  # (a str, except on a few C types)
        if isinstance(module, str) and module.startswith("shardwise"):
            found[type(o).__qualname__] += 1
    return found


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[kind]
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)


def _loop(parallel: str, kind: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("dp" if parallel == "zero3" else "tp",))
    if parallel == "zero3":
        from shardwise.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = _optimizer(kind, model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)  # a new lr every step
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    before: tuple[Counter[str], dict[str, int]] = (Counter(), {})
    for step in range(STEPS):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        schedule.step()
        if step == WARM:
            before = (_ours(), cache_info())
    after = (_ours(), cache_info())
    grown = {name: n for name, n in (after[0] - before[0]).items()}
    return grown, before[1], after[1]


@pytest.mark.parametrize("parallel, kind", [("tp", "foreach"), ("tp", "fused"), ("tp", "for-loop"), ("tp", "sgd"),
                                            ("zero3", "foreach")])
def test_a_long_training_loop_grows_no_objects_and_no_caches(parallel: str, kind: str) -> None:
    for rank, (grown, caches_before, caches_after) in enumerate(run_distributed(_loop, 2, parallel, kind,
                                                                                 timeout=600)):
        assert not grown, f"rank {rank}: shardwise objects made between step {WARM} and {STEPS}: {grown}"
        assert caches_after == caches_before, f"rank {rank}: caches grew: {caches_before} -> {caches_after}"


def _floats_by_type() -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    d = sw.distribute_tensor(x, mesh, [sw.Shard(0)])
    sizes = []
    for v in (2.0, 3.0, -0.5, 1e-8):  # one plan per op, each call with its own value
        torch.testing.assert_close((d * v).full_tensor(), x * v, rtol=0, atol=0)
        torch.testing.assert_close(d.add(d, alpha=v).full_tensor(), x.add(x, alpha=v), rtol=0, atol=0)
        ys, ds = [x.clone(), x.clone() + 1], [d.clone(), d.clone() + 1]
        torch._foreach_mul_(ys, [v, v * 2])
        torch._foreach_mul_(ds, [v, v * 2])
        torch._foreach_addcdiv_(ys, ys, [y + 2 for y in ys], [v, -v])
        torch._foreach_addcdiv_(ds, ds, [t + 2 for t in ds], [v, -v])
        for y, t in zip(ys, ds):
            torch.testing.assert_close(t.full_tensor(), y, rtol=0, atol=0)
        sizes.append(cache_info()["op plans"])
    assert sizes[1:] == sizes[:1] * 3, sizes
    i = sw.distribute_tensor(torch.arange(6), mesh, [sw.Shard(0)])
    assert (i * 2).dtype == torch.int64 and (i * 2.0).dtype == torch.float32


def test_a_float_argument_is_read_at_every_call_while_its_plan_is_cached_by_type() -> None:
    run_distributed(_floats_by_type, 2, timeout=120)
