"""Strategies for reductions and scans: sum, mean, prod, amax/amin, max/min, argmax/argmin,
var/std, vector norms, any/all, logsumexp, count_nonzero, aminmax, cumsum/cumprod.

A reduction over a tensor dim that a mesh dim shards leaves each rank with a term of the
answer; whether those terms make a valid `Partial` depends on the op:

| op | reduced dim sharded gives | Partial input kept |
|---|---|---|
| sum | P(sum) | sum, avg |
| count_nonzero, nansum, vector_norm ord 0 / 1 | P(sum) | none |
| mean | P(avg), only when every rank reduces the same number of elements | sum, avg |
| amax, max(), vector_norm ord inf / -inf (amin, min(): P(min)) | P(max), only when no rank's piece of the reduced dims is empty (the op has no identity) | max (min) |
| any / all | P(max) / P(min) on bool | none |
| aminmax | (P(min), P(max)) | none |
| vector_norm / norm, other ord p > 0 | R: the local implementation all-reduces each rank's norm^p and takes the root (`_norm_terms`) | none |
| prod, argmax/argmin, max.dim/min.dim, var/std, logsumexp, norms of ord < 0 | the reduced dims must be Replicate | none |

A sum, mean or cumsum given another `dtype=` than its input's keeps no Partial input: each rank
would round its term to that dtype, and the sum of rounded terms is not the rounded sum.

Dims that are not reduced keep their shards. Besides following the input, every
candidate may also move a shard onto any kept dim: when a reduced dim must be whole, an
all_to_all onto a kept dim is often cheaper than gathering, and the propagator prices
both. Scans (cumsum, cumprod, logcumsumexp) need the scanned dim whole; cumsum is linear,
so P(sum)/P(avg) pass through it.

`build_strategy` here is shared with the normalization strategies in `_norm`.

>>> from shardwise import AbstractMesh
>>> from shardwise._ops import OpSchema, propagate
>>> from shardwise._spec import TensorMeta
>>> rows = DTensorSpec(AbstractMesh((4,)), (Shard(0),), TensorMeta(torch.Size([8, 6]), (6, 1), torch.float32))
>>> def plan(op: Any, *args: Any) -> str:  # input move -> output layout
...     r = propagate(OpSchema(op, (rows, *args)))
...     return ("as is" if r.input_specs[0] is None else r.input_specs[0].layout_str()) + " -> " + r.output_spec.layout_str()
>>> plan(aten.sum.dim_IntList, (0,)), plan(aten.mean.dim, (0,)), plan(aten.amax.default, (0,))
('as is -> (P(sum))', 'as is -> (P(avg))', 'as is -> (P(max))')
>>> plan(aten.argmax.default, 0)  # the reduced dim must be whole: all_to_all onto dim 1
'(S(1)) -> (S(0))'
>>> plan(aten.linalg_vector_norm.default, 2), plan(aten.linalg_vector_norm.default, 2, (1,))  # terms all-reduced
('as is -> (R)', 'as is -> (S(0))')
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from .._layout import ShardOrder, local_shape_and_offset
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._norm_terms import NORMS, combines_by_root, order_name, vector_norm_local
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import expand_to_mesh, normalize_dim, normalize_dims

__all__ = ["Option", "DimMap", "build_strategy", "reduction_strategy", "pieces_fit"]

aten = torch.ops.aten

# One way to run an op along one mesh dim: the placement of each output (None: the
# output is not computed), then the placement of each DTensor input (input_specs order).
Option = tuple[Optional[Placement], ...]
# Maps a tensor dim of input 0 to the corresponding dim of another tensor (None: none).
DimMap = Callable[[int], Optional[int]]


def _same(d: int) -> Optional[int]:
    return d


def _map_order(order: ShardOrder, placements: Sequence[Placement], dim_map: DimMap) -> ShardOrder:
    """Input 0's non-default split orders carried to a tensor whose placements shard the same dims."""
    out = []
    for d, mesh_dims in order:
        td = dim_map(d)
        if td is None:
            continue
        splitting = tuple(m for m, p in enumerate(placements) if p == Shard(td))
        if sorted(mesh_dims) == list(splitting) and tuple(mesh_dims) != splitting:
            out.append((td, tuple(mesh_dims)))
    return tuple(sorted(out))


