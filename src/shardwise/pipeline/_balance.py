"""Automatic balance: profile each layer of an `nn.Sequential`, then cut it into partitions.

A pipeline runs as fast as its slowest stage and fits only if its largest stage fits,
so the balance (layers per partition) should even out time or memory. Both profilers
run every layer on a deep copy in train mode (the model, its gradients, its train flag
and the RNG are left as they were), then a block-partition solver picks contiguous
blocks that minimise the largest block's cost, exactly (it tries every cut).

`balance_by_size` measures on any device, CPU included: a layer costs its parameter
bytes times `param_scale` (optimizer state: about 2-3 for SGD with momentum, 4-5 for
Adam) plus the bytes of the activations it saves for backward on one micro-batch, seen
through `torch.autograd.graph.saved_tensors_hooks` rather than a CUDA allocator counter.

>>> balance_cost([1, 2, 3, 4, 5, 6], 2)
[4, 2]
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._describe import describe
from ._microbatch import Batch, BatchValue, check, scatter
from ._stream import as_device

__all__ = ["balance_by_time", "balance_by_size", "balance_cost"]

_HINT = "balance_by_time and balance_by_size split an nn.Sequential into `partitions` contiguous blocks"


def balance_cost(cost: Sequence[float], partitions: int) -> list[int]:
    """The balance (layers per partition) whose largest block of `cost` is smallest; ties
    go to the most even costs, then the most even layer counts."""
    if isinstance(cost, (str, bytes)) or not isinstance(cost, Sequence) or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < math.inf for c in cost
    ):
        raise ValueError(f"cost must be a sequence of finite, non-negative numbers (one per layer), got {describe(cost)}")
    _check_partitions(partitions, len(cost), f"cost sequence {describe(cost)}")
    return _block_partition([float(c) for c in cost], partitions)


def balance_by_time(partitions: int, module: nn.Sequential, sample: BatchValue, *, timeout: float = 1.0,
                    device: torch.device | str = "cpu") -> list[int]:
    """Balance by the time each layer takes for forward and backward on `sample`, repeated
    until `timeout` seconds have passed (at least once), summed per layer."""
    _check_module(partitions, module)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds >= 0 (profiling repeats until then)")
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient: balancing runs backward on copies of the "
                         "layers and must start from none; call module.zero_grad(set_to_none=True) first")
    times = _profile_times(module, sample, timeout, as_device(device, "device"))
    return _block_partition(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: BatchValue, *, chunks: int = 1,
                    param_scale: float = 2.0, device: torch.device | str = "cpu") -> list[int]:
    """Balance by memory: per layer, parameter bytes * `param_scale` plus the bytes of the
    activations it saves for backward on one micro-batch of `input` split into `chunks`."""
    _check_module(partitions, module)
    if isinstance(param_scale, bool) or not isinstance(param_scale, (int, float)) or not 0 <= param_scale < math.inf:
        raise ValueError(f"param_scale must be a finite number >= 0 (parameters plus optimizer state per parameter "
                         f"byte), got {param_scale!r}")
    sizes = _profile_sizes(module, input, chunks, param_scale, as_device(device, "device"))
    return _block_partition(sizes, partitions)


def _profile_times(module: nn.Sequential, sample: BatchValue, timeout: float, device: torch.device) -> list[float]:
    start_batch = _to_device(sample, device)
    totals = [0.0] * len(module)
    began = time.perf_counter()
    with torch.random.fork_rng(devices=_rng_devices(device)):
        while True:
            batch = start_batch
            for i, layer in enumerate(_sandbox(module, device)):
                batch = _detached(batch)
                _sync(device)
                tick = time.perf_counter()
                batch = batch.call(layer)
                outputs = tuple(t for t in batch.tensors if t.requires_grad)
                if outputs:
                    torch.autograd.backward(outputs, tuple(torch.ones_like(t) for t in outputs))
                _sync(device)
                totals[i] += time.perf_counter() - tick
            if time.perf_counter() - began >= timeout:
                return totals


def _profile_sizes(module: nn.Sequential, input: BatchValue, chunks: int, param_scale: float,
                   device: torch.device) -> list[float]:
    batch = scatter(input, chunks)[0]  # one micro-batch, as a stage will see it
    batch = _to_device(batch.value, device)
    sizes = []
    with torch.random.fork_rng(devices=_rng_devices(device)):
        for layer in _sandbox(module, device):
            batch = _detached(batch)
            params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                      for p in list(layer.parameters()) + list(layer.buffers())}
            saved: dict[int, int] = {}

            def pack(t: Tensor) -> Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    saved[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                batch = batch.call(layer)
            param_bytes = sum(p.untyped_storage().nbytes() for p in layer.parameters())
            sizes.append(sum(saved.values()) + param_bytes * param_scale)
    return sizes


def _sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Fresh copies of the layers, on `device`, in train mode; the originals stay untouched."""
    for layer in module:
        layer_copy = copy.deepcopy(layer).to(device)
        layer_copy.train()
        yield layer_copy


def _to_device(value: BatchValue, device: torch.device) -> Batch:
    check(value)
    batch = Batch(value)
    # a copy, so a micro-batch (a view of the whole input) does not count the whole input's storage
    batch[:] = [v.detach().to(device, copy=True).requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v
                for v in batch.values]
    return batch


def _detached(batch: Batch) -> Batch:
    """The same values cut from the graph of the previous layer (keeping requires_grad),
    so each layer is profiled on its own."""
    values: list[Any] = [v.detach().requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v
                         for v in batch.values]
    out = Batch(batch.value)
    out[:] = values
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def _check_module(partitions: int, module: nn.Module) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {describe(module)}: {_HINT}")
    _check_partitions(partitions, len(module), "module")


def _check_partitions(partitions: int, length: int, what: str) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be a positive integer, got {partitions!r}: {_HINT}")
    if length < partitions:
        raise ValueError(f"{what} is shorter than intended partitions ({length} < {partitions}): every "
                         f"partition needs at least one layer; use at most {length} partitions")


def _block_partition(cost: Sequence[float], k: int) -> list[int]:
    """Exact: first the smallest possible largest block over every cut into `k` non-empty
    contiguous blocks (dynamic programming over prefixes, O(k n^2)), then among the cuts
    that reach it the least sum of squared block costs, then of squared block lengths."""
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def block(a: int, b: int) -> float:  # cost of layers [a, b)
        return prefix[b] - prefix[a]

    inf = float("inf")
    # best[j][i]: smallest largest block over cuts of the first i layers into j blocks
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            best[j][i] = min(max(best[j - 1][t], block(t, i)) for t in range(j - 1, i))
    limit = best[k][n]
    # among cuts with every block <= limit, the least (sum cost^2, sum length^2)
    score: list[list[tuple[float, int] | None]] = [[None] * (n + 1) for _ in range(k + 1)]
    choice = [[0] * (n + 1) for _ in range(k + 1)]
    score[0][0] = (0.0, 0)
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for t in range(j - 1, i):
                prev = score[j - 1][t]
                if prev is None or block(t, i) > limit:
                    continue
                cand = (prev[0] + block(t, i) * block(t, i), prev[1] + (i - t) ** 2)  # not **: 1e300 ** 2 raises
                current = score[j][i]
                if current is None or cand < current:
                    score[j][i], choice[j][i] = cand, t
    sizes, i = [], n
    for j in range(k, 0, -1):
        t = choice[j][i]
        sizes.append(i - t)
        i = t
    return sizes[::-1]
