"""Gradients after a pipeline step: parameters shared across stages summed, then averaged over dp.

Shared parameters (embeddings tied to the LM head) are found by identity before any stage is
sharded; each pp rank holding one keeps its own copy. Copies on stages of one tp width sum
their gradients piece by piece (one all_reduce per set of holders, in a group of just those
ranks); copies on stages of different widths are split differently, so their holders swap
gradients across meshes (`_crossing`) and each sums every holder's term in pp order. Then
each rank's gradients are averaged over dp, bucketed (under ZeRO-3 data parallel has done
that in backward already).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch.distributed as dist
from torch import Tensor, nn

from .. import _comm as comm
from .._mesh import collective_timeout
from .._mesh_dry import DryGroup, simulated_rank
from .._placement import Replicate
from .._tensor import DTensor, from_local
from ._topology import Topology
from ._wire import Channel, PipelineError, RemoteFailure

if TYPE_CHECKING:
    from ._runtime import DistributedPipe

__all__ = ["Shared", "check_shared", "reduce_gradients", "shared_across_ranks", "shared_groups",
           "sum_shared_gradients"]


def sum_shared_gradients(self: DistributedPipe) -> None:
    """A parameter that stages on several pp ranks share (tied embeddings) gets the sum of
    their gradients on each of them, so every copy steps alike."""
    for k, shared in enumerate(self._shared):
        if shared.across:
            _sum_across(self, k, shared)
        if shared.group is None:
            continue
        grads = [p.grad for p in shared.params]
        try:  # a tensor-parallel copy's piece, with the same piece of the other copies
            summed = comm.all_reduce_coalesced([_piece(g) for g in grads], shared.group, len(shared.holders),
                                               "sum", templates=[_local(p) for p in shared.params],
                                               bucket_bytes=int(self.bucket_cap_mb * 2**20))
        except RuntimeError as exc:
            raise PipelineError(
                f"rank {self.rank}: summing the gradients of {shared.names} over the pp ranks "
                f"{list(shared.holders)} that share them failed ({exc}): one of them probably failed") from exc
        for p, g, piece in zip(shared.params, grads, summed):
            if piece is not None:
                p.grad = _like(piece.clone(), g if g is not None else p)

def _sum_across(self: DistributedPipe, k: int, shared: Shared) -> None:
    """Shared parameters whose holders' tp rows differ in width: each holder sends its
    gradients to every other by the cross-mesh planner (landing split as they are split
    here), brings what it receives into its own copy's layout, and sums every holder's
    term in pp order, so every copy gets the same sum."""
    me, pp = self.pp_rank, self.topology.pp
    if me not in shared.holders:
        return
    wire, m = self._wire, self.schedule.num_microbatches
    names = ", ".join(shared.names)

    def channel(src: int, dst: int) -> Channel:  # numbered past the step's channels, the same everywhere
        index = wire.num_channels + (k * pp + src) * pp + dst
        rows = self.topology.row(src), self.topology.row(dst)
        return Channel(index, "shared gradient", src, dst, rows[0][0], rows[1][0], names, rows[0], rows[1])

    own = tuple(_settled(p.grad, p) for p in shared.params)
    terms: dict[int, tuple[Any, ...]] = {me: own}
    try:
        for h in shared.holders:
            if h != me:
                wire.send(channel(me, h), m, own)
        for h in shared.holders:
            if h != me:
                received = wire.receive(channel(h, me), m, requires_grad=False)
                terms[h] = tuple(_into(g, p) for g, p in zip(received, shared.params))
        wire.finish()
    except (RemoteFailure, comm.P2PError) as exc:
        self._give_up(str(exc))
        raise PipelineError(f"rank {self.rank}: summing the gradients of {names} with the stages on pp indices "
                            f"{list(shared.holders)} that share them failed ({exc}): one of them probably "
                            "failed") from exc
    for j, p in enumerate(shared.params):
        total = None
        for h in shared.holders:  # in pp order on every holder: the same sum everywhere
            g = terms[h][j]
            total = g if total is None else total if g is None else total + g
        p.grad = total

def reduce_gradients(self: DistributedPipe) -> None:
    """Average this rank's gradients over dp: one all_reduce per bucket of about `bucket_cap_mb`
    (under `shard_parameters`, data parallel has reduced them in backward already)."""
    if self._dp_group is None or self._dp_size == 1 or self.shard_parameters:
        return
    params = [p for p in self.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    try:  # a tensor-parallel parameter's piece is averaged with the same piece of the other replicas
        averaged = comm.all_reduce_coalesced([_piece(g) for g in grads], self._dp_group, self._dp_size, "avg",
                                             templates=[_local(p) for p in params],
                                             bucket_bytes=int(self.bucket_cap_mb * 2**20))
    except RuntimeError as exc:
        raise PipelineError(
            f"rank {self.rank}: averaging gradients over {self.dp_dim!r} failed ({exc}): a rank of another "
            "data-parallel replica probably failed in this step") from exc
    for p, g, piece in zip(params, grads, averaged):
        if piece is not None:
            p.grad = _like(piece.clone(), g if g is not None else p)


def sum_cp_gradients(self: DistributedPipe) -> None:
    """Sum this rank's gradients over cp (each cp rank computed its own tokens' share): one
    all_reduce per bucket of about `bucket_cap_mb`."""
    cp = self._cp
    if cp is None or cp.size == 1:
        return
    params = [p for p in self.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    try:
        summed = comm.all_reduce_coalesced([_piece(g) for g in grads], cp.group, cp.size, "sum",
                                           templates=[_local(p) for p in params],
                                           bucket_bytes=int(self.bucket_cap_mb * 2**20))
    except RuntimeError as exc:
        raise PipelineError(f"rank {self.rank}: summing gradients over {self.cp_dim!r} failed ({exc}): a rank of "
                            "another cp piece probably failed in this step") from exc
    for p, g, piece in zip(params, grads, summed):
        if piece is not None:
            p.grad = _like(piece.clone(), g if g is not None else p)


def whole_loss(self: DistributedPipe, loss: Tensor) -> Tensor:
    """The step's loss over the whole sequences: this cp rank's share summed with the others'."""
    cp = self._cp
    if cp is None or cp.size == 1:
        return loss
    record = comm.AllReduce(group=cp.group, size=cp.size, shape=tuple(loss.shape), dtype=loss.dtype, op="sum",
                            mesh_dims=(cp.mesh_dim,))
    return comm.run(record, loss.detach())