def build_strategy(
    schema: OpSchema,
    options_for: Callable[[int], Sequence[Option]],
    n_outputs: int = 1,
    maps: Optional[Sequence[DimMap]] = None,
    accept: Optional[Callable[[tuple[Layout, ...]], bool]] = None,
    present: Optional[Sequence[bool]] = None,
) -> OpStrategy:
    """Every combination over the mesh dims of the per-mesh-dim options `options_for(i)`.

    The all-Replicate option is added (outputs not `present` stay None). Where input 0
    keeps its placements it keeps its split order, and every other tensor follows it
    through `maps` (one per input, then one per output; default: the same dims).
    `accept(input_layouts)` drops candidates.
    """
    specs = schema.input_specs()
    mesh_ndim = specs[0].mesh.ndim
    outs_replicated = tuple(Replicate() if present is None or present[j] else None for j in range(n_outputs))
    replicated: Option = outs_replicated + (Replicate(),) * len(specs)
    per_dim: list[list[Option]] = []
    for i in range(mesh_ndim):
        per_dim.append(list(dict.fromkeys([replicated] + [tuple(o) for o in options_for(i)])))
    strategies = []
    for combo in itertools.product(*per_dim):
        cols = list(zip(*combo))
        order = specs[0].shard_order if cols[n_outputs] == specs[0].placements else ()

        def layout(col: Sequence[Optional[Placement]], dim_map: DimMap) -> Optional[Layout]:
            if any(p is None for p in col):
                return None
            placements: tuple[Placement, ...] = tuple(p for p in col if p is not None)
            return Layout(placements, _map_order(order, placements, dim_map))

        def dim_map(k: int) -> DimMap:
            return maps[k] if maps else _same

        ins = tuple(layout(cols[n_outputs + k], dim_map(k)) for k in range(len(specs)))
        in_layouts = tuple(lay for lay in ins if lay is not None)
        if len(in_layouts) != len(specs) or (accept is not None and not accept(in_layouts)):
            continue
        outs = tuple(layout(cols[j], dim_map(len(specs) + j)) for j in range(n_outputs))
        strategies.append(PlacementStrategy(outs[0] if n_outputs == 1 else outs, in_layouts))
    return OpStrategy(strategies)


def pieces_fit(spec: DTensorSpec, layout: Layout, dims: Sequence[int], nonempty: bool, even: bool) -> bool:
    """Whether every rank's piece of `spec` under `layout` reduces a non-empty (`nonempty`)
    and equal (`even`) number of elements over `dims`. Only mesh dims that split a
    reduced dim change that number, so only their coordinates are visited."""
    splitting = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim in dims]
    if not splitting:
        return True
    mesh_shape = spec.mesh.shape
    total = math.prod(spec.shape[d] for d in dims)
    counts = set()
    for sub in itertools.product(*(range(mesh_shape[m]) for m in splitting)):
        coordinate = [0] * len(mesh_shape)
        for m, c in zip(splitting, sub):
            coordinate[m] = c
        shape = local_shape_and_offset(spec.shape, mesh_shape, layout.placements, coordinate, layout.shard_order)[0]
        n = math.prod(shape[d] for d in dims)
        if nonempty and n == 0 and total > 0:
            return False
        counts.add(n)
    return not even or len(counts) <= 1


def reduction_strategy(
    schema: OpSchema,
    dims: Sequence[int],
    keepdim: bool,
    combine: Sequence[Optional[str]] = ("sum",),
    keep: Sequence[str] = (),
    nonempty: bool = False,
    even: bool = False,
    rooted: bool = False,
) -> OpStrategy:
    """Candidates for reducing input 0 over `dims` into one output per entry of `combine`.

    `combine[j]`: the Partial that output j becomes when a reduced dim is sharded (None:
    reduced dims must be Replicate, unless `rooted`: the op's local implementation combines
    the ranks' terms itself, and the outputs are Replicate); `keep`: the Partial kinds of the
    input that pass through unchanged; `nonempty` / `even`: conditions on the local pieces
    (see `pieces_fit`).
    """
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    reduced = set(dims)
    n_out = len(combine)

    def out_dim(d: int) -> Optional[int]:
        if d in reduced:
            return None
        return d if keepdim else d - sum(1 for r in reduced if r < d)

    def options(i: int) -> list[Option]:
        opts: list[Option] = []
        for d in range(spec.ndim):
            od = out_dim(d)
            if od is not None:
                opts.append((Shard(od),) * n_out + (Shard(d),))
            elif all(c is not None for c in combine):
                opts.append(tuple(Partial(c) for c in combine if c is not None) + (Shard(d),))
            elif rooted:
                opts.append((Replicate(),) * n_out + (Shard(d),))
        p = spec.placements[i]
        if isinstance(p, Partial) and p.reduce_op in keep:
            opts.append((p,) * n_out + (p,))
        return opts

    def accept(layouts: tuple[Layout, ...]) -> bool:
        return not (nonempty or even) or pieces_fit(spec, layouts[0], sorted(reduced), nonempty, even)

    return build_strategy(schema, options, n_out, [_same] + [out_dim] * n_out, accept)


