"""A unit: the parameters of one `fully_shard` call, gathered by one collective and reduced by one.

Each rank packs its pieces of the unit's parameters one after another into one flat
buffer; one `AllGather` over the shard mesh dim brings every rank's buffer (uneven
lengths padded by the collective); each parameter's unsharded tensor is then cut out of
it along its shard dim. In backward the gradients are packed rank by rank (rank q's
pieces of every parameter, then rank q+1's) so one `ReduceScatter` leaves each rank the
sum of its own pieces; on an HSDP mesh one `all_reduce` over the replicate dim follows.

| step | collective (per unit, per dtype) | memory |
|---|---|---|
| unshard (forward, or backward after a reshard) | all_gather of the packed pieces | + the unsharded unit |
| reshard | none | the unsharded storage freed (`resize_(0)`): the tensors stay, so autograd's saved views see the next gather |
| reduce | reduce_scatter (+ all_reduce on replicate) | + one packed gradient buffer |

Which of these the parameters are in is one `UnitState` (`_lifecycle`: SHARDED, GATHERING,
UNSHARDED, SHARDED_POST_FORWARD), moved by the table there; an in-flight gather is a `_Gather`
record that knows the group it reads from.

The forward computes with views of the unsharded tensors made by one autograd function per
unit (`_UnitGrad`), whose backward receives every parameter's gradient at once: that is
the moment the unit's backward is over, so the reduction starts there. Each unit is the
registered reducer of its parameters in the end-of-backward registry (`_tensor/_end_of_backward.py`):
a style that would reduce them again is refused, and `shardwise.debug.gradient_reducers` names it.

An explicit `FSDPModule.unshard()` (`request`) also registers the unsharded parameters on
the modules once the gather is done, as torch's FSDP2 does, so a program can read whole
weights between steps; every reshard (explicit, after forward, after backward, before a
`state_dict()` save or load) registers the stored sharded parameters again. The forward
still computes with the views above (they shadow the registered parameter), so gradients
reach the reduction the same way whether the unit was gathered by a forward or by the user.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from .. import _comm as comm
from .._memory_events import memory_changed
from .._mesh import DeviceMesh
from .._compat import resize_storage_bytes_
from .._compile import mark_persistent
from .._tensor import DTensor, GradientReducer, caller_place, register
from ._lifecycle import PARAMS, TransitionError, UnitState, advance
from ._param import UnitParam, packing
from ._policy import MixedPrecisionPolicy, OffloadPolicy
from ._reduce import Reduction, reduce

__all__ = ["Unit"]


def _resize(t: torch.Tensor, nbytes: int) -> None:
    """Resize `t`'s storage in place, as a dispatched op: a trace (`shardwise.compile`) records
    it, where `untyped_storage().resize_` would be invisible and its replay would write into
    freed memory."""
    resize_storage_bytes_(t, nbytes)


@dataclass
class _Gather:
    """An all_gather of a unit in flight: the group it reads, and whether the pieces are the small
    group's kept ones (reshard_after_forward=int, cut as torch.chunk) or the stored shards."""

    source: tuple[Any, int, int]  # (group, size, this rank's index)
    small: bool
    started: list[tuple[list[UnitParam], comm.Started]]


