"""Strategies for NN ops: embedding, nll_loss, CPU flash attention, dropout and pooling,
forward and backward, plus the masked local computations a vocab-sharded embedding and a
batch-sharded mean loss need.

| op | runs split by | output |
|---|---|---|
| embedding | ids (weight R) / embedding dim (weight S(1)) / vocab (weight S(0), ids R) | ids' split / S(last) / P(sum) |
| embedding_dense_backward | ids + grad / grad's last dim / nothing (vocab) | P(sum) / S(1) / S(0) |
| nll_loss(2d)_forward | samples (self and target alike) | none: split like target; sum: P(sum); mean: P(sum), target R |
| flash attention (CPU) | batch, heads; query rows when not causal | split alike; the key/value grads of split query rows are P(sum) |
| native_dropout_backward | any dim (the forward's strategy lives with the random ops) | split alike |
| pooling | batch and channel dims (spatial dims whole) | split alike; avg pools keep P(sum)/P(avg) |
| activations aten leaves untagged (hardswish, *_backward, glu) | any dim (glu: not its halved dim) | split alike; backwards keep a P(sum)/P(avg) gradient |

SDPA reaches the CPU flash kernel only without dropout (with dropout it decomposes to the
math path), and the kernel refuses empty head or row pieces, so candidates that would give a
rank one are dropped; the pooling kernels likewise refuse an empty channel piece.

Three candidates cannot be run as the plain aten op on the local pieces, because ids and
targets are global while the rank holds a slice: a vocab-sharded lookup masks the ids
outside the rank's vocab rows (`embedding_local`), its backward accumulates only those rows
(`embedding_backward_local`), and a mean loss over split samples divides the local sum by
the total weight of all samples (`nll_loss_local`). The tensor layer runs these in place of
the aten op and says so with `use_masked_local`; until it has, those candidates are not
offered, so an op never runs a computation that would be silently wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._index import Args, Option, broadcast_shards, combine
from ._reduction import pieces_fit
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy

__all__ = [
    "MASKED_LOCAL_OPS",
    "use_masked_local",
    "embedding_local",
    "embedding_backward_local",
    "nll_loss_local",
]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
_LINEAR = ("sum", "avg")  # Partials a linear op keeps

# Ops with candidates that need a masked local computation instead of the aten op.
MASKED_LOCAL_OPS = (
    aten.embedding.default,
    aten.embedding_dense_backward.default,
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
)
_MASKED: set[Any] = set()


def use_masked_local(ops: Iterable[Any]) -> None:
    """Declare that the tensor layer runs the masked local computation for these ops."""
    _MASKED.update(ops)


def _masked(op: Any) -> bool:
    return op in _MASKED


def _linear_partial(a: Args, name: str, i: int) -> Optional[Partial]:
    p = a.partial(name, i)
    return p if p is not None and p.reduce_op in _LINEAR else None


# -- embedding ---------------------------------------------------------------------------------


@register_op_strategy(aten.embedding.default)
def _embedding_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    ids = a.spec("indices")
    out_ndim = len(schema.output_meta().shape)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(k),), {"indices": Shard(k)}) for k in range(ids.ndim if ids is not None else 0)]
        opts.append(a.opt((Shard(out_ndim - 1),), {"weight": Shard(1)}))
        if _masked(schema.op):
            opts.append(a.opt((SUM,), {"weight": Shard(0)}))  # each rank looks up its vocab rows
        p = a.partial("weight", i)
        if p is not None:
            opts.append(a.opt((p,), {"weight": p}))  # a lookup selects: every Partial survives
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.embedding_dense_backward.default)
def _embedding_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    grad = a.need("grad_output")
    ids = a.spec("indices")
    by_freq = bool(schema.arg(4, "scale_grad_by_freq", False))
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = []
        # The weight is not an input here, so its layout is guessed from the gradient's: a
        # replicated gradient is what a vocab-split lookup (P(sum) output) gets back, so it
        # lands on vocab rows; any split of it is kept as it is.
        vocab = _masked(schema.op)
        if not (vocab and isinstance(grad.placements[i], Replicate)):
            if ids is not None and not by_freq:  # frequencies must count every id, not a share
                opts += [a.opt((SUM,), {"grad_output": Shard(k), "indices": Shard(k)}) for k in range(ids.ndim)]
            opts.append(a.opt((Shard(1),), {"grad_output": Shard(grad.ndim - 1)}))
        if vocab:
            opts.append(a.opt((Shard(0),), {}))  # each rank accumulates its own vocab rows
        p = _linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


def _rows(spec: DTensorSpec, coordinate: Sequence[int]) -> tuple[int, int]:
    """(first row, row count) of dim 0 held at `coordinate`."""
    shape, offset = spec.local_shape_and_offset(coordinate)
    return offset[0], shape[0]


def embedding_local(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], weight_spec: DTensorSpec, coordinate: Sequence[int]
) -> torch.Tensor:
    """`aten.embedding` on one rank's weight piece with global ids: where the piece holds only
    rows [start, start + n) of the vocab, ids outside it read zeros (the other ranks' terms of
    the P(sum) output supply them)."""
    weight, ids = args[0], args[1]
    start, n = _rows(weight_spec, coordinate)
    if n == weight_spec.shape[0]:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    inside = (ids >= start) & (ids < start + n)
    if n == 0:
        return weight.new_zeros((*ids.shape, weight.shape[1]))  # type: ignore[no-any-return]
    out = func(weight, torch.where(inside, ids - start, 0), *args[2:], **kwargs)  # (*ids, D)
    return out.masked_fill(~inside.unsqueeze(-1), 0)  # type: ignore[no-any-return]


def embedding_backward_local(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], out_spec: DTensorSpec, coordinate: Sequence[int]
) -> torch.Tensor:
    """`aten.embedding_dense_backward` for one rank's rows [start, start + n) of the weight
    gradient: ids outside them go to a spare row that is dropped."""
    grad, ids, num_weights, padding_idx, by_freq = args[:5]
    start, n = _rows(out_spec, coordinate)
    if n == num_weights:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    inside = (ids >= start) & (ids < start + n)
    local = torch.where(inside, ids - start, n)
    pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + n else -1
    return func(grad, local, n + 1, pad, by_freq)[:n]  # type: ignore[no-any-return]


# -- embedding_bag -----------------------------------------------------------------------------
# Outputs (out, offset2bag, bag_size, max_indices): with the weight split by columns each
# rank pools its columns of every bag; which rows a bag reads, and its max row per column,
# do not depend on the split, so the index outputs come out the same on every rank (max
# mode's max_indices is per column: split like the output).

_EMBEDDING_BAGS = [aten._embedding_bag.default, aten._embedding_bag_forward_only.default]


@register_op_strategy(_EMBEDDING_BAGS)
def _embedding_bag_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    per_column = len(schema.output_meta()[3].shape) == 2
    out = (Shard(1), R, R, Shard(1) if per_column else R)
    return _columns_fit(a, "weight", combine(a, [[a.opt(out, {"weight": Shard(1)})]] * a.mesh_ndim, n_outputs=4))


@register_op_strategy([aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default])
def _embedding_bag_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    per_column = a.need("maximum_indices").ndim == 2
    ins = {"grad": Shard(1), "maximum_indices": Shard(1)} if per_column else {"grad": Shard(1)}
    return _columns_fit(a, "grad", combine(a, [[a.opt((Shard(1),), ins)]] * a.mesh_ndim))


def _columns_fit(a: Args, name: str, strategy: OpStrategy) -> OpStrategy:
    """The CPU embedding_bag kernels fail on a rank holding no columns: no such candidate."""
    spec, k = a.need(name), a.pos(name)
    assert k is not None
    kept = [c for c in strategy.strategies
            if (lay := c.input_specs[k]) is None or pieces_fit(spec, lay, [1], nonempty=True, even=False)]
    return OpStrategy(kept)


# -- nll_loss ----------------------------------------------------------------------------------

_NONE, _MEAN, _SUM = 0, 1, 2


def _class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _sample_dims(ndim: int) -> list[tuple[int, int]]:
    """(self dim, target dim) of every dim but the class dim."""
    c = _class_dim(ndim)
    return [(d, d if d < c else d - 1) for d in range(ndim) if d != c]


@register_op_strategy([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default])
def _nll_loss_forward_strategy(schema: OpSchema) -> OpStrategy:
    # The class dim is whole (a vocab-parallel loss is a different op). Samples may be split:
    # none -> each rank its losses; sum -> P(sum) of loss and total weight; mean -> the
    # masked local computation divides by the total weight of all samples (target R).
    a = Args(schema)
    me = a.need("self")
    reduction = int(schema.arg(3, "reduction", _MEAN))
    per_dim = []
    for i in range(a.mesh_ndim):
        opts: list[Option] = []
        for d, t in _sample_dims(me.ndim):
            if reduction == _NONE:
                opts.append(a.opt((Shard(t), R), {"self": Shard(d), "target": Shard(t)}))
            elif reduction == _SUM:
                opts.append(a.opt((SUM, SUM), {"self": Shard(d), "target": Shard(t)}))
            elif _masked(schema.op):
                opts.append(a.opt((SUM, R), {"self": Shard(d)}))
        p = _linear_partial(a, "self", i)
        if p is not None:
            opts.append(a.opt((p, R), {"self": p}))  # linear in the log-probabilities
        per_dim.append(opts)
    return combine(a, per_dim, n_outputs=2)


@register_op_strategy([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default])
def _nll_loss_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    reduction = int(schema.arg(4, "reduction", _MEAN))
    per_dim = []
    for i in range(a.mesh_ndim):
        opts: list[Option] = []
        for d, t in _sample_dims(me.ndim):
            ins: dict[str, Placement] = {"self": Shard(d), "target": Shard(t)}
            if reduction == _NONE:
                ins["grad_output"] = Shard(t)
            opts.append(a.opt((Shard(d),), ins))  # a mean divides by the (replicated) total weight
        p = _linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p, "self": a.shape_only("self", i)}))
        per_dim.append(opts)
    tw = a.pos("total_weight")
    free = [tw] if tw is not None and reduction != _MEAN else []  # read only by a mean
    return combine(a, per_dim, free=free)


def _total_weight(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(dtype)
    return (weight[torch.where(keep, target, 0)] * keep).sum().to(dtype)


def nll_loss_local(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], self_spec: DTensorSpec, target_spec: DTensorSpec,
    coordinate: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.nll_loss(2d)_forward` on one rank's samples. For a mean over samples split across
    ranks while the target is whole: this rank's share of the loss sum divided by the total
    weight of every sample, so the P(sum) of the outputs is the global mean."""
    me, target, weight, reduction, ignore_index = args[:5]
    shape, offset = self_spec.local_shape_and_offset(coordinate)
    dims = _sample_dims(self_spec.ndim)
    whole_target = tuple(target.shape) == tuple(target_spec.shape)
    if reduction != _MEAN or not whole_target or all(shape[d] == self_spec.shape[d] for d, _ in dims):
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    piece = target
    for d, t in dims:
        piece = piece.narrow(t, offset[d], shape[d])
    part, _ = func(me, piece, weight, _SUM, ignore_index)
    total = _total_weight(target, weight, ignore_index, me.dtype)
    return part / total, total


