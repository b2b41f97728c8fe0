"""Strategies for shape ops that pick, join or rearrange elements, and their backward ops.

slice/select/narrow, split/chunk/unbind, cat/stack, repeat, flip, roll, tril/triu,
diagonal, rot90, unfold; backward: slice_backward, select_backward, diagonal_backward,
unfold_backward (the others' backward ops are ops of this family again: cat for split,
stack for unbind, select for stack, slice for cat, view + sum for repeat).

The rule of `_view` applies: a dim the op leaves whole keeps its Shard, a dim it indexes,
joins, reverses or shifts with global positions (`x[2:5]`, `roll(1, 0)`, the last two
dims of `tril`) must be Replicate on that mesh dim, since the local op would read the
positions as local ones. Partials pass through (cat / stack make a replicated input
beside a Partial one its terms, free): these ops move elements or write zeros,
and zeros reduce to zero under every reduce op (`unfold_backward`, which adds overlapping
windows, keeps only sum/avg Partials).

| op | dims that keep their Shard |
|---|---|
| slice, narrow, select, split, unbind | all but the indexed dim (slice/split: it too, when untouched) |
| cat, stack | all but the joined dim; every input must agree |
| repeat | dims repeated once |
| flip, roll, rot90, unfold | all but the named dims |
| tril, triu | all but the last two |
| diagonal | all but the two diagonal dims |
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import normalize_dim
from ._view import LINEAR, input_spec, order_like, out_meta, renamed_order, single_input_strategy

__all__: list[str] = []

aten = torch.ops.aten


def _keep_all_but(ndim: int, touched: Sequence[int]) -> dict[int, int]:
    return {d: d for d in range(ndim) if d not in touched}


def _drop(ndim: int, gone: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim when the dims `gone` disappear."""
    kept = [d for d in range(ndim) if d not in gone]
    return {d: k for k, d in enumerate(kept)}


def _output_metas(schema: OpSchema) -> tuple[TensorMeta, ...]:
    metas = schema.output_meta()
    if isinstance(metas, TensorMeta) or not isinstance(metas, tuple):
        raise TypeError(f"{schema.op} was expected to return a list of tensors, got {metas!r}")
    return metas


# -- picking elements ----------------------------------------------------------------------


@register_op_strategy(aten.slice.Tensor)
def slice_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dim = normalize_dim(schema.arg(1, "dim", 0), spec.ndim)
    # A slice that keeps the whole dim (x[:, :]) is the identity on it: local bounds clamp.
    whole = spec.ndim == 0 or out_meta(schema).shape[dim] == spec.shape[dim]
    return single_input_strategy(spec, _keep_all_but(spec.ndim, () if whole else (dim,)))


@register_op_strategy(aten.select.int)
def select_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    return single_input_strategy(spec, _drop(spec.ndim, (normalize_dim(schema.arg(1, "dim"), spec.ndim),)))


@register_op_strategy([aten.split.Tensor, aten.split_with_sizes.default])
def split_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dim = normalize_dim(schema.arg(2, "dim", 0), spec.ndim)
    metas = _output_metas(schema)
    whole = len(metas) == 1 and schema.op is aten.split.Tensor  # split_with_sizes([n]) would ask a local piece for n
    return single_input_strategy(spec, _keep_all_but(spec.ndim, () if whole else (dim,)), n_outputs=len(metas))


@register_op_strategy(aten.unbind.int)
def unbind_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dim = normalize_dim(schema.arg(1, "dim", 0), spec.ndim)
    return single_input_strategy(spec, _drop(spec.ndim, (dim,)), n_outputs=len(_output_metas(schema)))


@register_op_strategy([aten.diagonal.default, aten.diagonal_copy.default])
def diagonal_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    d1 = normalize_dim(schema.arg(2, "dim1", 0), spec.ndim)
    d2 = normalize_dim(schema.arg(3, "dim2", 1), spec.ndim)
    return single_input_strategy(spec, _drop(spec.ndim, (d1, d2)))  # the diagonal is the last output dim


# -- rearranging elements ------------------------------------------------------------------


@register_op_strategy(aten.repeat.default)
def repeat_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    repeats = list(schema.arg(1, "repeats"))
    lead = len(repeats) - spec.ndim
    return single_input_strategy(spec, {d: d + lead for d in range(spec.ndim) if repeats[d + lead] == 1})


@register_op_strategy(aten.flip.default)
def flip_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dims = [normalize_dim(d, spec.ndim) for d in schema.arg(1, "dims")]
    return single_input_strategy(spec, _keep_all_but(spec.ndim, dims))


@register_op_strategy(aten.roll.default)
def roll_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dims = [normalize_dim(d, spec.ndim) for d in schema.arg(2, "dims", ())]
    if not dims:  # rolls the flattened tensor: no dim survives whole
        return single_input_strategy(spec, {})
    # Even a whole turn (shift = size) must not stay split: locally it is no whole turn.
    return single_input_strategy(spec, _keep_all_but(spec.ndim, dims))


@register_op_strategy([aten.tril.default, aten.triu.default])
def triangle_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    return single_input_strategy(spec, _keep_all_but(spec.ndim, (spec.ndim - 2, spec.ndim - 1)))


@register_op_strategy(aten.rot90.default)
def rot90_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    dims = [normalize_dim(d, spec.ndim) for d in schema.arg(2, "dims", (0, 1))]
    return single_input_strategy(spec, _keep_all_but(spec.ndim, dims))


