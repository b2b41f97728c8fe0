"""Data parallel over one mesh dim: replicated parameters with bucketed gradient averaging, or ZeRO-3 sharded ones.

Every dp rank runs the model on its own batch with plain local tensors, as under DDP;
only the parameters are distributed. `data_parallel` stores each parameter as a DTensor
on the *whole* mesh -- `Replicate()` (or, with `shard_parameters=True`, `Shard(k)` on the
first tensor dim `k` that tensor parallelism leaves whole) on the dp dim, the parameter's
tensor-parallel placements on the other dims -- so the optimizer steps DTensors whose
state takes the same layout, and with sharding every rank keeps about 1/dp of
parameters, gradients and optimizer state. A forward pre-hook on each module puts the
module's *compute view* of its parameters in `module.__dict__` (found before
`nn.Module.__getattr__` looks in `_parameters`) for the duration of the forward: the
plain local piece, or a DTensor on the tensor-parallel sub-mesh.

| parameter on the dp dim | forward (compute view) | backward (gradient) |
|---|---|---|
| `Replicate()` | local piece, no communication | local grads kept; at the end of backward one `all_reduce(avg)` per bucket |
| `Shard(k)` | gathered over dp by its unit (below) | its unit's `reduce_scatter(avg)`: `param.grad` is dp-sharded |

Each rank's gradient is that of its own mean loss, so the average over dp is the
gradient of the mean over the whole batch (equal local batch sizes). Replicated
gradients go through the one bucketer (`_comm.all_reduce_coalesced`: buckets of about
`bucket_cap_mb` per dtype) once per backward, as a step of the end-of-backward registry
(`_dp_grads._Reducer`, the registered reducer of those parameters), in a fixed order (last
registered first): the collectives match across ranks even when a rank leaves some
parameters unused (a parameter's gradient stays None only when no rank used it). Gloo runs
collectives synchronously, so buckets are reduced at the end of backward rather than overlapped.

Sharding picks a tensor dim that tensor parallelism does not split, so gathering is one
all_gather of the tensor-parallel piece; a parameter with every dim split by tensor
parallelism (a column-parallel bias) stays replicated on dp. Sharded parameters run on
`fully_shard`'s engine (`fsdp/_zero.py`): one unit per block (each child of the outermost
`nn.ModuleList` / `nn.Sequential`) and one at the root, so a block's parameters are
gathered by one all_gather before its forward, freed after it, gathered again for its
backward and reduced by one reduce_scatter; the next block's gather is prefetched. A step
holds about two blocks unsharded at a time, so the 1/dp saving holds at its peak too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import torch
from torch import nn

from .. import _comm as comm
from .._describe import describe
from .._layout import ShardOrder, contiguous_strides, normalize_shard_order
from .._mesh import DeviceMesh
from .._mesh import DryMesh, as_device_mesh
from .._placement import Partial, Placement, Replicate, Shard, _StridedShard
from .._spec import DTensorSpec, TensorMeta
from .._tensor import (DTensor, GradientReducer, averaged_within_layout, caller_place, deferred, register,
                       unwatch_leaf)
from .._layout import chunk_range
from ..fsdp._param import TensorParallel, UnitParam
from ..fsdp._zero import shard_by_units
from ._dp_grads import _LocalView, _Param, _Reducer
from ._pretrained import adopt_save_pretrained

__all__ = ["data_parallel", "global_mean", "memory_report", "no_sync"]

_STATE_ATTR = "_shardwise_data_parallel"


@dataclass(eq=False)
class _State:
    mesh: DeviceMesh
    dp: int
    params: list[_Param]
    owners: dict[nn.Module, list[tuple[str, _Param]]]
    reducer: _Reducer
    handles: list[Any] = field(default_factory=list)
    units: Any = None  # the root's FSDPState of the sharded parameters' units

    def view(self, p: _Param) -> torch.Tensor:
        """The compute view of replicated `p`: local, then on the tp sub-mesh if it was there."""
        local = _LocalView.apply(p.param, p, self.reducer)  # type: ignore[no-untyped-call]
        if p.tp_mesh is None:
            return local  # type: ignore[no-any-return]
        meta = p.gathered.tensor_meta
        return DTensor.from_local(
            local, p.tp_mesh, p.tp_placements, shape=meta.shape, stride=meta.stride, shard_order=p.tp_order
        )


def data_parallel(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    dp_dim: Optional[Union[int, str]] = None,
    shard_parameters: bool = False,
    bucket_cap_mb: float = 25.0,
) -> nn.Module:
    """Make `module` data parallel over the dp dim of `device_mesh`, in place; returns it.

    `device_mesh` is 1-D (pure data parallel) or n-D with a dp dim (`dp_dim`: a name or
    index; default "dp" when the mesh names one, else 0). Parameters are plain tensors, or
    DTensors on the sub-mesh of the other dims (a tensor-parallel module). Each parameter
    becomes an `nn.Parameter` DTensor on the whole mesh, its values taken from the first dp
    rank; tied parameters stay one. With `shard_parameters=True` (ZeRO-3) a parameter is
    `Shard(k)` on dp for the first tensor dim `k` no tensor-parallel mesh dim splits (dim 0
    of a plain parameter; `Replicate()` when there is none, as for a 0-dim parameter).
    Create the optimizer afterwards. Buffers stay as they are: under data parallel each
    rank's batch norm normalises and tracks its own batch.

    Per step, every dp rank runs forward on its own batch and calls backward on its mean
    loss; the parameters' gradients are then the gradients of the whole batch's mean loss.
    """
    device_mesh, d = _checked(module, device_mesh, dp_dim, bucket_cap_mb)
    made, owners = _placed(module, device_mesh, d, shard_parameters)
    readers: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner, items in owners.items():
        for attr, entry in items:
            owner._parameters[attr] = cast(nn.Parameter, entry.param)
            readers.setdefault(id(entry), []).append((owner, attr))

    params = list(made.values())
    replicated = {o: [(a, e) for a, e in items if not e.sharded] for o, items in owners.items()}
    reducer = _reducer(params, device_mesh, d, bucket_cap_mb)
    register(reducer)
    for p in reducer.params:  # it sets their gradients in their layout: the layout step leaves them alone
        unwatch_leaf(p.param)
    state = _State(device_mesh, d, params, {o: items for o, items in replicated.items() if items}, reducer)
    for owner, items in state.owners.items():
        state.handles.append(owner.register_forward_pre_hook(_make_pre_hook(state, items), prepend=True))
        state.handles.append(owner.register_forward_hook(_make_post_hook(items), always_call=True))
    sharded = [_unit_param(p, readers[id(p)], device_mesh, d) for p in params if p.sharded]
    if sharded:
        state.units = shard_by_units(module, device_mesh, d, sharded)  # (its units register themselves)
    object.__setattr__(module, _STATE_ATTR, state)
    adopt_save_pretrained(module)
    return module


def _checked(module: nn.Module, device_mesh: Any, dp_dim: Optional[Union[int, str]], bucket_cap_mb: float
             ) -> tuple[DeviceMesh, int]:
    """The mesh and the dp mesh dim index, after checking the arguments."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"data_parallel takes an nn.Module, got {describe(module)}")
    device_mesh = as_device_mesh(device_mesh)
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a DeviceMesh, got {describe(device_mesh)}: use shardwise.init_device_mesh"
        )
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a positive number of megabytes (default 25.0)")
    if hasattr(module, _STATE_ATTR):
        raise ValueError(f"{type(module).__name__} is already data parallel: call data_parallel once per module")
    if dp_dim is None:
        names = device_mesh.mesh_dim_names
        dp_dim = "dp" if names is not None and "dp" in names else 0
    d = device_mesh.mesh_dim_index(dp_dim)
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"this rank is not part of {device_mesh!r}: build the mesh over the ranks that train")
    return device_mesh, d