# -- attention (CPU flash kernel) ----------------------------------------------------------------


def _mask_dim(mask: Optional[DTensorSpec], d: int, size: int, ndim: int) -> dict[str, Placement]:
    """attn_mask broadcasts against (B, H, L, S): split it along with output dim d where it
    has that dim at full size, else keep it whole."""
    if mask is None:
        return {}
    md = d - (ndim - mask.ndim)
    return {"attn_mask": Shard(md) if md >= 0 and mask.shape[md] == size and size != 1 else R}


def _attention_options(a: Args, q: DTensorSpec, causal: bool, grads: bool, i: int) -> list[Option]:
    """Per mesh dim: batch / heads split everywhere; query rows split (not causal: a causal
    mask is aligned to global positions) with keys and values whole."""
    k, v, mask = a.spec("key"), a.spec("value"), a.spec("attn_mask")
    n = q.ndim
    rows = ("grad_out", "query", "out", "logsumexp") if grads else ("query",)
    opts: list[Option] = []
    for d in range(n - 2):
        if all(t is not None and t.shape[d] == q.shape[d] for t in (k, v)):
            ins: dict[str, Placement] = {name: Shard(d) for name in rows + ("key", "value")}
            ins.update(_mask_dim(mask, d, q.shape[d], n))
            opts.append(a.opt((Shard(d),) * (3 if grads else 2), ins))
    if not causal:
        ins = {name: Shard(n - 2) for name in rows}
        ins.update(_mask_dim(mask, n - 2, q.shape[n - 2], n))
        # each rank's query rows see every key: their key/value gradients are terms of a sum
        outs = (Shard(n - 2), SUM, SUM) if grads else (Shard(n - 2), Shard(n - 2))
        opts.append(a.opt(outs, ins))
    if grads:
        p = _linear_partial(a, "grad_out", i)
        if p is not None:
            opts.append(a.opt((p, p, p), {"grad_out": p}))  # every gradient is linear in grad_out
    else:
        p = _linear_partial(a, "value", i)
        if p is not None:
            opts.append(a.opt((p, R), {"value": p}))  # softmax(q k^T) v is linear in v
    return opts