@register_op_strategy(aten.unfold.default)
def unfold_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    if spec.ndim == 0:
        return single_input_strategy(spec, {})
    dim = normalize_dim(schema.arg(1, "dimension"), spec.ndim)
    return single_input_strategy(spec, _keep_all_but(spec.ndim, (dim,)))  # windows: a new last dim


# -- joining -------------------------------------------------------------------------------


def _join_options(
    specs: Sequence[DTensorSpec], real: Sequence[bool], i: int, dim_map: dict[int, int]
) -> list[tuple[Placement, Placement]]:
    """Along mesh dim i: (placement every joined input takes, output placement)."""
    options: list[tuple[Placement, Placement]] = [(Replicate(), Replicate())]
    for spec, ok in zip(specs, real):
        p = spec.placements[i]
        if not ok:
            continue
        found: list[tuple[Placement, Placement]]
        if isinstance(p, Partial):
            found = [(p, p)]  # an input that is not this Partial makes the candidate infeasible
        elif isinstance(p, Shard) and p.dim in dim_map:
            found = [(p, Shard(dim_map[p.dim]))]
        elif isinstance(p, Shard):
            found = [(Shard(d), Shard(o)) for d, o in sorted(dim_map.items())]
        else:
            found = []
        options.extend(f for f in found if f not in options)
    return options


def _join(schema: OpSchema, new_dim: bool) -> OpStrategy:
    tensors = schema.arg(0, "tensors")
    specs = [t for t in tensors if isinstance(t, DTensorSpec)]
    ndim = len(out_meta(schema).shape)
    dim = normalize_dim(schema.arg(1, "dim", 0), ndim)
    in_ndim = ndim - 1 if new_dim else ndim
    dim_map = {d: d + (d >= dim) for d in range(in_ndim)} if new_dim else _keep_all_but(ndim, (dim,))
    # cat skips legacy empty 1-D inputs of another rank: any layout of them is empty locally.
    real = [s.ndim == in_ndim for s in specs]
    ref: Optional[DTensorSpec] = next((s for s, ok in zip(specs, real) if ok), None)
    per_mesh_dim = [_join_options(specs, real, i, dim_map) for i in range(specs[0].mesh.ndim)]
    strategies = []
    for combo in itertools.product(*per_mesh_dim):
        ins = tuple(i for i, _ in combo)
        order = order_like(ins, ref) if ref is not None else ()
        joined = Layout(ins, order)
        out = Layout(tuple(o for _, o in combo), renamed_order(order, dim_map))
        # a replicated input joined with Partial ones becomes their terms for free (the value
        # on one rank, the neutral element elsewhere), as torch's stack of P and R
        strategies.append(PlacementStrategy(out, tuple(joined if ok else None for ok in real),
                                            partialize=tuple(range(len(specs)))))
    return OpStrategy(strategies)


@register_op_strategy(aten.cat.default)
def cat_strategy(schema: OpSchema) -> OpStrategy:
    return _join(schema, new_dim=False)


@register_op_strategy(aten.stack.default)
def stack_strategy(schema: OpSchema) -> OpStrategy:
    return _join(schema, new_dim=True)


# -- backward ops: scatter a gradient into zeros of the input's shape ----------------------
# Argument 1 holds the input's global sizes: `shape_arg` rewrites it to the local ones.


def _grad_and_sizes(schema: OpSchema) -> tuple[DTensorSpec, list[int]]:
    sizes: Any = schema.arg(1, "input_sizes")
    return input_spec(schema), list(sizes)


@register_op_strategy(aten.slice_backward.default)
def slice_backward_strategy(schema: OpSchema) -> OpStrategy:
    grad, sizes = _grad_and_sizes(schema)
    dim = normalize_dim(schema.arg(2, "dim"), len(sizes))
    whole = grad.shape[dim] == sizes[dim]
    return single_input_strategy(grad, _keep_all_but(grad.ndim, () if whole else (dim,)), shape_arg=1)


@register_op_strategy(aten.select_backward.default)
def select_backward_strategy(schema: OpSchema) -> OpStrategy:
    grad, sizes = _grad_and_sizes(schema)
    dim = normalize_dim(schema.arg(2, "dim"), len(sizes))
    return single_input_strategy(grad, {d: d + (d >= dim) for d in range(grad.ndim)}, shape_arg=1)


@register_op_strategy(aten.diagonal_backward.default)
def diagonal_backward_strategy(schema: OpSchema) -> OpStrategy:
    grad, sizes = _grad_and_sizes(schema)
    d1 = normalize_dim(schema.arg(3, "dim1"), len(sizes))
    d2 = normalize_dim(schema.arg(4, "dim2"), len(sizes))
    others = [d for d in range(len(sizes)) if d not in (d1, d2)]
    return single_input_strategy(grad, {k: d for k, d in enumerate(others)}, shape_arg=1)


@register_op_strategy(aten.unfold_backward.default)
def unfold_backward_strategy(schema: OpSchema) -> OpStrategy:
    grad, sizes = _grad_and_sizes(schema)
    dim = normalize_dim(schema.arg(2, "dim"), len(sizes))
    # Overlapping windows are added: only linear Partials pass.
    return single_input_strategy(grad, _keep_all_but(len(sizes), (dim,)), shape_arg=1, partials=LINEAR)