def _placed(module: nn.Module, device_mesh: DeviceMesh, d: int, shard_parameters: bool
            ) -> tuple[dict[int, _Param], dict[nn.Module, list[tuple[str, _Param]]]]:
    """Every parameter stored on the whole mesh (tied ones once), and where each is read."""
    tp_mesh = _rest_mesh(device_mesh, d)
    problems: list[str] = []
    made: dict[int, _Param] = {}
    owners: dict[nn.Module, list[tuple[str, _Param]]] = {}
    averaged = averaged_within_layout(device_mesh.ranks_along(d))  # e.g. experts under token dispatch
    for prefix, owner in module.named_modules():
        for attr, p in owner._parameters.items():
            if p is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if id(p) in averaged:
                continue  # whole experts per dp rank, averaged by their token dispatch: left as they are
            if id(p) not in made:
                entry = _store(name, p, device_mesh, d, tp_mesh, shard_parameters, problems)
                if entry is None:
                    continue
                made[id(p)] = entry
            owners.setdefault(owner, []).append((attr, made[id(p)]))
    if problems:
        raise ValueError("data_parallel cannot place these parameters:\n  - " + "\n  - ".join(problems))
    return made, owners


def _reducer(params: list[_Param], mesh: DeviceMesh, d: int, bucket_cap_mb: float) -> _Reducer:
    """The reducer of the replicated parameters that need gradients (last registered first)."""
    reduced = [p for p in reversed(params) if not p.sharded and p.param.requires_grad]
    names = mesh.mesh_dim_names
    record = GradientReducer("data_parallel", "replicas", "avg", mesh.ranks_along(d),
                             f"mesh dim {names[d]!r}" if names else f"mesh dim {d}", caller_place(), sets_grad=True)
    return _Reducer(reduced, mesh.get_group(d), mesh.size(d), int(bucket_cap_mb * 2**20), record)