def _piece_sizes(size: int, parts: Sequence[int]) -> set[int]:
    """Every piece size a dim of `size` gets when split by mesh dims of `parts` ranks in turn
    (torch.chunk sizes: ceil, trailing pieces may be empty)."""
    sizes = {size}
    for n in parts:
        found: set[int] = set()
        for x in sizes:
            c = -(-x // n)
            full, rest = (x // c, x % c) if c else (0, 0)
            found |= {c} if full else set()
            found |= {rest} if rest else set()
            found |= {0} if full + (rest > 0) < n else set()
        sizes = found
    return sizes


def _leaves_empty(spec: DTensorSpec, layout: Optional[Layout], dims: Iterable[int]) -> bool:
    """Whether `layout` gives some rank an empty piece along one of `dims`."""
    if layout is None:
        return False
    split: dict[int, list[int]] = {}
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            split.setdefault(p.dim, []).append(spec.mesh.shape[m])
    return any(0 in _piece_sizes(spec.shape[d], split[d]) for d in dims if d in split)


def without_empty_pieces(strategy: OpStrategy, a: Args, guarded: dict[str, Iterable[int]]) -> OpStrategy:
    """Drop the candidates that give some rank an empty piece of an input along a dim its
    CPU kernel refuses to be empty (flash attention: heads and rows; pooling: channels)."""
    checks = [(k, tuple(dims)) for name, dims in guarded.items() if (k := a.pos(name)) is not None]
    strategy.strategies = [c for c in strategy.strategies
                           if not any(_leaves_empty(a.specs[k], c.input_specs[k], dims) for k, dims in checks)]
    return strategy


def _attention_strategy(a: Args, causal: bool, grads: bool) -> OpStrategy:
    q = a.need("query")
    per_dim = [_attention_options(a, q, causal, grads, i) for i in range(a.mesh_ndim)]
    strategy = combine(a, per_dim, n_outputs=3 if grads else 2)
    # the CPU flash kernel dies (SIGFPE) on an empty head or row piece; empty batches are fine
    return without_empty_pieces(strategy, a, {name: range(1, q.ndim) for name in ("query", "key", "value")})


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_attention_strategy(schema: OpSchema) -> OpStrategy:
    return _attention_strategy(Args(schema), bool(schema.arg(4, "is_causal", False)), grads=False)


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_attention_backward_strategy(schema: OpSchema) -> OpStrategy:
    return _attention_strategy(Args(schema), bool(schema.arg(7, "is_causal", False)), grads=True)


# -- dropout -----------------------------------------------------------------------------------


@register_op_strategy(aten.native_dropout_backward.default)
def _native_dropout_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    g = a.need("grad_output")
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"grad_output": Shard(d), "mask": Shard(d)}) for d in range(g.ndim)]
        p = _linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