# -- argument conventions of the reduction overloads ------------------------------------

_KW_ONLY = 1 << 10  # a position no argument has: `schema.arg` then reads the keyword


def _dims_keepdim(schema: OpSchema, dim_at: Optional[int], keepdim_at: Optional[int], empty_is_all: bool = True
                  ) -> tuple[tuple[int, ...], bool]:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    keepdim = bool(schema.arg(keepdim_at, "keepdim", False)) if keepdim_at is not None else False
    arg = schema.arg(dim_at, "dim", None) if dim_at is not None else None
    if arg is not None and not isinstance(arg, int) and len(arg) == 0 and not empty_is_all:
        return (), keepdim
    return normalize_dims(arg, spec.ndim), keepdim


# op -> (position of dim, position of keepdim); None: the overload reduces every dim.
_SUM_LIKE = {
    aten.sum.default: (None, None), aten.sum.dim_IntList: (1, 2), aten.nansum.default: (1, 2),
    aten.count_nonzero.default: (1, None), aten.count_nonzero.dim_IntList: (1, None),
}
_MEAN = {aten.mean.default: (None, None), aten.mean.dim: (1, 2)}
_MAX_LIKE = {aten.amax.default: (1, 2), aten.max.default: (None, None)}
_MIN_LIKE = {aten.amin.default: (1, 2), aten.min.default: (None, None)}
_WHOLE = {  # reduced dims must be Replicate; one output
    aten.prod.default: (None, None), aten.prod.dim_int: (1, 2), aten.logsumexp.default: (1, 2),
    aten.argmax.default: (1, 2), aten.argmin.default: (1, 2),
    aten.var.default: (None, None), aten.var.dim: (1, 3), aten.var.correction: (1, _KW_ONLY),
    aten.std.default: (None, None), aten.std.dim: (1, 3), aten.std.correction: (1, _KW_ONLY),
}
_WHOLE_PAIR = {  # reduced dims must be Replicate; two outputs
    aten.max.dim: (1, 2), aten.min.dim: (1, 2),
    aten.var_mean.default: (None, None), aten.var_mean.dim: (1, 3), aten.var_mean.correction: (1, _KW_ONLY),
    aten.std_mean.default: (None, None), aten.std_mean.dim: (1, 3), aten.std_mean.correction: (1, _KW_ONLY),
}
_ANY_ALL = {
    aten.any.default: (None, None), aten.any.dim: (1, 2), aten.any.dims: (1, 2),
    aten.all.default: (None, None), aten.all.dim: (1, 2), aten.all.dims: (1, 2),
}


