"""Memory: peak bytes per rank of the tensor-parallel MLP step, each library on 2 ranks against one process.

Python's tracemalloc cannot see tensors (torch's CPU allocator calls malloc directly), so
the peak comes from the allocator itself: torch's profiler with `profile_memory=True`
records every allocation and free with its size and time, and the running sum of those
over one steady-state step (the optimizer state already exists, gradients were freed by
`zero_grad(set_to_none=True)`) is the step's extra memory. Peak = what is resident when
the step starts (parameters, optimizer state, the batch; counted from the tensors) + the
highest point of that running sum. Buffers gloo allocates itself are not seen.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ._common import Column, Settings, Table, local_bytes, on_first_rank, one_process_world, quiet, ratio
from ._libs import LIBS, load
from .steps import mlp

__all__ = ["peak_allocated", "body", "run"]


def _walk(events: Any) -> Iterator[Any]:
    for e in events:
        yield e
        yield from _walk(e.children)


@contextlib.contextmanager
def _no_stderr() -> Iterator[None]:
    """Mute file descriptor 2: the profiler's C++ side prints a line at every start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_allocated(fn: Callable[[], object]) -> int:
    """Highest net bytes allocated by torch's CPU allocator while `fn` runs (0 if it only frees)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _no_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocations = sorted((e for e in _walk(tree) if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    level = peak = 0
    for e in allocations:
        level += e.extra_fields.alloc_size
        peak = max(peak, level)
    return peak


def body(settings: Settings, who: str) -> dict[str, int]:
    """One rank's bytes for `who` ("plain" on one process, or a library on 2 ranks)."""
    d, hidden, batch = settings.mlp
    torch.manual_seed(0)
    model = mlp(d, hidden)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    if who != "plain":
        lib = load(who)
        model = lib.parallelize_module(copy.deepcopy(model), lib.mesh((2,)),
                                       {"0": lib.ColwiseParallel(), "2": lib.RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

    with quiet():
        step()  # creates the optimizer state
        opt.zero_grad(set_to_none=True)
        params = sum(local_bytes(p) for p in model.parameters())
        state = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        inputs = local_bytes(x) + local_bytes(y)
        extra = peak_allocated(step)
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    return {"params": params, "grads": grads, "optimizer": state, "inputs": inputs, "step_extra": extra,
            "peak": params + state + inputs + extra}


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    d, hidden, batch = settings.mlp
    mib = ".2f"
    table = Table(
        "memory",
        f"memory of the TP MLP step ({d}->{hidden}->{d}, batch {batch}, AdamW), MiB per rank (largest rank)",
        [Column("who", "who"), Column("ranks", "ranks"), Column("params_mib", "params", mib),
         Column("grads_mib", "grads", mib), Column("optimizer_mib", "optim state", mib),
         Column("step_extra_mib", "step extra", mib), Column("peak_mib", "peak", mib),
         Column("vs_single", "peak / 1-process", ".2f"), Column("vs_torch", "peak sw/torch", ".2f")],
    )
    one = run_distributed(on_first_rank, one_process_world(settings), body, settings, "plain", timeout=settings.timeout)
    results = {"plain": one[:1]}
    for name in LIBS:
        results[name] = run_distributed(body, 2, settings, name, timeout=settings.timeout)
    peaks = {k: max(r["peak"] for r in v) for k, v in results.items()}
    for who, per_rank in results.items():
        row: dict[str, Any] = {"who": "1 process" if who == "plain" else who, "ranks": len(per_rank)}
        for key in ("params", "grads", "optimizer", "inputs", "step_extra", "peak"):
            row[key] = max(r[key] for r in per_rank)
            row[f"{key}_mib"] = row[key] / 2**20
        row["vs_single"] = ratio(peaks[who], peaks["plain"])
        row["vs_torch"] = ratio(peaks[who], peaks["torch"]) if who == "shardwise" else None
        table.rows.append(row)
    table.notes.append("step extra: the highest point of allocations minus frees during one steady-state step "
                       "(gradients, activations, temporaries, communication buffers torch allocates); "
                       "peak = params + optimizer state + batch + step extra")
    return [table]
