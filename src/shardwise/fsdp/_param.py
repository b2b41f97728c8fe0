"""One parameter of a unit: how `fully_shard` stores it and the piece the unit gathers back.

A parameter is stored as an `nn.Parameter` DTensor whose piece on the shard mesh dim is a
`torch.chunk` piece of tensor dim `k` (default 0; earlier ranks get the larger pieces,
trailing ranks may hold none). A plain parameter lives on the `fully_shard` mesh:
`(Shard(k),)`, or `(Replicate(), Shard(k))` on an HSDP mesh. A parameter that tensor
parallelism made a DTensor on a sibling sub-mesh (torchtitan's 2-D recipe: tp first, then
`fully_shard` on dp) lives on the mesh of both, its tp placements kept; where tp splits
dim `k` too, tp splits first and dp splits tp's piece, so gathering over dp gives back
exactly the tp piece the forward computes with.

| parameter given | stored as (mesh dims: dp-replicate?, dp-shard, tp...) | the unit gathers |
|---|---|---|
| plain, shape G | `S(k)` on dp | G, plain |
| DTensor on tp, piece L | `S(k)` on dp + tp placements, split order tp then dp | L, made a DTensor on tp again |

After an explicit `FSDPModule.unshard()` the modules hold, as torch's FSDP2 has them, the
unsharded parameter instead (`register_unsharded`): a plain `nn.Parameter` of G, or of L made
a DTensor on tp, that aliases the unit's gathered storage, so it costs no memory and needs
no copy. `register_sharded` puts the stored parameter back: the object the optimizer holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._layout import ShardOrder, chunk_range, contiguous_strides, normalize_shard_order
from .._mesh import DeviceMesh
from .._placement import Placement, Replicate, Shard, _StridedShard
from .._spec import DTensorSpec, TensorMeta
from .._tensor import DTensor

__all__ = ["TensorParallel", "UnitParam", "packing", "place", "register"]


@dataclass(frozen=True)
class TensorParallel:
    """How the gathered piece becomes the tensor-parallel DTensor the forward computes with."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shard_order: ShardOrder
    meta: TensorMeta


