"""Stage boundaries between tensor-parallel stages of different sizes: what crosses, and how.

When stage `s` runs on a tp row of `a` ranks and stage `s + 1` on one of `b != a` ranks, a
rank of one has no "matching" rank in the other; a message's tensors then move by the
cross-mesh planner (`_redistribute._cross`) from the sending row to the receiving row:

- a DTensor on the sender's row, in placements `p`, arrives as a DTensor on the receiving
  row in `landing(p)`: the same splits (a Partial is reduced on the sender's row first, as
  cheaply as the planner finds; a strided split arrives plain);
- a plain tensor is the same on every rank of its row (a stage's ops keep it replicated),
  so it moves as Replicate and arrives plain on every receiving rank.

Every receiving rank gets exactly its target piece less nothing (the rows are disjoint),
from the senders the planner deals it to, so replicas share the sending. Both ends plan
from the message's metadata alone, on abstract meshes, so they agree without talking.
`send_across` and `receive_across` are `Wire`'s two ends of such a message.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _comm as comm
from .._layout import contiguous_strides
from .._mesh import AbstractMesh
from .._placement import Partial, Placement, Replicate, Shard, _StridedShard
from .._redistribute import Routes, _volume
from .._spec import DTensorSpec, TensorMeta
from .._tensor import CrossMove, _region, from_local, plan_cross, redistribute_local
from ._channels import Channel
from ._link import Link, never_sent
from ._message import OK, DSlot, box_shape, dtensors_of, fill, leaves, slots_of, wire_view

__all__ = ["Crossing", "crossing", "landing", "receive_across", "send_across", "spec_on"]


def landing(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The placements a DTensor in `placements` arrives in on the next stage's row."""
    return tuple(Replicate() if isinstance(p, Partial) else Shard(p.dim) if isinstance(p, _StridedShard) else p
                 for p in placements)


def spec_on(mesh: AbstractMesh, placements: tuple[Placement, ...], shape: tuple[int, ...], dtype: torch.dtype,
            shard_order: Any = ()) -> DTensorSpec:
    return DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype), shard_order)


class Crossing:
    """One tensor's move from row `src_ranks` to row `dst_ranks`: the plan, and this rank's part."""

    def __init__(self, move: CrossMove, routes: Routes) -> None:
        self.move, self.routes = move, routes

    @property
    def before(self) -> tuple[tuple[Placement, ...], Any]:
        """The layout, on the sending row, in which the tensor crosses (Partials reduced)."""
        return self.move.before.placements, self.move.before.shard_order


@functools.lru_cache(maxsize=4096)
def crossing(shape: tuple[int, ...], dtype: torch.dtype, placements: Optional[tuple[Placement, ...]], shard_order: Any,
             src_ranks: tuple[int, ...], dst_ranks: tuple[int, ...]) -> Crossing:
    """The move of a tensor of `shape` in `placements` (None: a plain tensor) on the row of
    `src_ranks` to the row of `dst_ranks`, planned on abstract meshes (the same on both ends)."""
    src_mesh, dst_mesh = AbstractMesh((len(src_ranks),)), AbstractMesh((len(dst_ranks),))
    given = (Replicate(),) if placements is None else placements
    src = spec_on(src_mesh, given, shape, dtype, shard_order if placements is not None else ())
    dst = spec_on(dst_mesh, landing(given), shape, dtype)
    move = plan_cross(src, src_ranks, dst, dst_ranks)
    return Crossing(move, move.plan.routes(dist.get_rank()))


def send_across(link: Link, tp_mesh: Any, channel: Channel, microbatch: int, value: Any, skeleton: Any,
                tensors: list[Tensor], meta: bytes) -> None:
    """Every rank of the receiving row gets the header and metadata; then each tensor's
    boxes go where the cross-mesh plan sends them (Partials reduced on this row first)."""
    pieces: list[tuple[Tensor, Crossing]] = []
    for slot, t in zip(slots_of(skeleton), tensors):
        if isinstance(slot, DSlot) and tp_mesh is not None:
            dtensor = dtensors_of(value)[slot.k]
            if dtensor.device_mesh != tp_mesh:
                raise TypeError(f"{channel.label(microbatch)} holds a DTensor on {dtensor.device_mesh}, not on the "
                                f"stage's tensor-parallel mesh {tp_mesh}: a stage's outputs live on its "
                                "own tp mesh (redistribute(device_mesh=...) it there first)")
        placements = slot.placements if isinstance(slot, DSlot) else None
        move = crossing(slot.shape if isinstance(slot, DSlot) else tuple(t.shape), t.dtype, placements,
                        slot.shard_order if isinstance(slot, DSlot) else (), channel.src_ranks, channel.dst_ranks)
        if isinstance(slot, DSlot) and move.before != (slot.placements, slot.shard_order):
            placed, order = move.before  # a collective of this row (every rank of it sends alike)
            t = redistribute_local(t, spec_on(tp_mesh, slot.placements, slot.shape, t.dtype, slot.shard_order),
                                   spec_on(tp_mesh, placed, slot.shape, t.dtype, order))
        pieces.append((wire_view(t), move))
    for dst in channel.dst_ranks:
        link.post(channel, microbatch, [OK, len(meta), len(tensors), -1, -1, 0], meta, [], dst=dst, pack=False)
    for piece, move in pieces:
        for peer, box in move.routes.sends:
            if _volume(box):
                link.post(channel, microbatch, None, b"", [_region(piece, box).contiguous()], dst=peer, pack=False)


def receive_across(link: Link, tp_mesh: Any, channel: Channel, microbatch: int, requires_grad: bool) -> Any:
    """Every sending rank's header first (any of them may report a failure), then this
    rank's boxes of each tensor from the senders the cross-mesh plan deals them to."""
    tag, label, device = link.tag(channel, microbatch), channel.label(microbatch), link.device
    skeleton: Any = None
    specs: list[tuple[tuple[int, ...], torch.dtype]] = []
    for src in channel.src_ranks:  # the first failure reported (or a sender gone) stops the wait
        try:
            found = link.header(channel, microbatch, src)
        except comm.P2PError as exc:
            raise never_sent(channel, microbatch, src, exc) from exc
        if skeleton is None:
            skeleton, specs, _, _ = found
    tensors = []
    for slot, (shape, dtype) in zip(slots_of(skeleton), specs):
        placements = slot.placements if isinstance(slot, DSlot) else None
        move = crossing(slot.shape if isinstance(slot, DSlot) else tuple(shape), dtype, placements,
                        slot.shard_order if isinstance(slot, DSlot) else (), channel.src_ranks, channel.dst_ranks)
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        out = torch.empty(move.routes.out_shape, dtype=wire_dtype, device=device)
        works = [(src, box, comm.irecv(torch.empty(box_shape(box), dtype=wire_dtype, device=device), src,
                                       link.group, tag=tag, label=label))
                 for src, box in move.routes.recvs if _volume(box)]
        for src, box, work in works:
            try:
                _region(out, box).copy_(work.wait())
            except comm.P2PError as exc:
                raise never_sent(channel, microbatch, src, exc) from exc
        out = out.view(torch.bool) if dtype == torch.bool else out
        if isinstance(slot, DSlot):
            assert tp_mesh is not None
            out = from_local(out, tp_mesh, landing(slot.placements), shape=slot.shape,
                             stride=contiguous_strides(slot.shape))
        tensors.append(out)
    return leaves(fill(skeleton, tensors), requires_grad)
