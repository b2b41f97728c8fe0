"""Strategies for views: view/reshape, expand, permute/transpose, squeeze/unsqueeze, alias.

Every op in this family (and in `_shape`) moves elements without combining them. So a
strategy is a map from input tensor dims to the output dims they become whole
(`dim_map`): a Shard on a mapped dim stays a Shard on its image, every other Shard must
become Replicate on its mesh dim (or move to a mapped dim, when an all_to_all is cheaper
than a gather), and a Partial of any reduce op passes through, because the max (or sum)
of moved elements is the moved max (or sum).

A view merges and splits groups of adjacent dims. A Shard on the outermost dim of a
group keeps its output image only when every rank's piece is still a `torch.chunk`
piece of the output dim: `(8, 3) -> (24,)` keeps `S(0)` on 4 ranks (pieces of 2 rows =
6 elements, and 24 splits into 6s), while `(6, 4) -> (24,)` on 4 ranks does not (rows
split 2, 2, 2, 0 but 24 splits 6, 6, 6, 6). The check is exact: it compares every rank's
span of the group, for every mesh dim splitting the dim, in split order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch

from .._layout import ShardOrder, chunk_range, split_orders
from .._placement import REDUCE_OPS, Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._registry import OpKind, register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import canonical_order as _canonical, input_spec, normalize_dim, order_like, renamed_order

__all__ = [
    "ANY_REDUCE",
    "LINEAR",
    "ShardCheck",
    "input_spec",
    "local_sizes",
    "order_like",
    "out_meta",
    "renamed_order",
    "single_input_strategy",
    "view_groups",
]

aten = torch.ops.aten

# Which Partial reduce ops an op passes through: data movement keeps them all; an op that
# adds elements together (unfold_backward) keeps only the linear ones.
ANY_REDUCE: frozenset[str] = frozenset(REDUCE_OPS)
LINEAR: frozenset[str] = frozenset(("sum", "avg"))

# Whether a candidate's sharding is exact: {tensor dim: splitting mesh dims, outermost first}.
ShardCheck = Callable[[Mapping[int, tuple[int, ...]]], bool]


def out_meta(schema: OpSchema) -> TensorMeta:
    meta = schema.output_meta()
    if not isinstance(meta, TensorMeta):
        raise TypeError(f"{schema.op} was expected to return one tensor, got {meta!r}")
    return meta


def _mesh_options(
    p: Placement, dim_map: Mapping[int, int], partials: frozenset[str], move: bool
) -> list[tuple[Placement, Placement]]:
    """Along one mesh dim: (input placement, output placement) choices, Replicate first.

    `move`: also offer moving a Shard to every dim that survives (an all_to_all may be
    cheaper than the gather; the propagator prices both)."""
    options: list[tuple[Placement, Placement]] = [(Replicate(), Replicate())]
    if isinstance(p, Partial) and p.reduce_op in partials:
        options.append((p, p))
    elif isinstance(p, Shard) and (move or p.dim not in dim_map):
        options.extend((Shard(d), Shard(o)) for d, o in sorted(dim_map.items()))
    elif isinstance(p, Shard):
        options.append((p, Shard(dim_map[p.dim])))
    return options


def single_input_strategy(
    spec: DTensorSpec,
    dim_map: Mapping[int, int],
    *,
    n_outputs: Optional[int] = None,
    shape_arg: Optional[int] = None,
    check: Optional[ShardCheck] = None,
    partials: frozenset[str] = ANY_REDUCE,
) -> OpStrategy:
    """Candidates for a one-input op that sends input dim `d` whole to output dim `dim_map[d]`.

    `n_outputs`: None for one output, else the length of the output tuple (every output
    gets the same layout). `check` rejects candidates whose pieces would not be exact.
    """
    # Moves are offered when the input cannot stay as it is: a Shard on a dim that does not
    # survive, or one the check rejects where it is.
    stays = all(not isinstance(p, Shard) or p.dim in dim_map for p in spec.placements) and (
        check is None or check(split_orders(spec.placements, spec.shard_order))
    )
    per_mesh_dim = [_mesh_options(p, dim_map, partials, not stays) for p in spec.placements]
    strategies = []
    for combo in itertools.product(*per_mesh_dim):
        ins = tuple(i for i, _ in combo)
        order = order_like(ins, spec)
        if check is not None and not check(split_orders(ins, order)):
            continue
        out = Layout(tuple(o for _, o in combo), renamed_order(order, dim_map))
        outs = out if n_outputs is None else (out,) * n_outputs
        strategies.append(PlacementStrategy(outs, (Layout(ins, order),), shape_arg=shape_arg))
    return OpStrategy(strategies)


def local_sizes(size: int, mesh_shape: Sequence[int], mesh_dims: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of every rank's piece of a dim of `size` split by `mesh_dims` in order."""
    spans = []
    for coordinate in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
        start, length = 0, size
        for m, c in zip(mesh_dims, coordinate):
            offset, length = chunk_range(length, mesh_shape[m], c)
            start += offset
        spans.append((start, length))
    return spans


