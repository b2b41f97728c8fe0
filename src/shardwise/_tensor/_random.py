"""Seeds for placement-invariant random numbers (the generator itself is `shardwise._rng`).

Each draw takes a fresh 63-bit seed from torch's default generator, so `torch.manual_seed`
governs shardwise's random factories as it does torch's: reseeding reproduces, consecutive
draws differ. Seed every rank alike (the SPMD norm); the first draw checks that the
ranks of the mesh agree and raises if they do not. `shardwise.manual_seed(s)` switches to
a private generator seeded with `s` instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _comm as comm
from .._mesh import DeviceMesh

__all__ = ["manual_seed", "next_seed"]

_M32 = 0xFFFFFFFF


class _State:
    checked: bool = False
    generator: Optional[torch.Generator] = None


_STATE = _State()


def manual_seed(seed: int) -> None:
    """Seed shardwise's random factories with a private generator (same seed on every rank)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise ValueError(f"manual_seed takes an int seed in [-2**63, 2**64), got {seed!r}")
    g = torch.Generator()
    g.manual_seed(seed)
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
