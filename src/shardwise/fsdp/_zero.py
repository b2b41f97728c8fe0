"""`data_parallel(shard_parameters=True)` on units: ZeRO-3 by the engine `fully_shard` runs on.

`data_parallel` stores and places its parameters itself (on the whole mesh, values from
the first dp rank, the dp shard on a tensor dim tensor parallelism leaves whole); this
module groups the sharded ones into units and hooks them as `fully_shard` would, without
changing the modules' classes:

| unit | its parameters | gathered |
|---|---|---|
| one per block: each child of the outermost `nn.ModuleList` / `nn.Sequential` on a path from the root that holds parameters | those only the block's modules read | before the block's forward, again before its backward; freed after each |
| the root's | every other one (a parameter modules of two blocks share, as a tied weight) | at the root's forward, kept until the end of backward (freed after a no-grad forward) |

So a step holds about two blocks unsharded at a time, not the whole model, and issues
one all_gather per block per pass and one reduce_scatter per block.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from .._mesh import DeviceMesh
from ._api import attach
from ._param import UnitParam
from ._policy import MixedPrecisionPolicy, OffloadPolicy
from ._state import FSDPState
from ._unit import Unit

__all__ = ["blocks_of", "shard_by_units"]


def blocks_of(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the outermost module lists / sequentials under `module` that hold parameters, with their paths."""
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        container = isinstance(m, (nn.ModuleList, nn.Sequential))
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if container and next(child.parameters(), None) is not None:
                found.append((path, child))
            else:
                walk(path, child)

    walk("", module)
    return found


def shard_by_units(module: nn.Module, mesh: DeviceMesh, dp_dim: int, params: list[UnitParam]) -> FSDPState:
    """Hook `params` (stored already, Shard on mesh dim `dp_dim`) as one unit per block of `module`
    and one at its root; returns the root's state."""
    blocks = blocks_of(module)
    block_of: dict[nn.Module, int] = {}
    for i, (_, block) in enumerate(blocks):
        for sub in block.modules():
            block_of.setdefault(sub, i)
    per_block: list[list[UnitParam]] = [[] for _ in blocks]
    rest: list[UnitParam] = []
    for p in params:
        homes = {block_of.get(owner) for owner, _ in p.owners}
        home: Optional[int] = homes.pop() if len(homes) == 1 else None
        (per_block[home] if home is not None else rest).append(p)
    mp = MixedPrecisionPolicy()

    def unit(name: str, members: list[UnitParam]) -> Optional[Unit]:
        return Unit(name, members, mesh, dp_dim, None, mp, OffloadPolicy()) if members else None

    for (path, block), members in zip(blocks, per_block):
        if members:
            attach(FSDPState([block], unit(path, members), mp, True, True), [block], swap_class=False)
    root = FSDPState([module], unit(type(module).__name__, rest), mp, True, True)
    root.reshard_after_no_grad_forward = True
    attach(root, [module], swap_class=False)
    return root