def _unit_param(p: _Param, owners: list[tuple[nn.Module, str]], mesh: DeviceMesh, d: int) -> UnitParam:
    """The unit's record of sharded `p`: its dp shard dim, the piece a dp gather gives back, the tp layout."""
    k = cast(Shard, p.param._spec.placements[d]).dim
    n = mesh.size(d)
    sizes = tuple(chunk_range(p.piece_shape[k], n, q)[1] for q in range(n))
    tp = TensorParallel(p.tp_mesh, p.tp_placements, p.tp_order, p.gathered.tensor_meta) if p.tp_mesh is not None else None
    made = UnitParam(p.name, owners, k, p.piece_shape, sizes, tp)
    assert made.shape_on(mesh.get_local_rank(d)) == tuple(p.param._local_tensor.shape), (made, p.param._spec)
    return made


def _rest_mesh(mesh: DeviceMesh, d: int) -> Optional[DeviceMesh]:
    """The sub-mesh of every dim but `d` that holds this rank (None for a 1-D mesh)."""
    rest = [i for i in range(mesh.ndim) if i != d]
    if not rest:
        return None
    if mesh.mesh_dim_names is not None:
        return mesh[tuple(mesh.mesh_dim_names[i] for i in rest)]
    if isinstance(mesh, DryMesh):
        return mesh.sub(rest)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # checked by the caller
    index: list[Any] = [slice(None) if i != d else coordinate[d] for i in range(mesh.ndim)]
    groups = mesh.get_all_groups()
    return DeviceMesh(mesh.device_type, mesh.mesh[tuple(index)], _groups=tuple(groups[i] for i in rest))


def _store(
    name: str, p: torch.Tensor, mesh: DeviceMesh, d: int, tp_mesh: Optional[DeviceMesh], shard: bool, problems: list[str]
) -> Optional[_Param]:
    """The whole-mesh DTensor parameter for `p` (values from the first dp rank), or None after noting a problem."""
    rest = [i for i in range(mesh.ndim) if i != d]
    if isinstance(p, DTensor):
        if tp_mesh is None or p.device_mesh != tp_mesh:
            where = "plain tensors (the mesh is 1-D)" if tp_mesh is None else f"DTensors on {tp_mesh!r}"
            problems.append(
                f"{name} is a DTensor on {p.device_mesh!r}, but data parallel over mesh dim {d} of {mesh!r} needs "
                f"{where}: distribute it on the sub-mesh of the non-dp dims, or pass a plain tensor"
            )
            return None
        if p._spec.has_partial():
            problems.append(
                f"{name} has placements {p._spec.layout_str()}: a parameter cannot be Partial; redistribute it to Replicate()"
            )
            return None
        local, meta = p._local_tensor, p._spec.tensor_meta
        tp_placements: tuple[Placement, ...] = p.placements
        tp_orders = {t: tuple(rest[m] for m in ms) for t, ms in p._spec.split_orders().items()}
    else:
        local = p.detach()
        meta = TensorMeta(p.shape, contiguous_strides(p.shape), p.dtype)
        tp_placements = (Replicate(),) * len(rest)
        tp_orders = {}
    piece_shape = tuple(local.shape)  # what a gather over dp gives back
    # dp shards the first tensor dim that tensor parallel leaves whole, so the gather is one all_gather.
    split = set(tp_orders) | {q.dim for q in tp_placements if isinstance(q, _StridedShard)}
    free = [t for t in range(p.ndim) if t not in split]
    sharded = shard and bool(free)
    gathered_pl = list(tp_placements)
    gathered_pl.insert(d, Replicate())
    stored_pl = list(gathered_pl)
    if sharded:
        stored_pl[d] = Shard(free[0])
    gathered = DTensorSpec(mesh, tuple(gathered_pl), meta, normalize_shard_order(gathered_pl, tp_orders, p.ndim))
    grad_pl = list(gathered_pl)
    grad_pl[d] = Partial("avg")
    grad_spec = DTensorSpec(mesh, tuple(grad_pl), meta, gathered.shard_order)
    with torch.no_grad():
        local = local.contiguous().clone()
        if mesh.size(d) > 1:
            local = comm.broadcast(local, mesh.get_group(d), mesh.size(d), mesh.ranks_along(d)[0])
        stored = DTensor(local, gathered, requires_grad=False)
        if sharded:
            stored = stored.redistribute(placements=stored_pl, shard_order=gathered.shard_order)
            stored = DTensor(stored._local_tensor.clone(), stored._spec, requires_grad=False)
    was_tp = isinstance(p, DTensor)
    return _Param(
        name,
        cast(DTensor, nn.Parameter(stored, requires_grad=p.requires_grad)),
        sharded,
        gathered,
        grad_spec,
        tp_mesh if was_tp else None,
        tp_placements if was_tp else (),
        p._spec.shard_order if isinstance(p, DTensor) else (),
        piece_shape,
    )


