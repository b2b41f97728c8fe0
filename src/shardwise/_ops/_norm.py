"""Strategies for softmax and the normalization layers (layer, RMS, group and batch norm),
forward and backward.

Each of these normalizes over some dims and is independent along the others, so the
rule is one line: the normalized dims stay whole, every other dim may be sharded.

| op | may be sharded | must be whole | parameter grads |
|---|---|---|---|
| softmax, log_softmax (+ backward) | every dim but `dim` | `dim` | - |
| layer norm, fused RMS norm | the leading (batch) dims | the normalized trailing dims; weight, bias | P(sum) over mesh dims that shard batch dims |
| batch norm, training | channels (dim 1): weight, bias, stats follow as Shard(0) | batch and spatial dims | Shard(0) |
| batch norm, eval | channels, or any batch / spatial dim (stats Replicate) | - | P(sum) over mesh dims that shard batch / spatial dims |
| group norm | - (the op takes N and C as numbers, which a local run would contradict) | everything | - |

Backward ops are linear in the incoming gradient, so a P(sum) / P(avg) gradient passes
straight through them (everything else Replicate) and the reduction happens later, once.

Batch norm in training mode updates `running_mean` / `running_var` in place. Those
tensors must therefore be used where they are: the only candidates offered keep their
layout (Shard(0) on a mesh dim means the channel strategy there, Replicate means
replicated), so every rank updates exactly the statistics it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._reduction import DimMap, Option, build_strategy, pieces_fit
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy
from ._utils import normalize_dim

__all__: list[str] = []

aten = torch.ops.aten

_LINEAR_PARTIALS = ("sum", "avg")


def _tensor_positions(schema: OpSchema) -> list[int]:
    """Op-schema position of each DTensor input, in `input_specs()` order."""
    names = [a.name for a in schema.op._schema.arguments]
    found = [k for k, a in enumerate(schema.args_schema) if isinstance(a, DTensorSpec)]
    found += [names.index(k) for k, v in schema.kwargs_schema if isinstance(v, DTensorSpec)]
    return found


def _row(positions: Sequence[int], outs: Sequence[Optional[Placement]], ins: dict[int, Placement],
         default: Placement = Replicate()) -> Option:
    """An option: output placements, then each present input's placement (by op position)."""
    return tuple(outs) + tuple(ins.get(k, default) for k in positions)


def _present(mask: Sequence[bool], placements: Sequence[Placement]) -> list[Optional[Placement]]:
    """Output placements with None for the outputs the op's `output_mask` turns off."""
    return [p if on else None for on, p in zip(mask, placements)]


def _grad_partial(schema: OpSchema, i: int) -> Optional[Partial]:
    """The incoming gradient's Partial on mesh dim i, if it is one a linear backward keeps."""
    p = schema.args_schema[0].placements[i]
    return p if isinstance(p, Partial) and p.reduce_op in _LINEAR_PARTIALS else None


def _spec(schema: OpSchema, k: int) -> DTensorSpec:
    spec = schema.args_schema[k]
    assert isinstance(spec, DTensorSpec)
    return spec


# -- softmax --------------------------------------------------------------------------------

@register_op_strategy([aten._softmax.default, aten._log_softmax.default])
def _softmax_strategy(schema: OpSchema) -> OpStrategy:
    spec = _spec(schema, 0)
    dim = normalize_dim(schema.arg(1, "dim"), spec.ndim)
    return build_strategy(schema, lambda i: [(Shard(d), Shard(d)) for d in range(spec.ndim) if d != dim])


@register_op_strategy([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default])
def _softmax_backward_strategy(schema: OpSchema) -> OpStrategy:
    spec = _spec(schema, 0)
    dim = normalize_dim(schema.arg(2, "dim"), spec.ndim)

    def options(i: int) -> list[Option]:
        opts: list[Option] = [(Shard(d), Shard(d), Shard(d)) for d in range(spec.ndim) if d != dim]
        p = _grad_partial(schema, i)
        if p is not None:  # y * (g - sum(g * y)) and g - exp(y) * sum(g): linear in g
            opts.append((p, p, Replicate()))
        return opts

    return build_strategy(schema, options)


# -- layer norm and RMS norm ----------------------------------------------------------------

def _batch_dims(schema: OpSchema, input_at: int, shape_at: int) -> range:
    return range(_spec(schema, input_at).ndim - len(schema.args_schema[shape_at]))