def _settled(grad: Optional[Tensor], param: Tensor) -> Optional[Tensor]:
    """`grad` in its parameter's layout (a Partial gradient reduced)."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _into(value: Any, param: Tensor) -> Optional[Tensor]:
    """A gradient that arrived from another mesh, in `param`'s layout here."""
    if not isinstance(value, Tensor):
        return None
    if isinstance(param, DTensor):
        if not isinstance(value, DTensor):  # a whole gradient: this rank's piece of it
            value = from_local(value, param.device_mesh, tuple(Replicate() for _ in param.placements))
        moved: Tensor = value.redistribute(param.device_mesh, param.placements)
        return moved
    whole: Tensor = value.full_tensor() if isinstance(value, DTensor) else value
    return whole


def _piece(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(piece: Tensor, ref: Tensor) -> Tensor:
    """`piece` as `ref` is: a DTensor of its layout when `ref` is one."""
    if not isinstance(ref, DTensor):
        return piece
    return from_local(piece, ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride(),
                      shard_order=ref.shard_order)


class Shared(NamedTuple):
    holders: tuple[int, ...]  # the pp indices whose stages use these parameters
    names: list[str]  # as "stage.parameter", for errors
    group: Any  # this rank's pp slice's group of the holders, None when this rank holds none
    params: list[nn.Parameter]  # this rank's (empty when it holds none)
    across: bool = False  # the holders' tp rows differ in width: summed by crossing meshes


def shared_across_ranks(partitions: Sequence[nn.Module], stage_rank: Callable[[int], int]
                         ) -> list[tuple[tuple[int, ...], str, dict[int, str]]]:
    """(pp indices, name, its name in each stage that uses it) of every trainable parameter
    that stages on different pp ranks use (found by identity, so before any stage is sharded)."""
    seen: dict[int, tuple[str, list[int], dict[int, str]]] = {}
    for j, part in enumerate(partitions):
        for name, p in part.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                _, holders, where = seen.setdefault(id(p), (f"{j}.{name}", [], {}))
                where.setdefault(j, name)
                if stage_rank(j) not in holders:
                    holders.append(stage_rank(j))
    return [(tuple(sorted(holders)), name, where) for name, holders, where in seen.values() if len(holders) > 1]


def check_shared(topology: Topology, shared: list[tuple[tuple[int, ...], str, dict[int, str]]],
                  shard_parameters: bool) -> None:
    """ValueError for a parameter shared by ZeRO-3 stages whose tp rows differ in width (their
    copies are split over (dp, tp) differently; plain tp stages sum them across meshes)."""
    for holders, name, _ in shared:
        widths = [len(topology.grids[h][0]) for h in holders]
        if len(set(widths)) > 1 and shard_parameters:
            stage, inner = name.split(".", 1)
            raise ValueError(f"parameter {inner} of stage {stage} is shared by stages on pp indices {list(holders)}, "
                             f"whose tp rows have {widths} ranks: under shard_parameters=True a shared (tied) "
                             "parameter needs stages of one tp width, so that each copy's piece sums with the same "
                             "piece of the others; untie it, give those stages meshes of one tp size, or leave "
                             "shard_parameters off")


def shared_groups(topology: Topology, shared: list[tuple[tuple[int, ...], str, dict[int, str]]],
                   local: nn.ModuleDict, device_type: str) -> list[Shared]:
    """One process group per set of pp ranks sharing parameters, for every (dp, tp) coordinate
    (every process creates them all, in the same order, as `new_group` requires)."""
    by_holders: dict[tuple[int, ...], list[tuple[str, Optional[nn.Parameter]]]] = {}
    for holders, name, where in shared:  # this rank's copy: by its name in a stage it holds
        here = [local[str(j)].get_parameter(n) for j, n in where.items() if str(j) in local]
        by_holders.setdefault(holders, []).append((name, here[0] if here else None))
    backend = "nccl" if device_type == "cuda" else None
    out = []
    for holders, entries in by_holders.items():
        widths = [len(topology.grids[h][0]) for h in holders]
        params = [p for _, p in entries if p is not None]
        if len(set(widths)) > 1:  # no piece lines up with another: summed across meshes, no group
            out.append(Shared(holders, [name for name, _ in entries], None, params, True))
            continue
        group = None
        rows = [[grid[d][t] for grid in (topology.grids[h] for h in holders)]
                for d in range(len(topology.grids[0])) for t in range(widths[0])]
        for ranks in rows:
            if device_type == "meta":  # a dry run's pipe: the holders' label, no process group
                if simulated_rank() in ranks:
                    group = DryGroup(((len(ranks),), ("pp",)), (0,), len(ranks))
                continue
            made = dist.new_group(ranks, timeout=collective_timeout(), backend=backend)
            if dist.get_rank() in ranks:
                group = made
        out.append(Shared(holders, [name for name, _ in entries], group if params else None, params))
    return out