# -- pooling -----------------------------------------------------------------------------------

# op -> number of spatial dims (the trailing dims that must stay whole)
_AVG_POOLS = {aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
              aten._adaptive_avg_pool2d.default: 2, aten._adaptive_avg_pool3d.default: 3}
_MAX_POOLS = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
              aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3}
_AVG_POOL_BACKWARDS = {aten.avg_pool2d_backward.default: 2, aten.avg_pool3d_backward.default: 3,
                       aten._adaptive_avg_pool2d_backward.default: 2, aten._adaptive_avg_pool3d_backward.default: 3}
_MAX_POOL_BACKWARDS = {aten.max_pool2d_with_indices_backward.default: 2, aten.max_pool3d_with_indices_backward.default: 3,
                       aten.adaptive_max_pool2d_backward.default: 2, aten.adaptive_max_pool3d_backward.default: 3}


def _leading_dims(spec: DTensorSpec, spatial: int) -> range:
    """Batch and channel dims: everything before the spatial dims."""
    return range(max(spec.ndim - spatial, 0))


def _non_batch_dims(spec: DTensorSpec, spatial: int) -> range:
    """The CPU pooling kernels accept an empty batch, not an empty channel (or spatial) dim."""
    return range(1 if spec.ndim == spatial + 2 else 0, spec.ndim)