def _maps(positions: Sequence[int], per_tensor: Mapping[int, DimMap], n_outputs: int, out_map: DimMap) -> list[DimMap]:
    """One dim map per input (by op position; default: same dims) and per output."""
    return [per_tensor.get(k, _same) for k in positions] + [out_map] * n_outputs


def _same(d: int) -> Optional[int]:
    return d


def _none(d: int) -> Optional[int]:
    return None


@register_op_strategy([aten.native_layer_norm.default, aten._fused_rms_norm.default])
def _layer_norm_strategy(schema: OpSchema) -> OpStrategy:
    # native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
    # _fused_rms_norm(input, normalized_shape, weight?, eps) -> (out, rstd)
    n_out = 3 if schema.op is aten.native_layer_norm.default else 2
    positions = _tensor_positions(schema)
    batch = _batch_dims(schema, 0, 1)
    options = [_row(positions, [Shard(d)] * n_out, {0: Shard(d)}) for d in batch]
    maps = _maps(positions, {2: _none, 3: _none}, n_out, _same)
    return build_strategy(schema, lambda i: options, n_out, maps)


@register_op_strategy([aten.native_layer_norm_backward.default, aten._fused_rms_norm_backward.default])
def _layer_norm_backward_strategy(schema: OpSchema) -> OpStrategy:
    # native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?, mask[3])
    # _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight?, mask[2])
    is_layer = schema.op is aten.native_layer_norm_backward.default
    n_out = 3 if is_layer else 2
    params = (5, 6) if is_layer else (4,)
    positions = _tensor_positions(schema)
    mask = schema.arg(7 if is_layer else 5, "output_mask")
    batch = _batch_dims(schema, 1, 2)

    def options(i: int) -> list[Option]:
        opts = [
            _row(positions, _present(mask, [Shard(d)] + [Partial()] * (n_out - 1)),
                 {k: Shard(d) for k in positions if k not in params})
            for d in batch
        ]
        p = _grad_partial(schema, i)
        if p is not None:
            opts.append(_row(positions, _present(mask, [p] * n_out), {0: p}))
        return opts

    maps = _maps(positions, {k: _none for k in params}, n_out, _same)
    return build_strategy(schema, options, n_out, maps, present=mask)


# -- group norm -------------------------------------------------------------------------------

@register_op_strategy(aten.native_group_norm.default)
def _group_norm_strategy(schema: OpSchema) -> OpStrategy:
    # The op takes N, C and HxW as numbers: any shard would contradict them on a local run.
    return build_strategy(schema, lambda i: [], 3)


@register_op_strategy(aten.native_group_norm_backward.default)
def _group_norm_backward_strategy(schema: OpSchema) -> OpStrategy:
    # (grad_out, input, mean, rstd, weight?, N, C, HxW, group, mask[3])
    positions = _tensor_positions(schema)
    mask = schema.arg(9, "output_mask")

    def options(i: int) -> list[Option]:
        p = _grad_partial(schema, i)
        return [] if p is None else [_row(positions, _present(mask, [p] * 3), {0: p})]

    return build_strategy(schema, options, 3, present=mask)


# -- batch norm -------------------------------------------------------------------------------

def _channel_map(d: int) -> Optional[int]:
    """Input dim -> dim of a per-channel tensor (weight, bias, statistics)."""
    return 0 if d == 1 else None


# op -> (position of `training` or the value it always has, positions of running_mean/var,
#        number of outputs)
_BATCH_NORMS: dict[torch._ops.OpOverload, tuple[object, tuple[int, ...], int]] = {
    aten.native_batch_norm.default: (5, (3, 4), 3),
    aten._native_batch_norm_legit.default: (5, (3, 4), 3),
    aten._native_batch_norm_legit.no_stats: (3, (), 3),
    aten._native_batch_norm_legit_functional.default: (5, (3, 4), 5),
    aten._native_batch_norm_legit_no_training.default: (False, (3, 4), 3),
    # the newer pair: outputs out, save_mean, save_invstd, reserve (empty on CPU)
    aten._batch_norm_with_update.default: (True, (3, 4), 4),
    aten._batch_norm_with_update_functional.default: (True, (3, 4), 6),
    aten._batch_norm_no_update.default: (False, (3, 4), 4),
}
# these return new running statistics instead of updating them in place
_FUNCTIONAL = {aten._native_batch_norm_legit_functional.default, aten._batch_norm_with_update_functional.default}