class _UnitGrad(torch.autograd.Function):
    """Views of a unit's unsharded tensors; backward hands all their gradients to the unit at once."""

    @staticmethod
    def forward(ctx: Any, unit: Unit, tracked: list[UnitParam], token: torch.Tensor,
                *fulls: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.tracked = unit, tracked
        ctx.set_materialize_grads(False)
        return tuple(f.view_as(f) for f in fulls)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        ctx.unit.on_backward(ctx.tracked, grads)
        return (None, None, None) + (None,) * len(grads)


class _Reducer:
    """A unit as the end-of-backward registry sees it: the reducer of its parameters (it reduces
    them in its own backward; its root finishes the reductions in the registry's `units` phase)."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

    def gradient_reducer(self) -> GradientReducer:
        unit = self.unit
        op = "reduce_scatter" + (" + all_reduce" if unit.replicate_group is not None else "")
        op += ", avg" if unit.divide_factor == unit.size * unit.replicate_size else f", sum / {unit.divide_factor:g}"
        names = unit.mesh.mesh_dim_names
        over = f"mesh dims {names}" if names else f"a mesh of shape {tuple(unit.mesh.shape)}"
        ranks = tuple(int(r) for r in unit.mesh.mesh.flatten().tolist())
        return GradientReducer(unit.registrant, "replicas", op, ranks, over, unit.where, sets_grad=True)

    def reduced_params(self) -> list[tuple[str, torch.Tensor]]:
        """The stored parameters, and the unsharded ones while an explicit unshard registers them."""
        params = self.unit.params
        out: list[tuple[str, torch.Tensor]] = [(p.name, p.param) for p in params]
        return out + [(p.name, p.unsharded) for p in params if p.sharded is not None and p.unsharded is not None]


class Unit:
    """The parameters of one `fully_shard` call and their collectives."""

    def __init__(self, name: str, params: list[UnitParam], mesh: DeviceMesh, shard_dim: int,
                 replicate_dim: Optional[int], mp: MixedPrecisionPolicy, offload: OffloadPolicy) -> None:
        self.name = name
        self.params = params
        self.mesh, self.shard_dim = mesh, shard_dim
        self.group, self.size, self.rank = mesh.get_group(shard_dim), mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
        self.replicate_group = mesh.get_group(replicate_dim) if replicate_dim is not None else None
        self.replicate_size = mesh.size(replicate_dim) if replicate_dim is not None else 1
        self.divide_factor = float(self.size * self.replicate_size)
        self.mp, self.offload = mp, offload
        self.device = torch.device(mesh.device_type) if mesh.device_type == "cpu" else _current(mesh.device_type)
        self.sync = True  # set_requires_gradient_sync
        self.all_reduce = True  # set_requires_all_reduce (HSDP)
        self.state = UnitState.SHARDED
        self._gathering: Optional[_Gather] = None  # while GATHERING
        self.requested = False  # an explicit unshard(): register the unsharded parameters until a reshard
        self.hooked = False  # the state_dict hooks of `request` are in place
        # reshard_after_forward=int: the smaller group each rank keeps its piece over between forward and backward
        self.small: Optional[tuple[Any, int, int]] = None  # (group, size, this rank's index)
        self.on_backward: Any = None  # the state's post-backward, called with the unit's gradients
        self.token = torch.empty(0, requires_grad=True)  # makes the views require grad
        by_dtype: dict[torch.dtype, list[UnitParam]] = {}
        for p in params:
            by_dtype.setdefault(p.param.dtype, []).append(p)
        self.buckets = list(by_dtype.values())
        self.registrant = f"fully_shard unit {name!r}"  # (data_parallel's ZeRO-3 units too: the same engine)
        self.where = caller_place()
        self.reducer = _Reducer(self)
        register(self.reducer)  # the reducer of its parameters, for the end-of-backward registry

    # -- state --------------------------------------------------------------------------
    def _move(self, call: str, gathering: Optional[_Gather] = None) -> None:
        """Take the state `call` leads to (`_lifecycle.PARAMS`); `gathering` is the gather in flight."""
        self.state = advance(self.registrant, PARAMS, self.state, call)
        self._gathering = gathering if self.state is UnitState.GATHERING else None

    @property
    def gathered(self) -> bool:
        """Every parameter's unsharded tensor is filled."""
        return self.state is UnitState.UNSHARDED

    @property
    def inflight(self) -> list[tuple[list[UnitParam], comm.Started]]:
        """The all_gathers in flight (one per dtype), none unless GATHERING."""
        return self._gathering.started if self._gathering is not None else []

    # -- gather ---------------------------------------------------------------------------
    def gather_dtype(self, p: UnitParam) -> torch.dtype:
        return self.mp.param_dtype or p.param.dtype

    def start_gather(self) -> None:
        """Issue this unit's all_gather (one per dtype) without waiting; no-op when gathered or issued."""
        if self.state in (UnitState.GATHERING, UnitState.UNSHARDED):
            return
        small = self.state is UnitState.SHARDED_POST_FORWARD
        source = (self.group, self.size, self.rank)
        if small:
            assert self.small is not None  # (only reshard_to_small_group, which checks it, gets here)
            source = self.small
        group, size, rank = source
        started: list[tuple[list[UnitParam], comm.Started]] = []
        for bucket in self.buckets:
            dtype = self.gather_dtype(bucket[0])
            totals, _ = packing(bucket, size, small)
            # this rank's pieces are written straight into its block of the output (FSDP2's
            # copy-in): no send buffer lives while the gather is in flight
            biggest = max(totals)
            flat = torch.empty(size * biggest, dtype=dtype, device=self.device)
            at = rank * biggest
            with torch.no_grad():
                for p in bucket:
                    piece = p.kept if small else p.param._local_tensor
                    assert piece is not None
                    flat.narrow(0, at, piece.numel()).copy_(piece.reshape(-1), non_blocking=True)
                    at += piece.numel()
            collective = comm.AllGather(group=group, size=size, shape=(totals[rank],), dtype=dtype, tensor_dim=0,
                                        pieces=totals, mesh_dims=(self.shard_dim,), in_place=True, index=rank)
            started.append((bucket, comm.start(collective, flat)))
        self._move("start_gather", _Gather(source, small, started))
        memory_changed(self)  # gathering: a dry run's memory tracker counts the buffers as the unit's

    def unshard(self) -> None:
        """Every parameter's unsharded tensor filled (waiting for a prefetch if one is in flight),
        and registered on the modules when the user asked for it (`request`)."""
        if self.state is not UnitState.UNSHARDED:
            self._gather()
        if self.requested:
            for p in self.params:
                p.register_unsharded()

    def _gather(self) -> None:
        self.start_gather()
        gathering = self._gathering
        assert gathering is not None
        _, size, _ = gathering.source
        for bucket, started in gathering.started:
            flat = started.result()
            totals, starts = packing(bucket, size, gathering.small)
            ranks = torch.split(flat, list(totals))
            with torch.no_grad():
                for i, p in enumerate(bucket):
                    shapes = [p.piece(size, q)[2] if gathering.small else p.shape_on(q) for q in range(size)]
                    pieces = [ranks[q].narrow(0, starts[q][i], math.prod(shapes[q])).view(shapes[q])
                              for q in range(size)]
                    full = self._storage_for(p, flat.dtype, flat.device)
                    with _unsafe_preserve_version_counter(full):
                        torch.cat(pieces, dim=p.dim, out=full)
        self._move("unshard")
        memory_changed(self)  # filled: what a dry run's memory tracker counts as the unit's
        if gathering.small:
            for p in self.params:
                p.kept = None

    def reshard_to_small_group(self) -> None:
        """Keep this rank's piece of the small group (reshard_after_forward=int) and free the rest."""
        if self.small is None:
            raise TransitionError(f"{self.registrant}: reshard_to_small_group in parameters {self.state.name}: the "
                                  f"unit has no small group (fully_shard(reshard_after_forward=int) makes one)")
        self._unregister()
        if self.state is UnitState.GATHERING:
            self.unshard()
        if self.state is not UnitState.UNSHARDED:
            self._move("reshard_to_small_group")  # SHARDED or SHARDED_POST_FORWARD: nothing to free
            return
        _, size, index = self.small
        for p in self.params:
            assert p.full is not None
            start, length, _ = p.piece(size, index)
            p.kept = p.full.narrow(p.dim, start, length).clone(memory_format=torch.contiguous_format)
        self._free()
        self._move("reshard_to_small_group")
        memory_changed(self)  # freed in place: a dry run's memory tracker counts them as gone

    def _storage_for(self, p: UnitParam, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The unsharded tensor to gather into, where the gather landed (meta in a dry run)."""
        full = p.full
        if full is None or full.dtype != dtype or full.device != device:
            full = p.full = mark_persistent(torch.empty(p.full_shape, dtype=dtype, device=device))
            p.unsharded = None  # it aliased the old tensor
        else:
            _resize(full, full.numel() * full.element_size())
        return full

    def reshard(self) -> None:
        """Free the unsharded storage (the tensors stay for the next gather) and register the
        stored sharded parameters again where an explicit unshard registered unsharded ones."""
        self._unregister()
        if self.state is UnitState.GATHERING:  # a prefetch nobody used: wait for it so its buffers can go
            self.unshard()
        for p in self.params:
            p.kept = None
        if self.state is not UnitState.UNSHARDED:
            self._move("reshard")
            return
        self._free()
        self._move("reshard")
        memory_changed(self)  # freed in place: a dry run's memory tracker counts them as gone

    def abandon(self) -> None:
        """Forget a failed step: an in-flight gather is dropped unwaited, unsynced gradients too,
        and every unsharded storage is freed, whatever the state."""
        self._unregister()
        for p in self.params:
            p.unsynced = None
            p.kept = None
        self._free()
        self._move("abandon")
        memory_changed(self)

    def _free(self) -> None:
        for p in self.params:
            if p.full is not None:
                _resize(p.full, 0)

    # -- explicit unshard -----------------------------------------------------------------
    def request(self) -> None:
        """`FSDPModule.unshard()`: register the unsharded parameters once gathered (now, when
        the unit is), until the next reshard. Issues no collective: the caller gathers."""
        self.requested = True
        if not self.hooked:
            self.hooked = True
            for owner in {id(o): o for p in self.params for o, _ in p.owners}.values():
                # as torch's FSDP2: a state_dict save or load of the module reshards first, so it
                # sees (and loads into) the stored sharded parameters, and the next gather reads them
                owner.register_state_dict_pre_hook(self._before_state_dict)  # type: ignore[no-untyped-call]
                owner.register_load_state_dict_pre_hook(self._before_state_dict)  # type: ignore[no-untyped-call]
        if self.state is UnitState.UNSHARDED:
            self.unshard()

    @property
    def registered_unsharded(self) -> bool:
        return any(p.sharded is not None for p in self.params)

    def _before_state_dict(self, *args: Any) -> None:
        if self.registered_unsharded:
            self.reshard()

    def _unregister(self) -> None:
        self.requested = False
        for p in self.params:
            p.register_sharded()

    # -- compute views --------------------------------------------------------------------
    def views(self) -> list[torch.Tensor]:
        """What the forward computes with, per parameter: a view of its unsharded tensor (made
        a DTensor on the tp mesh where it was one), tracked for backward when it needs a gradient."""
        self._move("views")  # (UNSHARDED only)
        outs: list[torch.Tensor] = [p.full for p in self.params]  # type: ignore[misc]
        if torch.is_grad_enabled():
            tracked = [i for i, p in enumerate(self.params) if p.param.requires_grad]
            if tracked:
                made = _UnitGrad.apply(self, [self.params[i] for i in tracked], self.token,  # type: ignore[no-untyped-call]
                                       *(outs[i] for i in tracked))
                for i, view in zip(tracked, made):
                    outs[i] = view
        for i, p in enumerate(self.params):
            if p.tp is not None:
                meta = p.tp.meta
                outs[i] = DTensor.from_local(outs[i], p.tp.mesh, p.tp.placements, shape=meta.shape,
                                             stride=meta.stride, shard_order=p.tp.shard_order)
        return outs

    # -- reduce ---------------------------------------------------------------------------
    def reduce(self, params: list[UnitParam], grads: Sequence[Optional[torch.Tensor]]) -> list[Reduction]:
        """Start the reduce_scatter of `grads` (one per param, None when unused), or keep them
        unsharded while gradient sync is off (`_reduce.reduce`)."""
        return reduce(self, params, grads)


def _current(device_type: str) -> torch.device:
    module = getattr(torch, device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(device_type, index)