@dataclass(eq=False, repr=False)
class UnitParam:
    """A stored parameter, where modules read it, and the unsharded tensor the unit gathers into."""

    def __repr__(self) -> str:  # (never the tensors: a freed unsharded tensor has no storage to print)
        return f"UnitParam({self.name!r}, full_shape={self.full_shape}, dim={self.dim}, sizes={self.sizes})"

    name: str
    owners: list[tuple[nn.Module, str]]  # (module, attribute) of every place it is registered
    dim: int  # the tensor dim dp splits
    full_shape: tuple[int, ...]  # what one dp group gathers (the tp piece, or the whole parameter)
    sizes: tuple[int, ...]  # each shard rank's length along `dim`
    tp: Optional[TensorParallel]
    full: Optional[torch.Tensor] = None  # the unsharded tensor; its storage is freed, not the tensor
    unsynced: Optional[torch.Tensor] = None  # unsharded gradient summed while gradient sync is off
    partial: Optional[torch.Tensor] = None  # HSDP: this rank's reduce-scattered sum, not yet all-reduced
    kept: Optional[torch.Tensor] = None  # reshard_after_forward=int: this rank's piece of the smaller group
    unsharded: Optional[nn.Parameter] = None  # what `register_unsharded` registers: an alias of `full`
    sharded: Optional[nn.Parameter] = None  # the stored parameter while `unsharded` is registered in its place

    @property
    def param(self) -> DTensor:
        """The stored parameter: as registered now (`load_state_dict(assign=True)` and
        `to_empty` replace or swap it), or the one set aside while the unsharded one is."""
        if self.sharded is not None:
            return self.sharded  # type: ignore[return-value]
        owner, attr = self.owners[0]
        return owner._parameters[attr]  # type: ignore[return-value]

    def register_unsharded(self) -> None:
        """Register the unsharded parameter (`full`, which must be filled) where the stored one is.

        It is made once per `full` tensor (the unit drops it when it makes a new one) and
        aliases its storage, so each gather refills it in place, as torch's FSDP2 keeps one
        unsharded parameter per parameter. Idempotent."""
        if self.sharded is not None:
            return
        assert self.full is not None
        owner, attr = self.owners[0]
        stored = owner._parameters[attr]
        assert stored is not None
        if self.unsharded is None:
            whole: torch.Tensor = self.full
            if self.tp is not None:  # the tp piece, a DTensor on the tp mesh again (in the gathered dtype)
                meta = self.tp.meta._replace(dtype=self.full.dtype)
                whole = DTensor(self.full, DTensorSpec(self.tp.mesh, self.tp.placements, meta, self.tp.shard_order),
                                requires_grad=False)
            self.unsharded = nn.Parameter(whole, requires_grad=stored.requires_grad)
        elif self.unsharded.requires_grad != stored.requires_grad:
            self.unsharded.requires_grad_(stored.requires_grad)
        self.sharded = stored
        for owner, attr in self.owners:
            owner._parameters[attr] = self.unsharded

    def register_sharded(self) -> None:
        """Put the stored parameter back where `register_unsharded` took it from. Idempotent."""
        if self.sharded is None:
            return
        stored, self.sharded = self.sharded, None
        for owner, attr in self.owners:
            owner._parameters[attr] = stored

    def shape_on(self, rank: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.sizes[rank]
        return tuple(shape)

    def numel_on(self, rank: int) -> int:
        return math.prod(self.shape_on(rank))

    def piece(self, parts: int, index: int) -> tuple[int, int, tuple[int, ...]]:
        """(start, length, shape) of piece `index` of the unsharded tensor cut into `parts` along `dim`."""
        start, length = chunk_range(self.full_shape[self.dim], parts, index)
        shape = list(self.full_shape)
        shape[self.dim] = length
        return start, length, tuple(shape)

    def split(self, grad: torch.Tensor) -> list[torch.Tensor]:
        """`grad` (the full shape) cut into the shard ranks' pieces along `dim`."""
        return list(torch.split(grad, list(self.sizes), dim=self.dim))


def packing(params: Sequence[UnitParam], n: int, even: bool = False) -> tuple[tuple[int, ...], list[list[int]]]:
    """(each rank's packed length, each rank's start of each parameter's piece): the stored
    pieces, or (`even`) the unsharded tensors cut into `n` torch.chunk pieces."""
    totals, starts = [], []
    for q in range(n):
        at, row = 0, []
        for p in params:
            row.append(at)
            at += math.prod(p.piece(n, q)[2]) if even else p.numel_on(q)
        totals.append(at)
        starts.append(row)
    return tuple(totals), starts


def place(name: str, p: torch.Tensor, mesh: DeviceMesh, shard_dim: int, placement: Shard,
          owners: list[tuple[nn.Module, str]]) -> tuple[UnitParam, nn.Parameter] | str:
    """`p` sharded on mesh dim `shard_dim` of `mesh` (the fully_shard mesh) and the unit's record
    of it (`register` puts it in place), or a problem naming the parameter and the fix. No
    communication: every rank keeps its own `torch.chunk` piece of the values it already holds
    (seed the ranks alike, as under torch)."""
    n, r = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    k = placement.dim % max(p.ndim, 1) if p.ndim else 0
    if p.ndim == 0:
        return f"{name} is a 0-dim parameter: fully_shard shards a tensor dim; pass it in ignored_params"
    tp: Optional[TensorParallel] = None
    if isinstance(p, DTensor):
        param_mesh, placements, order = _with_tensor_parallel(name, p, mesh, shard_dim, k)
        if isinstance(placements, str):
            return placements
        local = p._local_tensor
        tp = TensorParallel(p.device_mesh, p.placements, p.shard_order, p._spec.tensor_meta)
        meta = p._spec.tensor_meta
    else:
        param_mesh = mesh
        placements = tuple(Shard(k) if m == shard_dim else Replicate() for m in range(mesh.ndim))
        order = ()
        local = p.detach()
        meta = TensorMeta(p.shape, contiguous_strides(p.shape), p.dtype)
    full_shape = tuple(local.shape)
    sizes = tuple(chunk_range(full_shape[k], n, q)[1] for q in range(n))
    start, length = chunk_range(full_shape[k], n, r)
    with torch.no_grad():
        piece = local.narrow(k, start, length).clone(memory_format=torch.contiguous_format)
    spec = DTensorSpec(param_mesh, placements, meta, order)
    stored = nn.Parameter(DTensor(piece, spec, requires_grad=False), requires_grad=p.requires_grad)
    return UnitParam(name, owners, k, full_shape, sizes, tp), stored


def register(unit_param: UnitParam, stored: nn.Parameter) -> None:
    """Put the sharded parameter where every owner registered the original."""
    for owner, attr in unit_param.owners:
        owner._parameters[attr] = stored


def _with_tensor_parallel(name: str, p: DTensor, mesh: DeviceMesh, shard_dim: int, k: int
                          ) -> tuple[DeviceMesh, tuple[Placement, ...] | str, ShardOrder]:
    """The mesh of the dp dims and `p`'s tp dims, `p`'s placements with Shard(k) on the shard dim."""
    tp_mesh = p.device_mesh
    root = mesh._sliced_from[0] if mesh._sliced_from else mesh
    names = root.mesh_dim_names
    # the tp mesh is a sub-mesh of fully_shard's root when the root's dims of its names are it (by ranks and
    # names: a mesh object equal to the one the parameter was placed on may be another slice's, from a cache)
    if (names is None or mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None
            or not set(tp_mesh.mesh_dim_names) <= set(names) or root[tp_mesh.mesh_dim_names] != tp_mesh):
        return mesh, (f"{name} is a DTensor on {tp_mesh!r}, but fully_shard's mesh is {mesh!r}: both must be "
                      f"named sub-meshes of one mesh (init_device_mesh(..., mesh_dim_names=('dp', 'tp')); "
                      f"parallelize on mesh['tp'], fully_shard on mesh['dp'])"), ()
    if set(mesh.mesh_dim_names) & set(tp_mesh.mesh_dim_names):
        return mesh, (f"{name} is a DTensor on {tp_mesh!r}, which shares mesh dims with fully_shard's mesh "
                      f"{mesh!r}: tensor parallelism and fully_shard need disjoint mesh dims"), ()
    if p._spec.has_partial():
        return mesh, f"{name} has placements {p._spec.layout_str()}: a parameter cannot be Partial", ()
    if any(isinstance(q, _StridedShard) and q.dim == k for q in p.placements):
        return mesh, (f"{name} has placements {p._spec.layout_str()}: dim {k} is already split in strides; "
                      f"shard another dim with shard_placement_fn"), ()
    # in the root's dim order; a flattened dim (`_flatten`, torchtitan's dp_shard_cp) where its first dim is
    flat = root._flattened
    at = {n: names.index(n) if n in names else min(flat[n]) for n in (*mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)
          if n in names or n in flat}
    both = tuple(sorted(at, key=lambda n: at[n]))
    joint = root[both] if both != names else root
    where = {d: i for i, d in enumerate(both)}
    placements: list[Placement] = [Replicate()] * len(both)
    for m, q in enumerate(p.placements):
        placements[where[tp_mesh.mesh_dim_names[m]]] = q
    dp = where[mesh.mesh_dim_names[shard_dim]]
    placements[dp] = Shard(k)
    orders = {d: tuple(where[tp_mesh.mesh_dim_names[m]] for m in ms) for d, ms in p._spec.split_orders().items()}
    orders[k] = orders.get(k, ()) + (dp,)
    return joint, tuple(placements), normalize_shard_order(placements, orders, p.ndim)