# -- view / reshape ------------------------------------------------------------------------


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Smallest runs of adjacent dims with equal numel: (input dims, output dims) per run.

    A size-1 dim with no size-1 partner forms a run on its own side only.

    >>> view_groups((2, 3, 4), (6, 2, 2))
    [((0, 1), (0,)), ((2,), (1, 2))]
    >>> view_groups((1, 5), (5, 1))
    [((0,), ()), ((1,), (0,)), ((), (1,))]
    """
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = o = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or o < n_out:
        if i < n_in and in_shape[i] == 1 and (o >= n_out or out_shape[o] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if o < n_out and out_shape[o] == 1 and (i >= n_in or in_shape[i] != 1):
            groups.append(((), (o,)))
            o += 1
            continue
        ins, outs = [i], [o]
        p_in, p_out = in_shape[i], out_shape[o]
        i, o = i + 1, o + 1
        while p_in != p_out:
            if p_in < p_out:
                ins.append(i)
                p_in *= in_shape[i]
                i += 1
            else:
                outs.append(o)
                p_out *= out_shape[o]
                o += 1
        groups.append((tuple(ins), tuple(outs)))
    return groups


def _view_plan(
    in_shape: Sequence[int], out_shape: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[dict[int, int], ShardCheck]:
    """The dims a view can keep split (outermost dim of each group -> its outermost image) and
    the exact check of a candidate's pieces."""
    if math.prod(in_shape) == 0 or math.prod(out_shape) == 0:
        same = tuple(in_shape) == tuple(out_shape)
        return ({d: d for d in range(len(in_shape))} if same else {}), (lambda orders: True)
    dim_map: dict[int, int] = {}
    group_of: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for ins, outs in view_groups(in_shape, out_shape):
        if ins and outs:
            dim_map[ins[0]] = outs[0]
            group_of[ins[0]] = (ins, outs)

    def exact(orders: Mapping[int, tuple[int, ...]]) -> bool:
        for d, mesh_dims in orders.items():
            ins, outs = group_of[d]
            if len(ins) == 1 and len(outs) == 1:
                continue  # the dim itself, unchanged
            inner_in = math.prod(in_shape[k] for k in ins[1:])
            inner_out = math.prod(out_shape[k] for k in outs[1:])
            got = local_sizes(in_shape[d], mesh_shape, mesh_dims)
            want = local_sizes(out_shape[outs[0]], mesh_shape, mesh_dims)
            for (s_in, n_in), (s_out, n_out) in zip(got, want):
                if n_in * inner_in != n_out * inner_out or (n_in and s_in * inner_in != s_out * inner_out):
                    return False
        return True

    return dim_map, exact


@register_op_strategy([aten.view.default, aten._unsafe_view.default, aten.reshape.default], kind=OpKind.VIEW)
def view_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    out_shape = out_meta(schema).shape
    dim_map, exact = _view_plan(spec.shape, out_shape, spec.mesh.shape)
    return single_input_strategy(spec, dim_map, shape_arg=1, check=exact)


