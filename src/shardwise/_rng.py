"""Placement-invariant random numbers: a counter-based generator over global element indices.

Element `k` of a draw with seed `s` is a hash of `(s, base + k)`, `k` its row-major index in
the global tensor, so every layout of the same draw yields the same global tensor and each
rank computes only the elements it holds (`uniform_local`, `normal_local` take the piece's
shape and offset). The hash works on 32-bit lanes held in int64 tensors, with
multiplications split so nothing overflows. Pure: seeds come from the caller
(`shardwise._tensor._random` draws them, the same on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["uniform_local", "normal_local"]

_M32 = 0xFFFFFFFF


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    return int(_mix(torch.tensor([x & _M32], dtype=torch.int64)).item())


def _global_indices(local_shape: Sequence[int], offset: Sequence[int], global_shape: Sequence[int]) -> torch.Tensor:
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        r = torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64) * stride
        idx = idx + r.view([-1] + [1] * (len(global_shape) - 1 - d))
        stride *= global_shape[d]
    return idx.expand(tuple(local_shape)) if local_shape else idx


def _bits(index: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    k1 = _mix_int(seed ^ (stream * 0x9E3779B9))
    k2 = _mix_int((seed >> 32) ^ _mix_int(stream + 0x632BE5AB))
    return _mix(_mix((index & _M32) ^ k1) ^ ((index >> 32) ^ k2))


def _unit(index: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """Uniform float64 in [0, 1) with 53 random bits."""
    a = _bits(index, seed, 2 * stream) >> 5  # 27 bits
    b = _bits(index, seed, 2 * stream + 1) >> 6  # 26 bits
    return (a.to(torch.float64) * 67108864.0 + b.to(torch.float64)) * (1.0 / 9007199254740992.0)


def uniform_local(
    local_shape: Sequence[int], offset: Sequence[int], global_shape: Sequence[int], seed: int, base: int, dtype: torch.dtype
) -> torch.Tensor:
    index = _global_indices(local_shape, offset, global_shape) + base
    return _unit(index, seed, 0).to(dtype)


def normal_local(
    local_shape: Sequence[int], offset: Sequence[int], global_shape: Sequence[int], seed: int, base: int, dtype: torch.dtype
) -> torch.Tensor:
    index = _global_indices(local_shape, offset, global_shape) + base
    u1, u2 = _unit(index, seed, 1), _unit(index, seed, 2)
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos((2.0 * math.pi) * u2)).to(dtype)