@register_op_strategy(list(_AVG_POOLS) + list(_MAX_POOLS))
def _pool_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    x = a.need("self")
    with_indices = schema.op in _MAX_POOLS
    spatial = _MAX_POOLS[schema.op] if with_indices else _AVG_POOLS[schema.op]
    n_out = 2 if with_indices else 1
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),) * n_out, {"self": Shard(d)}) for d in _leading_dims(x, spatial)]
        p = _linear_partial(a, "self", i)
        if p is not None and not with_indices:
            opts.append(a.opt((p,), {"self": p}))  # an average of windows is linear
        per_dim.append(opts)
    return without_empty_pieces(combine(a, per_dim, n_outputs=n_out), a, {"self": _non_batch_dims(x, spatial)})


@register_op_strategy(list(_AVG_POOL_BACKWARDS) + list(_MAX_POOL_BACKWARDS))
def _pool_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    x = a.need("self")
    spatial = {**_AVG_POOL_BACKWARDS, **_MAX_POOL_BACKWARDS}[schema.op]
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"grad_output": Shard(d), "self": Shard(d), "indices": Shard(d)})
                for d in _leading_dims(x, spatial)]
        p = _linear_partial(a, "grad_output", i)
        if p is not None:  # linear in the gradient; self gives only the shape
            opts.append(a.opt((p,), {"grad_output": p, "self": a.shape_only("self", i)}))
        per_dim.append(opts)
    return without_empty_pieces(combine(a, per_dim), a, {"self": _non_batch_dims(x, spatial)})


# -- activations aten does not tag pointwise ---------------------------------------------------

# elementwise in every tensor argument; the backwards are linear in grad_output
_ACTIVATION_BACKWARDS = [
    aten.hardtanh_backward.default, aten.leaky_relu_backward.default, aten.elu_backward.default,
    aten.softplus_backward.default, aten.hardsigmoid_backward.default, aten.hardswish_backward.default,
    aten.mish_backward.default, aten.log_sigmoid_backward.default, aten.softshrink_backward.default,
    aten.hardshrink_backward.default, aten.rrelu_with_noise_backward.default,
]


@register_op_strategy([aten.hardswish.default, aten.log_sigmoid_forward.default] + _ACTIVATION_BACKWARDS)
def _activation_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    meta = schema.output_meta()
    metas: tuple[TensorMeta, ...] = (meta,) if isinstance(meta, TensorMeta) else tuple(meta)
    shape = metas[0].shape
    tensors = {name: a.spec(name) for name in a.names()}
    # the incoming gradient is the first argument (grad_output, or grad_out for hardshrink)
    grad = schema.op._schema.arguments[0].name if schema.op in _ACTIVATION_BACKWARDS else None
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = []
        for outs, ins in broadcast_shards(shape, tensors, a):
            # a second output (log_sigmoid's buffer) is split alike when it has the same shape
            extra = tuple(outs[0] if m.shape == shape else R for m in metas[1:])
            opts.append((outs + extra, ins))
        p = None if grad is None else _linear_partial(a, grad, i)
        if grad is not None and p is not None:
            opts.append(a.opt((p,), {grad: p}))
        per_dim.append(opts)
    return combine(a, per_dim, n_outputs=len(metas))


@register_op_strategy([aten.glu.default, aten.glu_backward.default])
def _glu_strategy(schema: OpSchema) -> OpStrategy:
    # glu halves `dim` into value and gate: that dim stays whole, the others may be split
    a = Args(schema)
    me = a.need("self")
    backward = schema.op is aten.glu_backward.default
    dim = int(schema.arg(2 if backward else 1, "dim", -1)) % max(me.ndim, 1)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(d),), {"self": Shard(d), "grad_output": Shard(d)}) for d in range(me.ndim) if d != dim]
        p = _linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p}))
        per_dim.append(opts)
    return combine(a, per_dim)
