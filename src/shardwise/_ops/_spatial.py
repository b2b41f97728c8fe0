"""Strategies for padding, spatial resampling and a long tail of ops that would otherwise
run replicated: pads, upsampling, grid sampling, max_unpool, diag_embed, diagonal_scatter,
cdist, bucketize, nanmedian, index_reduce, and a few aliases of ops handled elsewhere.

These ops move data along some tensor dims (the padded, resampled or indexed ones) and
treat the others as a batch. A batch dim keeps its shards (every input that has it split
alike); the dims the op moves data along must be whole (Replicate). Whether a Partial
input passes through depends on what the op does to values:

| op | Partial kept |
|---|---|
| reflection / replication pads, nearest upsampling, max_unpool, diag_embed | any (it selects or places values, zeros elsewhere) |
| constant_pad_nd | any if the pad value is 0, else avg / max / min (every term pads with the value) |
| linear / bilinear / bicubic / trilinear upsampling, grid_sampler (input), pad and upsample backwards | sum, avg (linear in the data) |
| diagonal_scatter | self and src the same Partial (an overwrite) |
| bucketize | max, min (monotone) |
| cdist, nanmedian, index_reduce | none |

Backward ops that take the input's full size as an argument (`upsample_*_backward`'s
`input_size`) get it rewritten per rank (`shape_arg`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .._placement import Partial, Shard
from .._spec import DTensorSpec
from ._args import Args, Option, combine
from ._nn import without_empty_pieces
from ._pointwise import pointwise_strategy
from ._reduction import reduction_strategy
from ._registry import register_op_strategy
from ._schema import OpSchema, OpStrategy, StrategyType
from ._shape import split_strategy
from ._utils import normalize_dim
from ._view import alias_strategy, expand_strategy

__all__ = ["PAD_OPS", "UPSAMPLE_OPS", "UPSAMPLE_BACKWARD_OPS"]

aten = torch.ops.aten
_ANY = ("sum", "avg", "max", "min")
_LINEAR = ("sum", "avg")


def _ops(names: Sequence[str]) -> list[torch._ops.OpOverload]:
    """The overloads among `names` ("packet.overload") this torch build has."""
    found = []
    for name in names:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if isinstance(op, torch._ops.OpOverload):
            found.append(op)
    return found


def _kept(a: Args, name: str, i: int, kinds: Sequence[str]) -> Optional[Partial]:
    """The Partial `name` has on mesh dim i, if the op lets it through."""
    p = a.partial(name, i)
    return p if p is not None and p.reduce_op in kinds else None


def _batch_strategy(
    schema: OpSchema,
    data: str,
    batch: Sequence[int],
    partial_kinds: Sequence[str],
    shape_only: Sequence[str] = (),
    shape_arg: Optional[int] = None,
    batched_ndim: Optional[int] = None,
) -> OpStrategy:
    """One data input whose dims `batch` keep their shards (same dim of the output and of
    every `shape_only` input, which is read for its size only); other dims Replicate.

    `batched_ndim`: the input rank of the batched form of a kernel that refuses empty
    inputs except along the batch dim (None: it takes empty pieces anywhere)."""
    a = Args(schema)
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {data: Shard(d), **{s: Shard(d) for s in shape_only}}) for d in batch]
        p = _kept(a, data, i, partial_kinds)
        if p is not None:
            opts.append(a.opt((p,), {data: p, **{s: a.shape_only(s, i) for s in shape_only}}))
        per_dim.append(opts)
    strategy = combine(a, per_dim, shape_arg=shape_arg)
    return strategy if batched_ndim is None else without_empty_pieces(strategy, a, {data: _nonempty(a.need(data), batched_ndim)})


def _nonempty(spec: DTensorSpec, batched_ndim: int) -> range:
    """Dims a CPU spatial kernel refuses to see empty: all but the batch dim of a batched input."""
    return range(1 if spec.ndim == batched_ndim else 0, spec.ndim)


# -- padding -------------------------------------------------------------------------------


def _unpadded(ndim: int, pad: Sequence[int]) -> list[int]:
    """Dims a pad list (last dim first, (before, after) pairs) leaves alone."""
    padded = {ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] != 0 or pad[2 * k + 1] != 0}
    return [d for d in range(ndim) if d not in padded]


@register_op_strategy(aten.constant_pad_nd.default)
def _constant_pad_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("self")
    pad = list(schema.arg(1, "pad"))
    value = schema.arg(2, "value", 0)
    # every term pads with `value`: avg / max / min of equal values is the value; a sum
    # counts it once per rank, so P(sum) passes only when it is 0
    kinds = _ANY if isinstance(value, (int, float, bool)) and value == 0 else ("avg", "max", "min")
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d)}) for d in _unpadded(spec.ndim, pad)]
        p = _kept(a, "self", i, kinds)
        if p is not None:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


PAD_OPS = _ops([f"{kind}_pad{n}d.default" for kind in ("reflection", "replication") for n in (1, 2, 3)])
_PAD_BACKWARD_OPS = _ops([f"{kind}_pad{n}d_backward.default" for kind in ("reflection", "replication") for n in (1, 2, 3)])


def _batched_pad_ndim(schema: OpSchema) -> int:
    """The input rank of a pad kernel's batched form: reflection_pad2d(_backward) -> 4."""
    return int(schema.op.__name__.split("pad")[1][0]) + 2