@register_op_strategy(list(_BATCH_NORMS))
def _batch_norm_strategy(schema: OpSchema) -> OpStrategy:
    training_at, stats, n_out = _BATCH_NORMS[schema.op]
    if isinstance(training_at, bool):
        training = training_at
    else:
        assert isinstance(training_at, int)
        training = bool(schema.arg(training_at, "training"))
    spec = _spec(schema, 0)
    positions = _tensor_positions(schema)
    per_channel = {k: _channel_map for k in positions if k != 0}
    # outputs: out, save_mean, save_invstd (, new running_mean, new running_var)
    maps = _maps(positions, per_channel, 0, _same) + [_same] + [_channel_map] * (n_out - 1)
    channels = _row(positions, [Shard(1)] + [Shard(0)] * (n_out - 1),
                    {k: Shard(1) if k == 0 else Shard(0) for k in positions})
    # in place: running stats are updated where they live, so they may not move
    in_place = training and schema.op not in _FUNCTIONAL
    held = [k for k in stats if k in positions] if in_place else []

    def options(i: int) -> list[Option]:
        if held:
            have = {_spec(schema, k).placements[i] for k in held}
            if have == {Shard(0)}:
                return [channels]
            if have == {Replicate()}:
                return []
            raise _stats_error(schema, held)
        if training:
            return [channels]
        per_dim = [_row(positions, [Shard(d)] + [Replicate()] * (n_out - 1), {0: Shard(d)})
                   for d in range(spec.ndim) if d != 1]
        return [channels] + per_dim

    def accept(layouts: tuple[Layout, ...]) -> bool:
        fits = not training or _no_empty_piece(spec, layouts[0])
        return fits and all(_keeps(schema, positions, layouts, k) for k in held)

    result = build_strategy(schema, options, n_out, maps, accept)
    if not result.strategies:
        raise _stats_error(schema, held)
    return result


def _no_empty_piece(spec: DTensorSpec, layout: Layout) -> bool:
    """The CPU batch norm kernels reject (training forward) or crash on (backward) an empty input."""
    return pieces_fit(spec, layout, range(spec.ndim), nonempty=True, even=False)


def _keeps(schema: OpSchema, positions: Sequence[int], layouts: tuple[Layout, ...], k: int) -> bool:
    spec, lay = _spec(schema, k), layouts[positions.index(k)]
    return lay.placements == spec.placements and lay.shard_order == spec.shard_order


def _stats_error(schema: OpSchema, held: Sequence[int]) -> ValueError:
    names = [schema.op._schema.arguments[k].name for k in held]
    found = ", ".join(f"{n}={_spec(schema, k).layout_str()}" for n, k in zip(names, held))
    return ValueError(
        f"{schema.op} in training mode updates {' and '.join(names)} in place, so they must stay where they "
        f"are, but no sharding fits them ({found}; input {_spec(schema, 0).layout_str()}): give running "
        f"statistics, weight and bias the same layout, each mesh dim Replicate or Shard(0) (channels, "
        f"input Shard(1)), with matching split orders and at least one channel on every rank"
    )


@register_op_strategy([aten.native_batch_norm_backward.default, aten.batch_norm_backward.default])
def _batch_norm_backward_strategy(schema: OpSchema) -> OpStrategy:
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps, mask[3]
    #  (, reserve))
    spec = _spec(schema, 1)
    positions = _tensor_positions(schema)
    train = bool(schema.arg(7, "train" if schema.op is aten.native_batch_norm_backward.default else "update"))
    mask = schema.arg(9, "output_mask")
    activations = (0, 1)
    maps = _maps(positions, {k: _channel_map for k in positions if k not in activations}, 0, _same)
    maps += [_same, _channel_map, _channel_map]
    channels = _row(positions, _present(mask, [Shard(1), Shard(0), Shard(0)]),
                    {k: Shard(1) if k in activations else Shard(0) for k in positions})

    def options(i: int) -> list[Option]:
        opts = [channels]
        if not train:  # statistics are constants: any other dim may be split, parameter grads add up
            opts += [_row(positions, _present(mask, [Shard(d), Partial(), Partial()]), {0: Shard(d), 1: Shard(d)})
                     for d in range(spec.ndim) if d != 1]
        p = _grad_partial(schema, i)
        if p is not None:
            opts.append(_row(positions, _present(mask, [p, p, p]), {0: p}))
        return opts

    return build_strategy(schema, options, 3, maps, lambda layouts: _no_empty_piece(spec, layouts[1]), mask)
