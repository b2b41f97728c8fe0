"""Strategies for elementwise and margin losses, order statistics (median, kthvalue, mode)
and lookups (searchsorted, isin, take, put, pdist, block_diag, _trilinear).

An elementwise loss is a pointwise op followed by an optional reduction (`reduction`: 0
none, 1 mean, 2 sum), so its inputs may be split alike on any dim of the broadcast shape:

| reduction | output of a split run | backward (grad_input split like self) |
|---|---|---|
| none | split like the inputs | grad_output split alike |
| sum | P(sum) | grad_output whole (0-dim) |
| mean | P(avg), only when every rank holds the same number of elements | no split: the kernel divides by the local count |

Losses are not linear in their inputs, so a Partial input is reduced first; the backwards
are linear in grad_output, so a P(sum)/P(avg) grad_output passes through when everything
else is whole. Margin losses keep their class dim whole and split samples (reduction none
or sum; their backwards have no Meta kernel and fall back). Order statistics keep the reduced dim whole (`reduction_strategy`, which also
offers an all_to_all onto a kept dim); lookups that read global positions run replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .._layout import contiguous_strides
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._args import Args, Option, broadcast_shards, combine
from ._reduction import pieces_fit, reduction_strategy
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import expand_to_mesh, normalize_dim, replicated_strategy

__all__: list[str] = []

aten = torch.ops.aten
R = Replicate()
_NONE, _MEAN, _SUM = 0, 1, 2
_LINEAR = ("sum", "avg")

# forward op -> names of its tensor arguments (in schema order)
_ELEMENTWISE = {
    aten.mse_loss.default: ("self", "target"),
    aten.huber_loss.default: ("self", "target"),
    aten.smooth_l1_loss.default: ("self", "target"),
    aten.soft_margin_loss.default: ("self", "target"),
    aten.binary_cross_entropy.default: ("self", "target", "weight"),
    aten.binary_cross_entropy_with_logits.default: ("self", "target", "weight", "pos_weight"),
}
_ELEMENTWISE_BACKWARD = {
    aten.mse_loss_backward.default: ("self", "target"),
    aten.huber_loss_backward.default: ("self", "target"),
    aten.smooth_l1_loss_backward.default: ("self", "target"),
    aten.soft_margin_loss_backward.default: ("self", "target"),
    aten.binary_cross_entropy_backward.default: ("self", "target", "weight"),
}


def _named(schema: OpSchema, name: str, default: Any) -> Any:
    """Argument `name`, positional or keyword."""
    names = [a.name for a in schema.op._schema.arguments]
    return schema.arg(names.index(name), name, default)


def _reduction(schema: OpSchema) -> int:
    return int(_named(schema, "reduction", _MEAN))


def _broadcast_shape(a: Args, names: Sequence[str]) -> Optional[torch.Size]:
    """The broadcast shape of the named DTensor arguments (absent ones skipped); None if
    they do not broadcast."""
    shapes = [spec.shape for n in names if (spec := a.spec(n)) is not None]
    try:
        return torch.Size(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]
    except RuntimeError:
        return None


def _even(spec_shape: Sequence[int], mesh: Any, placements: tuple[Placement, ...]) -> bool:
    """Whether every rank holds the same number of elements of a tensor of `spec_shape`."""
    meta = TensorMeta(torch.Size(spec_shape), contiguous_strides(spec_shape), torch.float32)
    spec = DTensorSpec(mesh, placements, meta)
    return pieces_fit(spec, Layout(placements), list(range(len(spec_shape))), nonempty=False, even=True)


@register_op_strategy(list(_ELEMENTWISE))
def _elementwise_loss_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    names = _ELEMENTWISE[schema.op]
    reduction = _reduction(schema)
    shape = _broadcast_shape(a, names)
    out_meta = schema.output_meta()
    if shape is None or (reduction == _NONE and out_meta.shape != shape):
        return replicated_strategy(a.specs, a.mesh_ndim)
    # Candidates of the unreduced loss (output split like the broadcast shape) ...
    options = broadcast_shards(shape, {n: a.spec(n) for n in names}, a)
    pointwise = combine(a, [options] * a.mesh_ndim)
    if reduction == _NONE:
        return pointwise
    # ... then reduced: each rank's term of a sum adds up; means average only over equal counts.
    strategies = []
    for s in pointwise.strategies:
        out = s.output_specs
        assert isinstance(out, Layout)
        if reduction == _MEAN and not _even(shape, a.specs[0].mesh, out.placements):
            continue
        kind = Partial("sum" if reduction == _SUM else "avg")
        placed = tuple(kind if isinstance(p, Shard) else p for p in out.placements)
        strategies.append(PlacementStrategy(Layout(placed), s.input_specs))
    return OpStrategy(strategies)


@register_op_strategy(list(_ELEMENTWISE_BACKWARD))
def _elementwise_loss_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    names = _ELEMENTWISE_BACKWARD[schema.op]
    reduction = _reduction(schema)
    me = a.need("self")
    all_names = names + (("grad_output",) if reduction == _NONE else ())
    shape = _broadcast_shape(a, all_names)
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts: list[Option] = []
        # a mean divides by the local count on each rank: never split (1/N_local != 1/N)
        if shape == me.shape and reduction != _MEAN:
            opts += broadcast_shards(shape, {n: a.spec(n) for n in all_names}, a)
        g = a.partial("grad_output", i)
        if g is not None and g.reduce_op in _LINEAR:
            opts.append(a.opt((g,), {"grad_output": g}))  # linear in grad_output
        per_dim.append(opts)
    return combine(a, per_dim)


# -- margin losses: class dim whole, samples split -----------------------------------------


@register_op_strategy([aten.multi_margin_loss.default, aten.multilabel_margin_loss_forward.default])
def _margin_loss_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    reduction = _reduction(schema)
    pair = schema.op is aten.multilabel_margin_loss_forward.default  # (loss, is_target)
    n_out = 2 if pair else 1
    opts: list[Option] = []
    if me.ndim == 2 and reduction in (_NONE, _SUM):
        loss = Shard(0) if reduction == _NONE else Partial("sum")
        outs = (loss, Shard(0)) if pair else (loss,)
        opts.append(a.opt(outs, {"self": Shard(0), "target": Shard(0)}))
    strategy = combine(a, [opts] * a.mesh_ndim, n_outputs=n_out)
    if reduction == _SUM:  # the CPU kernel's sum over an empty batch is uninitialized memory
        strategy.strategies = [s for s in strategy.strategies
                               if s.input_specs[0] is None or pieces_fit(me, s.input_specs[0], [0], True, False)]
    return strategy


# multi_margin_loss_backward / multilabel_margin_loss_backward have no Meta kernel, so the
# propagator cannot describe their outputs: they are left to the replicated fallback.


# -- order statistics ----------------------------------------------------------------------


@register_op_strategy(aten.median.default)
def _replicated(schema: OpSchema) -> OpStrategy:
    specs = schema.input_specs()
    return replicated_strategy(specs, specs[0].mesh.ndim)


# op -> (position of dim, default dim, position of keepdim)
_ORDER_STATS = {aten.median.dim: (1, None, 2), aten.kthvalue.default: (2, -1, 3), aten.mode.default: (1, -1, 2)}


@register_op_strategy(list(_ORDER_STATS))
def _order_statistic_strategy(schema: OpSchema) -> OpStrategy:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dim_at, default, keepdim_at = _ORDER_STATS[schema.op]
    dim = normalize_dim(int(schema.arg(dim_at, "dim", default)), spec.ndim)
    keepdim = bool(schema.arg(keepdim_at, "keepdim", False))
    return reduction_strategy(schema, (dim,), keepdim, (None, None))


# -- lookups -------------------------------------------------------------------------------


@register_op_strategy(aten.searchsorted.Tensor)
def _searchsorted_strategy(schema: OpSchema) -> OpStrategy:
    # Each value of self is looked up in its row of sorted_sequence (the one row when that
    # is 1-D): the searched last dim is whole; leading dims split alike with self.
    a = Args(schema)
    seq, me = a.need("sorted_sequence"), a.spec("self")
    opts: list[Option] = []
    if me is not None:
        for d in range(me.ndim):
            if seq.ndim == 1 or d == me.ndim - 1:
                opts.append(a.opt((Shard(d),), {"self": Shard(d)}))
            elif seq.shape[d] == me.shape[d]:
                opts.append(a.opt((Shard(d),), {"self": Shard(d), "sorted_sequence": Shard(d), "sorter": Shard(d)}))
    return combine(a, [opts] * a.mesh_ndim)


@register_op_strategy(aten.isin.Tensor_Tensor)
def _isin_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    elements = a.spec("elements")
    opts = [] if elements is None else [a.opt((Shard(d),), {"elements": Shard(d)}) for d in range(elements.ndim)]
    return combine(a, [opts] * a.mesh_ndim)


@register_op_strategy(aten.take.default)
def _take_strategy(schema: OpSchema) -> OpStrategy:
    # index holds flat global positions: self whole; the output has index's shape
    a = Args(schema)
    index = a.spec("index")
    opts = [] if index is None else [a.opt((Shard(d),), {"index": Shard(d)}) for d in range(index.ndim)]
    return combine(a, [opts] * a.mesh_ndim)


register_op_strategy([
    aten.put.default, aten.put_.default, aten._pdist_forward.default, aten.block_diag.default,
    aten._trilinear.default,
])(_replicated)


@register_op_strategy(aten.dist.default)
def _dist_strategy(schema: OpSchema) -> OpStrategy:
    """dist(x, y, p) = ||x - y||_p: with x and y split alike, p = 0 or 1 sums local terms
    (P(sum)); other p need the whole tensors (an inf norm of an empty piece raises)."""
    x, y = schema.args_schema[0], schema.args_schema[1]
    assert isinstance(x, DTensorSpec)
    p = float(schema.arg(2, "p", 2.0))
    reduce_as = {0.0: Partial("sum"), 1.0: Partial("sum")}.get(p)
    options: list[tuple[Placement, ...]] = []
    if reduce_as is not None and isinstance(y, DTensorSpec) and y.shape == x.shape:
        options = [(reduce_as, Shard(d), Shard(d)) for d in range(x.ndim)]
    return expand_to_mesh(x.mesh.ndim, options or [(Replicate(), Replicate(), Replicate())])
