"""Embedding strategies and the masked lookups a vocab-split table needs.

| op | runs split by | output |
|---|---|---|
| embedding | ids (weight R) / embedding dim (weight S(1)) / vocab (weight S(0), ids R) | ids' split / S(last) / P(sum) |
| embedding_dense_backward | ids + grad / grad's last dim / nothing (vocab) | P(sum) / S(1) / S(0) |
| _embedding_bag (fwd, bwd) | the table's columns | S(1) (index outputs R) |

A vocab-split lookup cannot run as the plain aten op on the local pieces, because the ids
are global while the rank holds a slice of the rows: its local implementation masks the
ids outside the rank's rows (`_embedding_local`), and its backward accumulates only those
rows (`_embedding_backward_local`). The rules carry them, so the vocab candidates are
always offered, whatever else has been imported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._placement import Partial, Replicate, Shard
from .._spec import DTensorSpec
from ._args import Args, combine, linear_partial
from ._local import LocalCall
from ._reduction import pieces_fit
from ._registry import register_op_strategy
from ._schema import OpSchema, OpStrategy

__all__: list[str] = []

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")


# -- embedding ---------------------------------------------------------------------------------


def _rows(spec: DTensorSpec, coordinate: Sequence[int]) -> tuple[int, int]:
    """(first row, row count) of dim 0 held at `coordinate`."""
    shape, offset = spec.local_shape_and_offset(coordinate)
    return offset[0], shape[0]


def _embedding_local(call: LocalCall) -> torch.Tensor:
    """`aten.embedding` on one rank's weight piece with global ids: where the piece holds only
    rows [start, start + n) of the vocab, ids outside it read zeros (the other ranks' terms of
    the P(sum) output supply them)."""
    func, args, kwargs = call.func, call.args, call.kwargs
    weight_spec = call.input_specs[0]
    weight, ids = args[0], args[1]
    start, n = _rows(weight_spec, call.coordinate(weight_spec))
    if n == weight_spec.shape[0]:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    inside = (ids >= start) & (ids < start + n)
    if n == 0:
        return weight.new_zeros((*ids.shape, weight.shape[1]))  # type: ignore[no-any-return]
    out = func(weight, torch.where(inside, ids - start, 0), *args[2:], **kwargs)  # (*ids, D)
    return out.masked_fill(~inside.unsqueeze(-1), 0)  # type: ignore[no-any-return]


def _embedding_backward_local(call: LocalCall) -> torch.Tensor:
    """`aten.embedding_dense_backward` for one rank's rows [start, start + n) of the weight
    gradient: ids outside them go to a spare row that is dropped."""
    func, args, kwargs = call.func, call.args, call.kwargs
    out_spec = call.output_spec
    assert isinstance(out_spec, DTensorSpec)
    grad, ids, num_weights, padding_idx, by_freq = args[:5]
    start, n = _rows(out_spec, call.coordinate(out_spec))
    if n == num_weights:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    inside = (ids >= start) & (ids < start + n)
    local = torch.where(inside, ids - start, n)
    pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + n else -1
    return func(grad, local, n + 1, pad, by_freq)[:n]  # type: ignore[no-any-return]


@register_op_strategy(aten.embedding.default, local=_embedding_local)
def _embedding_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    ids = a.spec("indices")
    out_ndim = len(schema.output_meta().shape)
    per_dim = []
    for i in range(a.mesh_ndim):
        opts = [a.opt((Shard(k),), {"indices": Shard(k)}) for k in range(ids.ndim if ids is not None else 0)]
        opts.append(a.opt((Shard(out_ndim - 1),), {"weight": Shard(1)}))
        opts.append(a.opt((SUM,), {"weight": Shard(0)}))  # each rank looks up its vocab rows (`_embedding_local`)
        p = a.partial("weight", i)
        if p is not None:
            opts.append(a.opt((p,), {"weight": p}))  # a lookup selects: every Partial survives
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten.embedding_dense_backward.default, local=_embedding_backward_local)
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
        if not isinstance(grad.placements[i], Replicate):
            if ids is not None and not by_freq:  # frequencies must count every id, not a share
                opts += [a.opt((SUM,), {"grad_output": Shard(k), "indices": Shard(k)}) for k in range(ids.ndim)]
            opts.append(a.opt((Shard(1),), {"grad_output": Shard(grad.ndim - 1)}))
        opts.append(a.opt((Shard(0),), {}))  # each rank accumulates its own vocab rows (`_embedding_backward_local`)
        p = linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p}))
        per_dim.append(opts)
    return combine(a, per_dim)


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