def _make_pre_hook(state: _State, items: list[tuple[str, _Param]]) -> Any:
    def hook(owner: nn.Module, args: Any) -> None:
        for attr, p in items:
            owner.__dict__[attr] = state.view(p)

    return hook


def _make_post_hook(items: list[tuple[str, _Param]]) -> Any:
    def hook(owner: nn.Module, args: Any, output: Any) -> None:
        for attr, _ in items:
            owner.__dict__.pop(attr, None)

    return hook


def _state_of(module: nn.Module) -> _State:
    state = getattr(module, _STATE_ATTR, None)
    if not isinstance(state, _State):
        raise ValueError(f"{type(module).__name__} is not data parallel: pass the module data_parallel returned")
    return state


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside the block keep gradients unreduced; the next one outside reduces the sum.

    For gradient accumulation over micro-batches with one reduction per step. Under
    `data_parallel`, replicated gradients stay local and the next backward averages them;
    sharded parameters' gradients are still reduce-scattered on every backward (keeping
    them unsharded would cost what sharding saves). For any other DTensor parameter of
    `module`, its Partial gradient (a replicated weight on a split batch) stays Partial
    inside the block, instead of being reduced at the end of every backward.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_sync takes the data-parallel (or sharded) nn.Module, got {describe(module)}")
    state = getattr(module, _STATE_ATTR, None)
    reducer = state.reducer if isinstance(state, _State) else None
    params = [p for p in module.parameters() if isinstance(p, DTensor)]
    if reducer is None and not params:
        raise ValueError(
            f"no_sync({type(module).__name__}): the module has no DTensor parameters and is not data parallel, "
            f"so there is nothing to keep unreduced; shard it first (data_parallel, parallelize_module)"
        )
    before = reducer.sync if reducer is not None else True
    if reducer is not None:
        reducer.sync = False
    try:
        with deferred(params):
            yield
    finally:
        if reducer is not None:
            reducer.sync = before


def memory_report(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, and the same for the unsharded model.

    Keys: `parameters`, `gradients`, `optimizer_state`, `total` (local pieces held by this
    rank) and `unsharded_parameters`, `unsharded_gradients`, `unsharded_optimizer_state`,
    `unsharded_total` (the global tensors, as one device would hold them).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"memory_report takes an nn.Module, got {describe(module)}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memory_report takes a torch.optim.Optimizer (or None), got {describe(optimizer)}")
    params = list({id(p): p for p in module.parameters()}.values())
    grads = [p.grad for p in params if p.grad is not None]
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for entry in optimizer.state.values():
            state.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
    report: dict[str, int] = {}
    for key, tensors in (("parameters", params), ("gradients", grads), ("optimizer_state", state)):
        report[key] = sum(_local(t).numel() * t.element_size() for t in tensors)
        report["unsharded_" + key] = sum(t.numel() * t.element_size() for t in tensors)
    report["total"] = report["parameters"] + report["gradients"] + report["optimizer_state"]
    report["unsharded_total"] = (
        report["unsharded_parameters"] + report["unsharded_gradients"] + report["unsharded_optimizer_state"]
    )
    return report


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def global_mean(value: Union[torch.Tensor, DTensor], mesh: DeviceMesh, dp_dim: Optional[Union[int, str]] = None) -> torch.Tensor:
    """The mean over the data-parallel ranks of a per-rank value (each dp rank's loss is the mean
    over its own samples): a plain tensor, the same on every rank, for logging.

    A DTensor (a loss from tensor-parallel layers, laid out over the other mesh dims) is made
    whole first. `dp_dim` as for `data_parallel` (default "dp" when the mesh names one, else 0).
    Detached: not for backward. With equal batches per dp rank this is the loss
    of the whole global batch.
    """
    mesh = as_device_mesh(mesh)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"global_mean needs the DeviceMesh the value lives on, got {describe(mesh)}")
    names = mesh.mesh_dim_names
    dim = mesh.mesh_dim_index(dp_dim if dp_dim is not None else "dp" if names is not None and "dp" in names else 0)
    local = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
    return comm.all_reduce(local.clone(), mesh.get_group(dim), mesh.size(dim), "avg", (dim,))
