"""Strategies for indexing ops: index_select / gather / scatter / index / index_put /
masked_fill / masked_scatter / sort / topk, and the backwards they produce.

Indices hold global positions, so the tensor dim they index must be whole on every rank
(Replicate along it); every other dim may stay sharded, provided the data and the index
tensors are split the same way (same size on that dim, so `torch.chunk` cuts them alike).
Masks follow the data's layout. An index tensor may itself be sharded where its pieces
select independent output pieces (`gather` along its dim, `index_select`'s index, the
broadcast dims of advanced indices).

Selection is linear and order-preserving, so a Partial source survives every selecting
op (`P(max)` included). Writes keep a Partial where the reduction commutes with them:

| op | Partial kept when |
|---|---|
| index_select, gather, index | self is any Partial (indices Replicate) |
| scatter.src, index_copy, index_put, masked_scatter | self and source the same Partial |
| scatter.value, index_fill, masked_fill | P(avg/max/min); P(sum) only when the value is 0 |
| scatter_add, index_add, index_put(accumulate) | self and source the same P(sum) / P(avg) |

Strategies here are written with the kit in `_args` (`Args`, `combine`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._args import Args, Option, broadcast_shards, combine
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy, ScalarTensor
from ._utils import normalize_dim

__all__ = ["scatter_options"]

aten = torch.ops.aten
R = Replicate()

def _dim(schema: OpSchema, index: int, name: str, ndim: int, default: int = 0) -> int:
    return normalize_dim(int(schema.arg(index, name, default)), ndim)


# -- selections: index_select, gather ------------------------------------------------------


@register_op_strategy(aten.index_select.default)
def _index_select_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    src = a.need("self")
    dim = _dim(schema, 1, "dim", src.ndim)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d)}) for d in range(src.ndim) if d != dim]
        index = a.spec("index")
        if index is not None and index.ndim == 1 and src.ndim > 0:
            opts.append(a.opt((Shard(dim),), {"index": Shard(0)}))  # each rank selects its share
        p = a.partial("self", i)
        if p is not None:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.gather.default)
def _gather_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    src = a.need("self")
    index = a.spec("index")
    dim = _dim(schema, 1, "dim", src.ndim)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = []
        if index is not None and index.ndim == src.ndim and src.ndim > 0:
            # out[.., j, ..] reads self at index[.., j, ..] along `dim`: the index may be split
            # along `dim` freely; along another dim it must be split exactly like self
            opts.append(a.opt((Shard(dim),), {"index": Shard(dim)}))
            opts += [a.opt((Shard(d),), {"self": Shard(d), "index": Shard(d)})
                     for d in range(src.ndim) if d != dim and index.shape[d] == src.shape[d]]
        p = a.partial("self", i)
        if p is not None:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


# -- writes along a dim: scatter*, index_add / index_copy / index_fill -----------------------


_SCATTER_SRC = [aten.scatter.src, aten.scatter_.src]
_SCATTER_VALUE = [aten.scatter.value, aten.scatter_.value]
_SCATTER_ADD = [aten.scatter_add.default, aten.scatter_add_.default]
_SCATTER_REDUCE = [aten.scatter_reduce.two, aten.scatter_reduce_.two]
# reduce mode -> the Partials a scatter_reduce keeps when self and src share them
_REDUCE_KEEPS = {"sum": ("sum", "avg"), "mean": ("sum", "avg"), "amax": ("max",), "amin": ("min",), "prod": ()}


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float, bool)) and value == 0


def _fill_keeps(value: Any) -> tuple[str, ...]:
    """Partials a fill with a constant keeps: every term gets the value, so avg/max/min
    agree; a sum would count it once per rank unless it is 0."""
    return ("sum", "avg", "max", "min") if _is_zero(value) else ("avg", "max", "min")


def scatter_options(a: Args, i: int, dim: int, joint: tuple[str, ...], alone: tuple[str, ...]) -> list[Option]:
    """Scatter-family options on mesh dim i: self, index and src split alike off `dim` (where
    their sizes agree), and the Partials self keeps jointly with src or alone."""
    me, index, src = a.need("self"), a.spec("index"), a.spec("src")
    opts: list[Option] = []
    if index is not None and index.ndim == me.ndim:
        for d in range(me.ndim):
            same = index.shape[d] == me.shape[d] and (src is None or src.shape[d] == me.shape[d])
            if d != dim and same:
                opts.append(a.opt((Shard(d),), {"self": Shard(d), "index": Shard(d), "src": Shard(d)}))
    p = a.partial("self", i)
    if p is not None and p.reduce_op in joint and src is not None:
        opts.append(a.opt((p,), {"self": p, "src": p}))
    if p is not None and p.reduce_op in alone:
        opts.append(a.opt((p,), {"self": p}))
    return opts


@register_op_strategy(_SCATTER_SRC + _SCATTER_VALUE + _SCATTER_ADD + _SCATTER_REDUCE)
def _scatter_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    index, src = a.spec("index"), a.spec("src")
    dim = _dim(schema, 1, "dim", me.ndim)
    op = schema.op
    include_self = bool(schema.arg(5, "include_self", True))
    if op in _SCATTER_SRC:
        joint: tuple[str, ...] = ("sum", "avg", "max", "min")  # overwrite: jointly linear
    elif op in _SCATTER_ADD:
        joint = ("sum", "avg")
    elif op in _SCATTER_REDUCE:
        joint = _REDUCE_KEEPS.get(str(schema.arg(4, "reduce")), ())
    else:
        joint = ()
    alone = _fill_keeps(schema.arg(3, "value")) if op in _SCATTER_VALUE else ()
    # a self that is already a Partial may collect contributions split by index rows along
    # `dim` (gradients accumulating): each term adds / maxes in its own rows
    if op in _SCATTER_ADD:
        split_src: tuple[str, ...] = ("sum",)
    elif op in _SCATTER_REDUCE and include_self:
        split_src = {"sum": ("sum",), "amax": ("max",), "amin": ("min",)}.get(str(schema.arg(4, "reduce")), ())
    else:
        split_src = ()
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = scatter_options(a, i, dim, joint, alone)
        p = a.partial("self", i)
        if (p is not None and p.reduce_op in split_src and index is not None and src is not None
                and me.ndim and index.shape[dim] == src.shape[dim]):
            opts.append(a.opt((p,), {"self": p, "index": Shard(dim), "src": Shard(dim)}))
        per_dim.append(opts)
    return combine(a, per_dim)


_INDEX_ADD = [aten.index_add.default, aten.index_add_.default]
_INDEX_COPY = [aten.index_copy.default, aten.index_copy_.default]
_INDEX_FILL = [aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar,
               aten.index_fill.int_Tensor, aten.index_fill_.int_Tensor]


@register_op_strategy(_INDEX_ADD + _INDEX_COPY + _INDEX_FILL)
def _index_write_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    source, index = a.spec("source"), a.spec("index")
    dim = _dim(schema, 1, "dim", me.ndim)
    op = schema.op
    if op in _INDEX_ADD:
        joint: tuple[str, ...] = ("sum", "avg")
        # alpha * a replicated source added to every term: only an average stays right
        alone: tuple[str, ...] = ("avg",)
    elif op in _INDEX_COPY:
        joint, alone = ("sum", "avg", "max", "min"), ("avg", "max", "min")
    else:
        joint, alone = ("sum", "avg", "max", "min"), _fill_keeps(schema.arg(3, "value"))
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d), "source": Shard(d), "value": R})
                for d in range(me.ndim) if d != dim and (source is None or source.shape[d] == me.shape[d])]
        p = a.partial("self", i)
        value = a.partial("value", i)
        if p is not None:
            if source is not None and p.reduce_op in joint:
                opts.append(a.opt((p,), {"self": p, "source": p}))
            if op in _INDEX_FILL and value == p:
                opts.append(a.opt((p,), {"self": p, "value": p}))
            if p.reduce_op in alone:
                opts.append(a.opt((p,), {"self": p}))
            if op in _INDEX_ADD and p.reduce_op == "sum" and index is not None and index.ndim == 1 and me.ndim:
                opts.append(a.opt((p,), {"self": p, "index": Shard(0), "source": Shard(dim)}))
        per_dim.append(opts)
    return combine(a, per_dim)


# -- advanced indexing: index.Tensor, index_put --------------------------------------------


class _Geometry:
    """Where the dims of `self[indices]` come from.

    Non-indexed self dims keep their order; the broadcast shape B of the index tensors
    replaces the indexed dims where they are adjacent, or goes first where they are not.
    """

    def __init__(self, ndim: int, indices: Sequence[Any]) -> None:
        self.res_dim: dict[int, int] = {}  # non-indexed self dim -> result dim
        self.has_bool = False
        covered: list[tuple[int, int]] = []  # (first self dim, count) of each indexed entry
        shapes: list[tuple[int, ...]] = []
        d = 0
        for entry in indices:
            if entry is None:
                d += 1
                continue
            is_bool = entry.dtype in (torch.bool, torch.uint8)
            span = entry.ndim if isinstance(entry, DTensorSpec) and is_bool else (0 if is_bool else 1)
            self.has_bool |= is_bool
            covered.append((d, span))
            shapes.append((-1,) if is_bool else tuple(entry.shape) if isinstance(entry, DTensorSpec) else ())
            d += span
        self.bshape = tuple(_broadcast(shapes)) if not self.has_bool else (-1,) * max((len(s) for s in shapes), default=0)
        indexed = {x for first, span in covered for x in range(first, first + span)}
        rest = [x for x in range(ndim) if x not in indexed]
        positions = [k for k, e in enumerate(indices) if e is not None]
        adjacent = bool(positions) and positions[-1] - positions[0] + 1 == len(positions)
        self.start = covered[0][0] if adjacent and covered else 0
        nb = len(self.bshape)
        for x in rest:
            before = adjacent and x < self.start
            self.res_dim[x] = x if before else (nb + rest.index(x) if not adjacent else x - len(indexed) + nb)
        self.res_ndim = ndim - len(indexed) + nb


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> list[int]:
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for k, size in enumerate(s):
            j = n - len(s) + k
            out[j] = size if out[j] == 1 else out[j]
    return out


def _index_tensor_options(a: Args, geo: _Geometry, indices: Sequence[Any]) -> list[dict[int, Placement]]:
    """Per broadcast dim j of the index tensors: how to split each of them so that each rank
    holds the index rows of one piece of result dim `start + j` (none with bool masks)."""
    if geo.has_bool:
        return []
    found = []
    slots = a.list_pos("indices")
    for j, size in enumerate(geo.bshape):
        ins: dict[int, Placement] = {}
        for entry, slot in zip(indices, slots):
            if isinstance(entry, DTensorSpec) and slot is not None:
                t = j - (len(geo.bshape) - entry.ndim)
                if t >= 0 and entry.shape[t] == size:
                    ins[slot] = Shard(t)
        found.append(ins)
    return found


@register_op_strategy(aten.index.Tensor)
def _index_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    indices = tuple(schema.arg(1, "indices", ()))
    geo = _Geometry(me.ndim, indices)
    me_pos = a.pos("self")
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(r),), {"self": Shard(d)}) for d, r in geo.res_dim.items()]
        for j, ins in enumerate(_index_tensor_options(a, geo, indices)):
            if ins:
                opts.append(((Shard(geo.start + j),), ins))
        p = a.partial("self", i)
        if p is not None and me_pos is not None:
            opts.append(((p,), {me_pos: p}))
        per_dim.append(opts)
    return combine(a, per_dim)


_INDEX_PUT = [aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default]


@register_op_strategy(_INDEX_PUT)
def _index_put_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    values = a.spec("values")
    indices = tuple(schema.arg(1, "indices", ()))
    accumulate = bool(schema.arg(3, "accumulate", False))
    geo = _Geometry(me.ndim, indices)
    joint = ("sum", "avg") if accumulate else ("sum", "avg", "max", "min")
    alone = ("avg",) if accumulate else ("avg", "max", "min")  # values the same on every rank
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = []
        for d, r in geo.res_dim.items():
            ins: dict[str, Placement] = {"self": Shard(d)}
            if values is not None:
                v = values.ndim - (geo.res_ndim - r)
                if v >= 0 and values.shape[v] != 1:
                    ins["values"] = Shard(v)
            opts.append(a.opt((Shard(d),), ins))
        p = a.partial("self", i)
        if p is not None and values is not None and p.reduce_op in joint:
            opts.append(a.opt((p,), {"self": p, "values": p}))
        if p is not None and p.reduce_op in alone:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


# -- masks: masked_fill, masked_scatter ----------------------------------------------------


_MASKED_FILL = [aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor]


@register_op_strategy(_MASKED_FILL)
def _masked_fill_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    meta = schema.output_meta()
    value = schema.arg(2, "value")
    alone = ("avg", "max", "min") if isinstance(value, (DTensorSpec, ScalarTensor)) else _fill_keeps(value)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = broadcast_shards(meta.shape, {"self": a.spec("self"), "mask": a.spec("mask")}, a)
        p = a.partial("self", i)
        if p is not None and p.reduce_op in alone:
            opts.append(a.opt((p,), {"self": p}))
        if p is not None and isinstance(value, DTensorSpec) and a.partial("value", i) == p:
            opts.append(a.opt((p,), {"self": p, "value": p}))  # where(mask, v, x) is jointly linear
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy([aten.masked_scatter.default, aten.masked_scatter_.default])
def _masked_scatter_strategy(schema: OpSchema) -> OpStrategy:
    # which source element lands where depends on the count of True before it in the whole
    # mask: nothing can stay split; Partials survive (the positions are the same per term)
    a = Args(schema)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = []
        p = a.partial("self", i)
        if p is not None:
            opts.append(a.opt((p,), {"self": p, "source": p}))
            if p.reduce_op in ("avg", "max", "min"):
                opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.masked_scatter_backward.default)
def _masked_scatter_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    per_dim = []
    for i in range(a.mesh_ndim):
        p = a.partial("grad_output", i)
        per_dim.append([a.opt((p,), {"grad_output": p})] if p is not None else [])
    return combine(a, per_dim)


# -- sort, topk ----------------------------------------------------------------------------


@register_op_strategy([aten.sort.default, aten.sort.stable, aten.topk.default])
def _sort_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    if schema.op is aten.topk.default:
        dim = _dim(schema, 2, "dim", me.ndim, -1)
    elif schema.op is aten.sort.stable:
        dim = normalize_dim(int(schema.kwargs.get("dim", -1)), me.ndim)
    else:
        dim = _dim(schema, 1, "dim", me.ndim, -1)
    # the sorted dim must be whole; values and indices are split like self elsewhere
    opts = [a.opt((Shard(d), Shard(d)), {"self": Shard(d)}) for d in range(me.ndim) if d != dim]
    return combine(a, [opts] * a.mesh_ndim, n_outputs=2)
