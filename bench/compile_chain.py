"""Per-op cost of a `shardwise.compile` replay against eager shardwise and eager torch DTensor.

`python -m bench.compile_chain`: a chain of 50 small pointwise ops on 8x8 fp32 split by
rows over mesh (2,) (no communication), timed on every rank in one interleaved loop for
the plain ops on the local tensors, shardwise eager, shardwise compiled (replay) and torch
DTensor eager. Printed: microseconds per op, and per-op overhead over the plain ops (the
slowest rank's median). Results are checked against the plain chain first.

Then a tensor-parallel MLP train step (1024 -> 4096 -> 1024, batch 64, column- then
row-split, SGD with momentum; forward, backward, step and zero_grad inside the function):
shardwise eager, shardwise compiled and torch DTensor eager, milliseconds per step.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from ._common import interleaved, load_average, median

__all__ = ["CHAIN_OPS", "chain", "body", "step_body", "main"]

CHAIN_OPS = 50


def chain(x: Any, y: Any) -> Any:
    """50 ops: add, mul by a scalar, relu, sub, tanh, ten times."""
    for _ in range(CHAIN_OPS // 5):
        x = x + y
        x = x * 0.5
        x = torch.relu(x)
        x = x - y
        x = torch.tanh(x)
    return x


def body(repeats: int, inner: int) -> dict[str, float]:
    """Every rank: seconds per chain call of each contender (median over repeats)."""
    import torch.distributed as dist
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise as sw

    world = dist.get_world_size()
    torch.manual_seed(0)
    a, b = torch.randn(8 * world, 8), torch.randn(8 * world, 8)
    mesh = sw.init_device_mesh("cpu", (world,))
    xs, ys = (sw.distribute_tensor(t, mesh, [sw.Shard(0)]) for t in (a, b))
    tmesh = init_device_mesh("cpu", (world,))
    xt, yt = (tdt.distribute_tensor(t, tmesh, [tdt.Shard(0)]) for t in (a, b))
    compiled = _compile(chain)
    contenders: dict[str, Callable[[], object]] = {
        "plain": functools.partial(chain, xs.to_local(), ys.to_local()),
        "shardwise eager": functools.partial(chain, xs, ys),
        "shardwise replay": functools.partial(compiled, xs, ys),
        "torch eager": functools.partial(chain, xt, yt),
    }
    want = chain(a, b)
    for name in ("shardwise eager", "shardwise replay", "torch eager"):
        for _ in range(3):  # trace, then replay
            got = contenders[name]().full_tensor()  # type: ignore[attr-defined]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    for fn in contenders.values():
        for _ in range(20):
            fn()
    dist.barrier()
    samples = interleaved(contenders, repeats, inner)
    return {name: median(s) or 0.0 for name, s in samples.items()}


def _train(model: Any, opt: Any, x: Any) -> Any:
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def step_body(repeats: int, dims: tuple[int, int, int]) -> dict[str, float]:
    """Every rank: seconds per train step of each contender (median over repeats)."""
    import torch.distributed as dist

    from ._libs import load

    world = dist.get_world_size()
    d, hidden, batch = dims
    contenders: dict[str, Callable[[], object]] = {}
    compiled = _compile(_train)
    for name in ("shardwise", "torch"):
        lib = load(name)
        mesh = lib.mesh((world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d))
        model = lib.parallelize_module(model, mesh, {"0": lib.ColwiseParallel(), "2": lib.RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
        x = torch.randn(batch, d)
        if name == "shardwise":
            contenders["shardwise eager"] = functools.partial(_train, model, opt, x)
            contenders["shardwise compiled"] = functools.partial(compiled, model, opt, x)
        else:
            contenders["torch eager"] = functools.partial(_train, model, opt, x)
    for fn in contenders.values():
        for _ in range(3):
            fn()
    assert compiled.programs() == 1, "the compiled step did not settle on one replayed program"
    dist.barrier()
    samples = interleaved(contenders, repeats, 1, before=dist.barrier)
    return {name: median(s) or 0.0 for name, s in samples.items()}


def _compile(fn: Any) -> Any:
    from shardwise import compile as sw_compile

    return sw_compile(fn)


def main(argv: list[str]) -> int:
    from shardwise.testing import run_distributed

    repeats = int(argv[0]) if argv else 300
    per_rank = run_distributed(body, 2, repeats, 5, timeout=600)
    slowest = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    plain = slowest["plain"]
    print(f"chain of {CHAIN_OPS} ops, 8x8 fp32 local, mesh (2,), load average {load_average()}")
    print(f"{'contender':<18} {'us/op':>8} {'overhead us/op':>15}")
    for name, seconds in slowest.items():
        print(f"{name:<18} {seconds / CHAIN_OPS * 1e6:8.2f} {(seconds - plain) / CHAIN_OPS * 1e6:15.2f}")
    replay, torch_eager = slowest["shardwise replay"] - plain, slowest["torch eager"] - plain
    print(f"replay overhead / torch eager overhead: {replay / torch_eager:.3f}")
    dims = (1024, 4096, 64)
    per_rank = run_distributed(step_body, 2, max(repeats // 20, 5), dims, timeout=600)
    print(f"\nTP MLP train step {dims[0]}->{dims[1]}->{dims[0]}, batch {dims[2]}, SGD momentum, mesh (2,); "
          f"load average {load_average()}")
    for name in per_rank[0]:
        print(f"{name:<20} {max(r[name] for r in per_rank) * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