@register_op_strategy(PAD_OPS)
def _pad_strategy(schema: OpSchema) -> OpStrategy:
    spec = Args(schema).need("self")
    return _batch_strategy(schema, "self", _unpadded(spec.ndim, list(schema.arg(1, "padding"))), _ANY,
                           batched_ndim=_batched_pad_ndim(schema))


@register_op_strategy(_PAD_BACKWARD_OPS)
def _pad_backward_strategy(schema: OpSchema) -> OpStrategy:
    spec = Args(schema).need("grad_output")
    batch = _unpadded(spec.ndim, list(schema.arg(2, "padding")))
    return _batch_strategy(schema, "grad_output", batch, _LINEAR, shape_only=("self",),
                           batched_ndim=_batched_pad_ndim(schema))


# -- upsampling ----------------------------------------------------------------------------

_NEAREST = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
            "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d")
_INTERPOLATING = ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
                  "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
_NEAREST_OPS = set(_ops([f"{n}.{o}" for n in _NEAREST for o in ("default", "vec")]))
UPSAMPLE_OPS = sorted(_NEAREST_OPS | set(_ops([f"{n}.{o}" for n in _INTERPOLATING for o in ("default", "vec")])), key=str)
UPSAMPLE_BACKWARD_OPS = _ops([f"{n}_backward.default" for n in _NEAREST + _INTERPOLATING])


@register_op_strategy(UPSAMPLE_OPS)
def _upsample_strategy(schema: OpSchema) -> OpStrategy:
    # batch and channel keep their shards; nearest selects values (any Partial), the
    # interpolating modes take weighted sums of them (sum / avg)
    kinds = _ANY if schema.op in _NEAREST_OPS else _LINEAR
    name = schema.op._schema.arguments[0].name  # "self" or "input"
    return _batch_strategy(schema, name, (0, 1), kinds, batched_ndim=Args(schema).need(name).ndim)


@register_op_strategy(UPSAMPLE_BACKWARD_OPS)
def _upsample_backward_strategy(schema: OpSchema) -> OpStrategy:
    # `input_size` (argument 2) is the global input shape: rewritten per rank
    return _batch_strategy(schema, "grad_output", (0, 1), _LINEAR, shape_arg=2)


# -- grid sampling, max_unpool -------------------------------------------------------------


@register_op_strategy(_ops(["grid_sampler_2d.default", "grid_sampler_3d.default"]))
def _grid_sampler_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    a.need("input")
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(0),), {"input": Shard(0), "grid": Shard(0)}),  # samples
                a.opt((Shard(1),), {"input": Shard(1)})]  # channels, one grid for all
        p = _kept(a, "input", i, _LINEAR)  # linear in the input for a fixed grid
        if p is not None:
            opts.append(a.opt((p,), {"input": p}))
        per_dim.append(opts)
    return combine(a, per_dim)  # the kernels take empty pieces


@register_op_strategy(_ops(["grid_sampler_2d_backward.default", "grid_sampler_3d_backward.default"]))
def _grid_sampler_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("input")
    sum_ = Partial("sum")
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(0), Shard(0)), {"grad_output": Shard(0), "input": Shard(0), "grid": Shard(0)}),
                # channels: grad_input by channel; grad_grid sums over channels
                a.opt((Shard(1), sum_), {"grad_output": Shard(1), "input": Shard(1)})]
        p = _kept(a, "grad_output", i, _LINEAR)  # both gradients are linear in grad_output
        if p is not None:
            opts.append(a.opt((p, p), {"grad_output": p}))
        per_dim.append(opts)
    return combine(a, per_dim, n_outputs=2)


@register_op_strategy(_ops(["max_unpool2d.default", "max_unpool3d.default"]))
def _max_unpool_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("self")
    spatial = 2 if schema.op is aten.max_unpool2d.default else 3
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        # indices address positions inside one (sample, channel) plane: leading dims split alike
        opts = [a.opt((Shard(d),), {"self": Shard(d), "indices": Shard(d)}) for d in range(spec.ndim - spatial)]
        p = _kept(a, "self", i, _ANY)  # values placed among zeros
        if p is not None:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return without_empty_pieces(combine(a, per_dim), a, {"self": _nonempty(spec, spatial + 2)})


