"""Strategies for a tail of ops: the `*_copy` views, select/slice scatter, scatter with a
reduce mode, pixel / channel shuffles, im2col / col2im, and a few single ops.

These ops behave like ops handled elsewhere, so most strategies here reuse those: a
`*_copy` view places its output exactly like the view it copies (its argument positions
are the same), `_safe_softmax` is softmax, `polar` is pointwise. They are thin wrappers,
so each family's registry tests see only the ops registered in their own module.

The others follow one rule: the dims the op moves data along (or reads with global
positions) stay whole, the rest keep their shards, split alike on every input.

| op | dims that keep their Shard | Partial kept |
|---|---|---|
| select_scatter, slice_scatter | all but `dim` (self and src alike) | self and src the same (an overwrite) |
| scatter.reduce / value_reduce | all but `dim` (self, index, src alike) | add: src version sum/avg, value version avg; multiply by a value: sum/avg |
| pixel_shuffle, pixel_unshuffle | the leading (batch) dims | any (data movement) |
| channel_shuffle | all but the channel dim 1 | any |
| im2col, col2im | the batch dim 0 of a batched input | im2col any (zero padding); col2im sum/avg (adds overlaps) |
| _prelu_kernel (+ backward) | broadcast-free dims, inputs alike | none (backward: none) |
| trace | none | sum/avg (linear) |
| renorm | `dim` (each slice is normalized by its own norm) | none |
| is_same_size | every layout (global shapes compared; a plain tensor beside it is fine) | any |

narrow_copy and split_with_sizes_copy never keep a Shard on their dim, even when they
take it whole: unlike `slice`, whose bounds clamp, they would ask a smaller local piece
for the global length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .._placement import Shard
from ._args import Args, Option, broadcast_shards, combine
from ._index import scatter_options
from ._nn import without_empty_pieces
from ._norm import _softmax_strategy
from ._pointwise import pointwise_strategy
from ._registry import register_op_strategy
from .._spec import TensorMeta
from ._local import LocalCall
from ._schema import OpSchema, OpStrategy, PlacementStrategy, StrategyType
from ._shape import unbind_strategy, unfold_strategy
from ._utils import current, normalize_dim
from ._view import input_spec, out_meta, single_input_strategy
from ._view import permute_strategy, squeeze_strategy, transpose_strategy, unsqueeze_strategy, view_strategy

__all__: list[str] = []

aten = torch.ops.aten
_ANY = ("sum", "avg", "max", "min")
_LINEAR = ("sum", "avg")


def _keep_all_but(ndim: int, touched: Sequence[int]) -> dict[int, int]:
    return {d: d for d in range(ndim) if d not in touched}


def _output_count(schema: OpSchema) -> int:
    metas = schema.output_meta()
    if isinstance(metas, TensorMeta) or not isinstance(metas, tuple):
        raise TypeError(f"{schema.op} was expected to return a list of tensors, got {metas!r}")
    return len(metas)


# -- view copies ---------------------------------------------------------------------------


@register_op_strategy(aten.view_copy.default)
def _view_copy_strategy(schema: OpSchema) -> StrategyType:
    return view_strategy(schema)  # size at arg 1, rewritten per rank like view's


@register_op_strategy(aten.t_copy.default)
def _t_copy_strategy(schema: OpSchema) -> StrategyType:
    return transpose_strategy(schema)  # any op but transpose.int swaps dims 0 and 1 there


@register_op_strategy(aten.transpose_copy.int)
def _transpose_copy_strategy(schema: OpSchema) -> StrategyType:
    return transpose_strategy(schema)


@register_op_strategy(aten.permute_copy.default)
def _permute_copy_strategy(schema: OpSchema) -> StrategyType:
    return permute_strategy(schema)


@register_op_strategy(aten.unsqueeze_copy.default)
def _unsqueeze_copy_strategy(schema: OpSchema) -> StrategyType:
    return unsqueeze_strategy(schema)


@register_op_strategy([aten.squeeze_copy.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims])
def _squeeze_copy_strategy(schema: OpSchema) -> StrategyType:
    return squeeze_strategy(schema)


@register_op_strategy(aten.unbind_copy.int)
def _unbind_copy_strategy(schema: OpSchema) -> StrategyType:
    return unbind_strategy(schema)


@register_op_strategy(aten.split_with_sizes_copy.default)
def _split_with_sizes_copy_strategy(schema: OpSchema) -> StrategyType:
    spec = input_spec(schema)
    dim = normalize_dim(schema.arg(2, "dim", 0), spec.ndim)
    return single_input_strategy(spec, _keep_all_but(spec.ndim, (dim,)), n_outputs=_output_count(schema))


@register_op_strategy(aten.unfold_copy.default)
def _unfold_copy_strategy(schema: OpSchema) -> StrategyType:
    return unfold_strategy(schema)


@register_op_strategy(aten.narrow_copy.default)
def _narrow_copy_strategy(schema: OpSchema) -> StrategyType:
    spec = input_spec(schema)
    dim = normalize_dim(schema.arg(1, "dim"), spec.ndim)
    return single_input_strategy(spec, _keep_all_but(spec.ndim, (dim,)))


# -- scatters ------------------------------------------------------------------------------


def _overwrite_scatter(schema: OpSchema, dim: int, src_dim: Mapping[int, int]) -> OpStrategy:
    """self's dim `d` split alike with src's dim `src_dim[d]` (same size); a Partial kept
    when self and src share it (every term overwrites its own piece)."""
    a = Args(schema)
    me, src = a.need("self"), a.need("src")
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d), "src": Shard(k)})
                for d, k in src_dim.items() if d != dim and src.shape[k] == me.shape[d]]
        p = a.partial("self", i)
        if p is not None:
            opts.append(a.opt((p,), {"self": p, "src": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.select_scatter.default)
def _select_scatter_strategy(schema: OpSchema) -> OpStrategy:
    ndim = input_spec(schema).ndim
    dim = normalize_dim(schema.arg(2, "dim"), ndim)
    return _overwrite_scatter(schema, dim, {d: d - (d > dim) for d in range(ndim) if d != dim})


@register_op_strategy(aten.slice_scatter.default)
def _slice_scatter_strategy(schema: OpSchema) -> OpStrategy:
    ndim = input_spec(schema).ndim
    dim = normalize_dim(schema.arg(2, "dim", 0), ndim)
    return _overwrite_scatter(schema, dim, {d: d for d in range(ndim)})


_SCATTER_REDUCE_SRC = [aten.scatter.reduce, aten.scatter_.reduce]
_SCATTER_REDUCE_VALUE = [aten.scatter.value_reduce, aten.scatter_.value_reduce]


@register_op_strategy(_SCATTER_REDUCE_SRC + _SCATTER_REDUCE_VALUE)
def _scatter_reduce_mode_strategy(schema: OpSchema) -> OpStrategy:
    """scatter with reduce="add" / "multiply": index positions along `dim` are global."""
    a = Args(schema)
    me = a.need("self")
    dim = normalize_dim(schema.arg(1, "dim"), me.ndim)
    mode = str(schema.arg(4, "reduce"))
    if schema.op in _SCATTER_REDUCE_SRC:
        joint: tuple[str, ...] = _LINEAR if mode == "add" else ()  # self + scattered src
        alone: tuple[str, ...] = ()
    else:
        joint = ()
        # multiplying by a constant is linear; adding it is right once per term only for avg
        alone = ("avg",) if mode == "add" else _LINEAR
    per_dim = [scatter_options(a, i, dim, joint, alone) for i in range(a.mesh_ndim)]
    return combine(a, per_dim)


# -- rearranging images --------------------------------------------------------------------


def _batch_only(schema: OpSchema, batch: Sequence[int], partials: Sequence[str]) -> OpStrategy:
    """One data input ("self") whose dims `batch` keep their shards; other dims Replicate."""
    a = Args(schema)
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d)}) for d in batch]
        p = a.partial("self", i)
        if p is not None and p.reduce_op in partials:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy([aten.pixel_shuffle.default, aten.pixel_unshuffle.default])
def _pixel_shuffle_strategy(schema: OpSchema) -> OpStrategy:
    batch = range(input_spec(schema).ndim - 3)  # (*, C, H, W): * is a batch
    strategy = _batch_only(schema, batch, _ANY)
    if schema.op is aten.pixel_unshuffle.default:
        # torch returns an empty input unchanged, with the wrong (un-unshuffled) shape
        strategy = without_empty_pieces(strategy, Args(schema), {"self": batch})
    return strategy


@register_op_strategy(aten.channel_shuffle.default)
def _channel_shuffle_strategy(schema: OpSchema) -> OpStrategy:
    ndim = input_spec(schema).ndim
    return _batch_only(schema, [d for d in range(ndim) if d != 1], _ANY)  # only channels move


@register_op_strategy(aten.im2col.default)
def _im2col_strategy(schema: OpSchema) -> OpStrategy:
    batched = input_spec(schema).ndim == 4  # (N, C, H, W); (C, H, W) has no batch
    return _batch_only(schema, [0] if batched else [], _ANY)


@register_op_strategy(aten.col2im.default)
def _col2im_strategy(schema: OpSchema) -> OpStrategy:
    batched = input_spec(schema).ndim == 3  # (N, C*k, L); (C*k, L) has no batch
    return _batch_only(schema, [0] if batched else [], _LINEAR)


# -- single ops ----------------------------------------------------------------------------


@register_op_strategy(aten._safe_softmax.default)
def _safe_softmax_strategy(schema: OpSchema) -> StrategyType:
    return _softmax_strategy(schema)  # (self, dim, dtype) like _softmax's (self, dim, half_to_float)


@register_op_strategy(aten.polar.default)
def _polar_strategy(schema: OpSchema) -> StrategyType:
    return pointwise_strategy(schema)


@register_op_strategy(aten._prelu_kernel.default)
def _prelu_strategy(schema: OpSchema) -> OpStrategy:
    """Weight arrives viewed to broadcast against self ((C, 1, 1) for (N, C, H, W))."""
    a = Args(schema)
    out_shape = out_meta(schema).shape
    options = broadcast_shards(out_shape, {"self": a.spec("self"), "weight": a.spec("weight")}, a)
    return combine(a, [options] * a.mesh_ndim)


@register_op_strategy(aten._prelu_kernel_backward.default)
def _prelu_backward_strategy(schema: OpSchema) -> OpStrategy:
    """Both outputs have self's shape (the weight grad is summed afterwards, by sum.dim_IntList)."""
    a = Args(schema)
    shape = a.need("self").shape
    inputs = {name: a.spec(name) for name in ("grad_output", "self", "weight")}
    options = [(tuple(outs) * 2, ins) for outs, ins in broadcast_shards(shape, inputs, a)]
    return combine(a, [options] * a.mesh_ndim, n_outputs=2)


@register_op_strategy(aten.trace.default)
def _trace_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    return combine(a, [[a.opt((p,), {"self": p})] if (p := a.partial("self", i)) is not None
                       and p.reduce_op in _LINEAR else [] for i in range(a.mesh_ndim)])


@register_op_strategy([aten.renorm.default, aten.renorm_.default])
def _renorm_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dim = normalize_dim(schema.arg(2, "dim"), spec.ndim)
    return _batch_only(schema, [dim], ())


def _same_global_size(call: LocalCall) -> bool:
    """`is_same_size`: the global shapes compared (a plain tensor's is its own)."""
    a, b = call.input_specs
    return tuple(a.shape) == tuple(b.shape)


@register_op_strategy(aten.is_same_size.default, local=_same_global_size, plain_as_replicated=True, metadata_only=True)
def is_same_size_strategy(schema: OpSchema) -> StrategyType:
    """Metadata only: nothing moves, and a plain tensor beside a DTensor is fine (its shape is
    all that is read), as in torch."""
    return OpStrategy([PlacementStrategy(None, tuple(current(s) for s in schema.input_specs()))])