@register_op_strategy(aten.expand.default, kind=OpKind.VIEW)
def expand_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    out_shape = out_meta(schema).shape
    lead = len(out_shape) - spec.ndim
    # A broadcast dim (1 -> n) cannot stay split: rank 0 would hold the one row, others none.
    dim_map = {d: d + lead for d in range(spec.ndim) if spec.shape[d] == out_shape[d + lead]}
    return single_input_strategy(spec, dim_map, shape_arg=1)


# -- permutations ------------------------------------------------------------------------


def _permutation(schema: OpSchema, perm: Sequence[int]) -> OpStrategy:
    """Output dim k is input dim perm[k]: every dim survives, so no candidate moves data."""
    return single_input_strategy(input_spec(schema), {d: k for k, d in enumerate(perm)})


@register_op_strategy(aten.permute.default, kind=OpKind.VIEW)
def permute_strategy(schema: OpSchema) -> OpStrategy:
    ndim = input_spec(schema).ndim
    return _permutation(schema, [normalize_dim(d, ndim) for d in schema.arg(1, "dims")])


# transposes that name their two dims (t and t_ swap dims 0 and 1)
_TRANSPOSE_DIMS = {aten.transpose.int, aten.transpose_.default, aten.transpose_copy.int}


@register_op_strategy([aten.transpose.int, aten.t.default, aten.transpose_.default, aten.t_.default], kind=OpKind.VIEW,
                      relayout=[aten.transpose_.default, aten.t_.default])
def transpose_strategy(schema: OpSchema) -> OpStrategy:
    ndim = input_spec(schema).ndim
    perm = list(range(ndim))
    if ndim >= 2:
        d0, d1 = (schema.arg(1, "dim0"), schema.arg(2, "dim1")) if schema.op in _TRANSPOSE_DIMS else (0, 1)
        d0, d1 = normalize_dim(d0, ndim), normalize_dim(d1, ndim)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permutation(schema, perm)


@register_op_strategy(aten.alias.default, kind=OpKind.VIEW)
def alias_strategy(schema: OpSchema) -> OpStrategy:
    return _permutation(schema, range(input_spec(schema).ndim))


# -- size-1 dims -------------------------------------------------------------------------


@register_op_strategy([aten.unsqueeze.default, aten.unsqueeze_.default], kind=OpKind.VIEW, relayout=[aten.unsqueeze_.default])
def unsqueeze_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    new = normalize_dim(schema.arg(1, "dim"), spec.ndim + 1)
    return single_input_strategy(spec, {d: d + (d >= new) for d in range(spec.ndim)})


def _squeezed(schema: OpSchema, ndim: int) -> tuple[int, ...]:
    """The dims the op may squeeze (it removes those of global size 1)."""
    if ndim == 0 or schema.op in (aten.squeeze.default, aten.squeeze_.default, aten.squeeze_copy.default):
        return tuple(range(ndim))  # a 0-dim tensor accepts dim 0 or -1 and stays as it is
    dims: Any = schema.arg(1, "dim")
    return tuple(normalize_dim(d, ndim) for d in ([dims] if isinstance(dims, int) else dims))


@register_op_strategy([
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims,
], kind=OpKind.VIEW, relayout=[aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims])
def squeeze_strategy(schema: OpSchema) -> OpStrategy:
    """Squeeze runs locally, where it removes every *local* size-1 dim it may touch: a split
    dim whose piece is 1 on some rank (4 rows on 4 ranks) must not be split then."""
    spec = input_spec(schema)
    shape, mesh_shape = spec.shape, spec.mesh.shape
    candidates = _squeezed(schema, spec.ndim)
    gone = {d for d in candidates if shape[d] == 1}
    kept = [d for d in range(spec.ndim) if d not in gone]
    dim_map = {d: k for k, d in enumerate(kept)}

    def exact(orders: Mapping[int, tuple[int, ...]]) -> bool:
        return not any(
            d in candidates and any(n == 1 for _, n in local_sizes(shape[d], mesh_shape, ms))
            for d, ms in orders.items()
        )

    return single_input_strategy(spec, dim_map, check=exact)