# -- diagonals -----------------------------------------------------------------------------


@register_op_strategy(aten.diag_embed.default)
def _diag_embed_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("self")
    out_ndim = spec.ndim + 1
    d1 = normalize_dim(schema.arg(2, "dim1", -2), out_ndim)
    d2 = normalize_dim(schema.arg(3, "dim2", -1), out_ndim)
    kept = [d for d in range(out_ndim) if d not in (d1, d2)]  # input dim k -> output dim kept[k]
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(od),), {"self": Shard(k)}) for k, od in enumerate(kept)]
        p = _kept(a, "self", i, _ANY)
        if p is not None:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.diagonal_scatter.default)
def _diagonal_scatter_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("self")
    d1 = normalize_dim(schema.arg(3, "dim1", 0), spec.ndim)
    d2 = normalize_dim(schema.arg(4, "dim2", 1), spec.ndim)
    kept = [d for d in range(spec.ndim) if d not in (d1, d2)]  # self dim kept[k] <-> src dim k
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d), "src": Shard(k)}) for k, d in enumerate(kept)]
        p = a.partial("self", i)
        if p is not None:  # an overwrite: self and src must be the same Partial
            opts.append(a.opt((p,), {"self": p, "src": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


# -- distances, bucketize ------------------------------------------------------------------


@register_op_strategy(aten._cdist_forward.default)
def _cdist_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    x1, x2 = a.need("x1"), a.need("x2")
    n = x1.ndim
    per_dim: list[list[Option]] = []
    for _ in range(a.mesh_ndim):
        opts = [a.opt((Shard(n - 2),), {"x1": Shard(n - 2)}),  # rows of x1
                a.opt((Shard(n - 1),), {"x2": Shard(n - 2)})]  # rows of x2
        if x2.ndim == n:  # batch dims without broadcasting
            opts += [a.opt((Shard(d),), {"x1": Shard(d), "x2": Shard(d)})
                     for d in range(n - 2) if x1.shape[d] == x2.shape[d]]
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.bucketize.Tensor)
def _bucketize_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("self")
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d)}) for d in range(spec.ndim)]
        p = _kept(a, "self", i, ("max", "min"))  # monotone in self
        if p is not None:
            opts.append(a.opt((p,), {"self": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


# -- reductions and index writes -----------------------------------------------------------


@register_op_strategy(aten.nanmedian.default)
def _nanmedian_all_strategy(schema: OpSchema) -> OpStrategy:
    spec = Args(schema).need("self")  # a median over everything: the input whole
    return reduction_strategy(schema, tuple(range(spec.ndim)), False, (None,))


@register_op_strategy(aten.nanmedian.dim)
def _nanmedian_strategy(schema: OpSchema) -> OpStrategy:
    spec = Args(schema).need("self")
    dim = normalize_dim(int(schema.arg(1, "dim", 0)), spec.ndim)
    return reduction_strategy(schema, (dim,), bool(schema.arg(2, "keepdim", False)), (None, None))


@register_op_strategy([aten.index_reduce.default, aten.index_reduce_.default])
def _index_reduce_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    spec = a.need("self")
    source = a.need("source")
    dim = normalize_dim(int(schema.arg(1, "dim")), spec.ndim)
    per_dim: list[list[Option]] = []
    for _ in range(a.mesh_ndim):
        # the indexed dim whole; the others split alike on self and source
        per_dim.append([a.opt((Shard(d),), {"self": Shard(d), "source": Shard(d)})
                        for d in range(spec.ndim) if d != dim and source.ndim == spec.ndim
                        and source.shape[d] == spec.shape[d]])
    return combine(a, per_dim)


# -- ops that behave like ones handled elsewhere -------------------------------------------

# (thin wrappers, so each family's registry tests see only the ops registered in their module)


@register_op_strategy([aten.rsub.Tensor, aten.floor_divide.default, aten.complex.default])
def _elementwise_strategy(schema: OpSchema) -> OpStrategy:
    return pointwise_strategy(schema)


@register_op_strategy(aten.alias_copy.default)
def _alias_copy_strategy(schema: OpSchema) -> StrategyType:
    return alias_strategy(schema)


@register_op_strategy(aten.expand_copy.default)
def _expand_copy_strategy(schema: OpSchema) -> StrategyType:
    return expand_strategy(schema)  # same arguments as expand


@register_op_strategy(aten.unsafe_split.Tensor)
def _unsafe_split_strategy(schema: OpSchema) -> StrategyType:
    return split_strategy(schema)  # same arguments as split
