"""Strategies for NN ops: CPU flash attention, dropout's backward, pooling and the
activations aten leaves untagged, forward and backward (embedding lives in `_embedding`,
nll_loss in `_nll`).

| op | runs split by | output |
|---|---|---|
| flash attention (CPU) | batch, heads (grouped-query: whole groups per rank); query rows when not causal | split alike; the key/value grads of split query rows are P(sum) |
| native_dropout_backward | any dim (the forward's strategy lives with the random ops) | split alike |
| pooling | batch and channel dims (spatial dims whole) | split alike; avg pools keep P(sum)/P(avg) |
| activations aten leaves untagged (hardswish, *_backward, glu) | any dim (glu: not its halved dim) | split alike; backwards keep a P(sum)/P(avg) gradient |

SDPA reaches the CPU flash kernel only without dropout (with dropout it decomposes to the
math path), and the kernel refuses empty head or row pieces, so candidates that would give a
rank one are dropped; the pooling kernels likewise refuse an empty channel piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._args import Args, Option, broadcast_shards, combine, linear_partial
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy

__all__ = ["without_empty_pieces"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


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
        grouped = d == n - 3 and k is not None and v is not None and _grouped(q, k, v)
        if grouped or all(t is not None and t.shape[d] == q.shape[d] for t in (k, v)):
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
        p = linear_partial(a, "grad_out", i)
        if p is not None:
            opts.append(a.opt((p, p, p), {"grad_out": p}))  # every gradient is linear in grad_out
    else:
        p = linear_partial(a, "value", i)
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


def _grouped(q: DTensorSpec, k: DTensorSpec, v: DTensorSpec) -> bool:
    """Grouped-query attention: fewer key/value heads than query heads, each shared by a group."""
    h = q.ndim - 3
    return k.shape[h] == v.shape[h] and 0 < k.shape[h] < q.shape[h] and q.shape[h] % k.shape[h] == 0


def _groups_aligned(a: Args, strategy: OpStrategy) -> OpStrategy:
    """Keep a head split of grouped-query attention only where every rank holds whole groups:
    the key/value heads split evenly, so rank r's query heads are those its key/value heads serve."""
    q, k, v = a.need("query"), a.spec("key"), a.spec("value")
    kpos = a.pos("key")
    if k is None or v is None or kpos is None or not _grouped(q, k, v):
        return strategy
    h = k.ndim - 3
    kept = []
    for c in strategy.strategies:
        layout = c.input_specs[kpos]
        parts = math.prod(k.mesh.shape[m] for m, p in enumerate(layout.placements) if p == Shard(h)) if layout else 1
        if k.shape[h] % parts == 0:
            kept.append(c)
    strategy.strategies = kept
    return strategy


def _attention_strategy(a: Args, causal: bool, grads: bool) -> OpStrategy:
    q = a.need("query")
    per_dim = [_attention_options(a, q, causal, grads, i) for i in range(a.mesh_ndim)]
    strategy = _groups_aligned(a, combine(a, per_dim, n_outputs=3 if grads else 2))
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
        p = linear_partial(a, "grad_output", i)
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
        p = linear_partial(a, "self", i)
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
        p = linear_partial(a, "grad_output", i)
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
        p = None if grad is None else linear_partial(a, grad, i)
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
        p = linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p}))
        per_dim.append(opts)
    return combine(a, per_dim)
