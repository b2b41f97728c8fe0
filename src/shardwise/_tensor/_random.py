"""Placement-invariant random numbers: a counter-based generator over global element indices.

Element `k` of the `c`-th random tensor drawn with seed `s` is a hash of `(s, offset_c + k)`,
so every layout of the same call yields the same global tensor, and each rank computes
only the elements it holds. The hash works on 32-bit lanes held in int64 tensors, with
multiplications split so nothing overflows.

Each draw takes a fresh 63-bit seed from torch's default generator, so `torch.manual_seed`
governs shardwise's random factories as it does torch's: reseeding reproduces, consecutive
draws differ. Seed every rank alike (the SPMD norm); the first draw checks that the
ranks of the mesh agree and raises if they do not. `shardwise.manual_seed(s)` switches to
a private generator seeded with `s` instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from .. import _comm as comm
from .._mesh import DeviceMesh

__all__ = ["manual_seed", "next_seed", "uniform_local", "normal_local"]

_M32 = 0xFFFFFFFF


class _State:
    checked: bool = False
    generator: Optional[torch.Generator] = None


_STATE = _State()


def manual_seed(seed: int) -> None:
    """Seed shardwise's random factories with a private generator (same seed on every rank)."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    _STATE.generator = g


def _check_agree(seed: int, mesh: DeviceMesh) -> None:
    if mesh.size() == 1:
        return
    mine = [seed >> 32, seed & _M32]
    rows = comm.gather_over_mesh(mine, mesh.get_all_groups(), mesh.shape)
    if any(r != rows[0] for r in rows):
        ranks = mesh.mesh.flatten().tolist()
        seeds = ", ".join(f"rank {r}: {(a << 32) | b}" for r, (a, b) in zip(ranks, rows))
        raise ValueError(
            f"random DTensor factories need the same torch seed on every rank, but the ranks drew different "
            f"seeds ({seeds}): call torch.manual_seed(s) (or shardwise.manual_seed(s)) with one s on every rank"
        )


def next_seed(mesh: DeviceMesh) -> int:
    """A fresh seed for the next draw, from the generator; checked across ranks once."""
    g = _STATE.generator
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=g).item())
    if not _STATE.checked:
        _check_agree(seed, mesh)
        _STATE.checked = True
    return seed


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