def _same_dtype(schema: OpSchema, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`kinds`, the Partials a linear op keeps, where its output has its input's dtype, else none."""
    spec, out = schema.args_schema[0], schema.output_meta()
    assert isinstance(spec, DTensorSpec) and isinstance(out, TensorMeta)
    return kinds if out.dtype == spec.dtype else ()


@register_op_strategy(list(_SUM_LIKE), positions_alike=True)
def _sum_strategy(schema: OpSchema) -> OpStrategy:
    dims, keepdim = _dims_keepdim(schema, *_SUM_LIKE[schema.op])
    linear = ("sum", "avg") if schema.op in (aten.sum.default, aten.sum.dim_IntList) else ()
    return reduction_strategy(schema, dims, keepdim, ("sum",), keep=_same_dtype(schema, linear))


@register_op_strategy(list(_MEAN), positions_alike=True)
def _mean_strategy(schema: OpSchema) -> OpStrategy:
    dims, keepdim = _dims_keepdim(schema, *_MEAN[schema.op])
    return reduction_strategy(schema, dims, keepdim, ("avg",), keep=_same_dtype(schema, ("sum", "avg")), even=True)


@register_op_strategy(list(_MAX_LIKE) + list(_MIN_LIKE))
def _extremum_strategy(schema: OpSchema) -> OpStrategy:
    kind = "max" if schema.op in _MAX_LIKE else "min"
    dims, keepdim = _dims_keepdim(schema, *{**_MAX_LIKE, **_MIN_LIKE}[schema.op])
    return reduction_strategy(schema, dims, keepdim, (kind,), keep=(kind,), nonempty=True)


@register_op_strategy(list(_WHOLE))
def _whole_strategy(schema: OpSchema) -> OpStrategy:
    dims, keepdim = _dims_keepdim(schema, *_WHOLE[schema.op])
    return reduction_strategy(schema, dims, keepdim, (None,))


@register_op_strategy(list(_WHOLE_PAIR))
def _whole_pair_strategy(schema: OpSchema) -> OpStrategy:
    dims, keepdim = _dims_keepdim(schema, *_WHOLE_PAIR[schema.op])
    return reduction_strategy(schema, dims, keepdim, (None, None))


@register_op_strategy(aten.aminmax.default)
def _aminmax_strategy(schema: OpSchema) -> OpStrategy:
    dims, keepdim = _dims_keepdim(schema, _KW_ONLY, _KW_ONLY)
    return reduction_strategy(schema, dims, keepdim, ("min", "max"), nonempty=True)


@register_op_strategy(list(_ANY_ALL))
def _any_all_strategy(schema: OpSchema) -> OpStrategy:
    is_any = schema.op in (aten.any.default, aten.any.dim, aten.any.dims)
    # any.dims with an empty list reduces nothing (sum.dim_IntList would reduce everything)
    dims, keepdim = _dims_keepdim(schema, *_ANY_ALL[schema.op], empty_is_all=False)
    return reduction_strategy(schema, dims, keepdim, ("max" if is_any else "min",))


def _norm_combine(order: Any) -> tuple[Optional[str], bool]:
    """The Partial a p-norm's local terms make (None: no Partial), and whether it needs non-empty pieces."""
    p = 2.0 if order is None else float(order)
    if p in (0.0, 1.0):
        return "sum", False  # count of non-zeros, sum of |x|: both add up
    if math.isinf(p):
        return ("max" if p > 0 else "min"), True
    return None, False  # (sum |x|^p)^(1/p): combined by the local implementation (p > 0) or gathered


@register_op_strategy(list(NORMS), local=vector_norm_local, positions_alike=True)
def _norm_strategy(schema: OpSchema) -> OpStrategy:
    ord_at, dim_at, keepdim_at = NORMS[schema.op]
    order = schema.arg(ord_at, order_name(schema.op), 2)
    combine, nonempty = _norm_combine(order)
    dims, keepdim = _dims_keepdim(schema, dim_at, keepdim_at)
    return reduction_strategy(schema, dims, keepdim, (combine,), nonempty=nonempty, rooted=combines_by_root(order))


# -- scans -------------------------------------------------------------------------------

@register_op_strategy([aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default])
def _scan_strategy(schema: OpSchema) -> OpStrategy:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dim = normalize_dim(schema.arg(1, "dim"), spec.ndim)
    linear = schema.op is aten.cumsum.default and bool(_same_dtype(schema, ("sum",)))

    def options(i: int) -> list[Option]:
        opts: list[Option] = [(Shard(d), Shard(d)) for d in range(spec.ndim) if d != dim]
        p = spec.placements[i]
        if linear and isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            opts.append((p, p))
        return opts

    return build_strategy(schema, options)


@register_op_strategy([aten.cummax.default, aten.cummin.default])
def _cumulative_extreme_strategy(schema: OpSchema) -> OpStrategy:
    """Running max/min (values, indices): the scanned dim whole, every other dim split alike."""
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dim = normalize_dim(schema.arg(1, "dim"), spec.ndim)
    options = [(Shard(d), Shard(d), Shard(d)) for d in range(spec.ndim) if d != dim]
    return expand_to_mesh(spec.mesh.ndim, options, n_outputs=2)
