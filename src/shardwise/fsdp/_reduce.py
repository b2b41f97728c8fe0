"""A unit's gradients: packed rank by rank, reduce-scattered, handed to the stored parameters.

`reduce` packs every parameter's gradient so that rank q's pieces of all of them lie side by
side, and starts one `ReduceScatter` per dtype bucket that leaves each rank the sum of its own
pieces (while gradient sync is off it only sums the unsharded gradients for later). The
returned `Reduction`s are finished by the unit's root (`Root.finish_reductions`): on an HSDP
mesh one `all_reduce` over the replicate dim follows, then the sum, divided, becomes (or is
added to) each stored parameter's `.grad`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .. import _comm as comm
from .._placement import Placement, Replicate
from .._tensor import DTensor
from ._param import UnitParam, packing

if TYPE_CHECKING:
    from ._unit import Unit

__all__ = ["Reduction", "reduce"]


@dataclass(eq=False)
class Reduction:
    """A started reduce_scatter of one unit's gradients; `finish()` gives them to the parameters."""

    unit: Unit
    params: list[UnitParam]
    started: comm.Started
    starts: list[int]  # this rank's start of each parameter's piece

    def finish(self) -> None:
        unit = self.unit
        mine = self.started.result()
        r = unit.rank
        if unit.replicate_group is not None:
            for p, at in zip(self.params, self.starts):  # sums kept while the all_reduce was off
                if p.partial is not None:
                    mine.narrow(0, at, p.numel_on(r)).add_(p.partial.reshape(-1))
                    p.partial = None
            if not unit.all_reduce:
                for p, at in zip(self.params, self.starts):
                    p.partial = mine.narrow(0, at, p.numel_on(r))
                return
            mine = comm.all_reduce(mine, unit.replicate_group, unit.replicate_size, "sum", ())
        mine.div_(unit.divide_factor)
        for p, at in zip(self.params, self.starts):
            piece = mine.narrow(0, at, p.numel_on(r)).view(p.shape_on(r))
            stored = p.param
            local = stored._local_tensor
            if piece.dtype != local.dtype or piece.device != local.device:
                piece = piece.to(device=local.device, dtype=local.dtype)
            if stored.grad is None:
                stored.grad = DTensor(piece, stored._spec, requires_grad=False)
            else:
                stored.grad._local_tensor.add_(piece)  # type: ignore[attr-defined]


def reduce(unit: Unit, params: list[UnitParam], grads: Sequence[Optional[torch.Tensor]]) -> list[Reduction]:
    """Start the reduce_scatter of `unit`'s `grads` (one per param, None when unused), or keep them
    unsharded while gradient sync is off."""
    grads = [_piece(p, g) for p, g in zip(params, grads)]
    if not unit.sync:
        for p, g in zip(params, grads):
            if g is not None:
                p.unsynced = g.clone() if p.unsynced is None else p.unsynced.add_(g)
        return []
    out = []
    for bucket in unit.buckets:
        members = [(p, g) for p, g in zip(params, grads) if p in bucket]
        if not members:
            continue
        chosen = [p for p, _ in members]
        dtype = unit.mp.reduce_dtype or unit.mp.param_dtype or chosen[0].param.dtype
        totals, starts = packing(chosen, unit.size)
        packed = torch.empty(sum(totals), dtype=dtype, device=unit.device)
        ranks = torch.split(packed, list(totals))
        for i, (p, g) in enumerate(members):
            if p.unsynced is not None:
                g = p.unsynced if g is None else p.unsynced.add_(g)
                p.unsynced = None
            pieces = p.split(g) if g is not None else [None] * unit.size
            for q, piece in enumerate(pieces):
                slot = ranks[q].narrow(0, starts[q][i], p.numel_on(q)).view(p.shape_on(q))
                slot.zero_() if piece is None else slot.copy_(piece)
        collective = comm.ReduceScatter(group=unit.group, size=unit.size, shape=(sum(totals),), dtype=dtype,
                                        tensor_dim=0, pieces=totals, index=unit.rank, op="sum",
                                        mesh_dims=(unit.shard_dim,), donated=True)
        out.append(Reduction(unit, chosen, comm.start(collective, packed), starts[unit.rank]))
    return out


def _piece(p: UnitParam, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The gradient as the plain piece the unit gathered: a DTensor gradient (a plain parameter's
    that met tensor-parallel activations, or a tp parameter's in another layout) is laid out as
    the parameter's tp placements first (Replicate() for a plain parameter)."""
    if not isinstance(grad, DTensor):
        return grad
    if p.tp is None:
        placements: tuple[Placement, ...] = (Replicate(),) * grad.device_mesh.ndim
        if grad.placements != placements:
            grad = grad.redistribute(placements=placements)
    elif grad.placements != p.tp.placements or grad.shard_order != p.tp.shard_order:
        grad = grad.redistribute(p.tp.mesh, p.tp.placements, shard_order=p.tp.shard_order)
    return grad._local_tensor
