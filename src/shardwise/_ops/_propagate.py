"""The propagator: from an op call's input specs to the specs its inputs need and its
outputs get. It enumerates the op's strategies, prices each by the redistribute planner's
cost of moving every input to the layout the strategy wants, and keeps the cheapest (ties:
the one that holds fewer bytes per rank). Results are cached per `OpSchema`.

An op without a strategy falls back to running replicated: its inputs are gathered, the
op runs on every rank, the outputs are `Replicate`; a warning names the op once per
process, and strict mode (`set_strict(True)` or env `SHARDWISE_STRICT=1`) makes it an error.
For a few ops replicated execution *is* the strategy (their result is a Python value or has
a data-dependent shape, so every rank must see the whole input): they run the same way,
without a warning, in strict mode too.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch

from .._placement import Partial, Replicate
from .._redistribute import plan_redistribute
from .._spec import DTensorSpec, TensorMeta
from ._registry import get_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, OutputSharding, PlacementStrategy, StrategyType, TupleStrategy

__all__ = ["RELAYOUT_OPS", "REPLICATED_OPS", "propagate", "set_strict", "is_strict", "redistribute_cost", "strategy_calls"]

_CACHE: dict[OpSchema, OutputSharding] = {}

aten = torch.ops.aten
# Ops whose distributed meaning is "on the whole tensor, on every rank": a Python value
# (item, equal) or an output whose shape depends on the data (nonzero, unique, masked_select).
REPLICATED_OPS = frozenset({
    aten._local_scalar_dense.default, aten.equal.default, aten.allclose.default, aten.is_nonzero.default,
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten.unique_dim.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default, aten.histc.default, aten.bincount.default,
    # histograms whose bin edges come from the data; an order-dependent hash of all elements;
    # ranges whose endpoints arrive as (replicated) 0-dim tensors
    aten.histogram.bin_ct, aten.histogram.bins_tensor, aten._histogramdd_bin_edges.default,
    aten._histogramdd_from_bin_cts.default, aten._histogramdd_from_bin_tensors.default,
    aten.hash_tensor.default, aten.linspace.Tensor_Scalar, aten.linspace.Tensor_Tensor,
    aten.linspace.Scalar_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Tensor_Tensor,
    aten.logspace.Scalar_Tensor,
    # defined on the storage of a contiguous tensor, not on its elements: only the whole
    # tensor has that storage
    aten.as_strided.default, aten.as_strided_.default, aten.as_strided_copy.default,
    aten.as_strided_scatter.default, aten.resize_.default, aten.resize_as_.default,
    # draws from torch's generator in an order tied to the whole tensor: every rank makes the
    # same draws (ranks share torch's RNG state), which equal the single-device ones
    aten.multinomial.default, aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default,
})
# In-place ops that change self's shape or layout (squeeze_, transpose_, resize_): self takes
# the output's layout instead of having the result moved back into its own.
RELAYOUT_OPS = frozenset({
    aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims, aten.unsqueeze_.default,
    aten.transpose_.default, aten.t_.default, aten.as_strided_.default, aten.resize_.default,
    aten.resize_as_.default,
})
_WARNED: set[Any] = set()
_STRICT = [os.environ.get("SHARDWISE_STRICT", "") not in ("", "0")]
_CALLS = [0]


def set_strict(strict: bool = True) -> None:
    """Make an op without a sharding strategy an error instead of a replicated fallback."""
    _STRICT[0] = bool(strict)


def is_strict() -> bool:
    return _STRICT[0]


def strategy_calls() -> int:
    """How many times a strategy function has run in this process (cache misses)."""
    return _CALLS[0]


def redistribute_cost(spec: DTensorSpec, target: Optional[Layout], partialize: bool = False) -> float:
    """Planner cost (bytes received per rank) of moving `spec` to `target`; inf where the
    move would invent a Partial (a strategy may keep a Partial input, not ask for one),
    unless `partialize` allows a Replicate input to become it (a bias added once)."""
    if target is None or (target.placements == spec.placements and target.shard_order == spec.shard_order):
        return 0.0
    for have, want in zip(spec.placements, target.placements):
        if isinstance(want, Partial) and want != have and not (partialize and isinstance(have, Replicate)):
            return math.inf
    plan = plan_redistribute(
        tuple(spec.mesh.shape), tuple(spec.shape), spec.dtype.itemsize,
        spec.placements, target.placements, spec.shard_order, target.shard_order,
    )
    return plan.cost


def _as_tuple(meta: Any) -> tuple[Any, ...]:
    """Output metas as a tuple (TensorMeta is itself a NamedTuple: one output, not many)."""
    return meta if isinstance(meta, tuple) and not isinstance(meta, TensorMeta) else (meta,)


def _local_bytes(meta: TensorMeta, mesh_shape: tuple[int, ...], layout: Layout) -> int:
    from .._layout import max_local_shape

    shape = max_local_shape(meta.shape, mesh_shape, layout.placements, layout.shard_order)
    return math.prod(shape) * meta.dtype.itemsize


def _memory(strategy: PlacementStrategy, specs: list[DTensorSpec], out_meta: Any) -> int:
    mesh_shape = tuple(specs[0].mesh.shape) if specs else ()
    total = 0
    for spec, lay in zip(specs, strategy.input_specs):
        if lay is not None:  # an input left as it is weighs the same in every candidate
            total += _local_bytes(spec.tensor_meta, mesh_shape, lay)
    outs = strategy.output_specs
    metas = _as_tuple(out_meta)
    layouts = outs if isinstance(outs, tuple) else (outs,)
    for meta, lay in zip(metas, layouts):
        if isinstance(meta, TensorMeta) and isinstance(lay, Layout):
            total += _local_bytes(meta, mesh_shape, lay)
    return total


def _writeback_cost(schema: OpSchema, candidate: PlacementStrategy) -> float:
    """In-place ops: the cost of moving the result back into self's layout, if it differs."""
    if not schema.is_inplace() or not isinstance(schema.args_schema[0], DTensorSpec) or schema.op in RELAYOUT_OPS:
        return 0.0
    me, out = schema.args_schema[0], candidate.output_specs
    if not isinstance(out, Layout) or (out.placements == me.placements and out.shard_order == me.shard_order):
        return 0.0
    plan = plan_redistribute(
        tuple(me.mesh.shape), tuple(me.shape), me.dtype.itemsize,
        out.placements, me.placements, out.shard_order, me.shard_order,
    )
    return plan.cost + 1e-3  # a write-back is a copy even when it moves no bytes


def _pick(schema: OpSchema, strategy: OpStrategy, specs: list[DTensorSpec]) -> PlacementStrategy:
    best: Optional[tuple[float, int, int, int, PlacementStrategy]] = None
    for candidate in strategy.strategies:
        if len(candidate.input_specs) != len(specs):
            raise ValueError(
                f"strategy for {schema.op} gives {len(candidate.input_specs)} input layouts for "
                f"{len(specs)} DTensor inputs: {candidate}"
            )
        cost = sum(
            redistribute_cost(s, lay, k in candidate.partialize)
            for k, (s, lay) in enumerate(zip(specs, candidate.input_specs))
        )
        cost += _writeback_cost(schema, candidate)
        if math.isinf(cost):
            continue
        # ties: fewer Partial outputs (each is a reduction still to pay), then fewer inputs
        # re-laid out (keep what the inputs have: chunking a replicated bias gradient to sum
        # it saves memory now and costs a gather in every optimizer op after), then less memory
        moved = sum(_target(s, lay) is not None for s, lay in zip(specs, candidate.input_specs))
        key = (round(cost, 6), _pending(candidate), moved, _memory(candidate, specs, schema.output_meta()), candidate)
        if best is None or key[:4] < best[:4]:
            best = key
    if best is None:
        raise ValueError(f"no strategy of {schema.op} accepts the inputs {schema}: {strategy}")
    return best[4]


def _pending(strategy: PlacementStrategy) -> int:
    """Partial mesh dims in the outputs: reductions left for later."""
    outs = strategy.output_specs
    layouts = outs if isinstance(outs, tuple) else (outs,)
    return sum(isinstance(p, Partial) for lay in layouts if isinstance(lay, Layout) for p in lay.placements)


def _target(spec: DTensorSpec, lay: Optional[Layout]) -> Optional[DTensorSpec]:
    if lay is None or (lay.placements == spec.placements and lay.shard_order == spec.shard_order):
        return None
    return spec.with_placements(lay.placements, lay.shard_order)


def _output(mesh: Any, lay: Any, meta: Any) -> Optional[DTensorSpec]:
    if not isinstance(lay, Layout) or not isinstance(meta, TensorMeta):
        return None
    return DTensorSpec(mesh, lay.placements, meta, lay.shard_order)


def _choose(schema: OpSchema, strategy: StrategyType) -> OutputSharding:
    specs = schema.input_specs()
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(
                f"{schema.op} got DTensors on different meshes, {mesh!r} and {s.mesh!r}: "
                f"move one onto the other's mesh first"
            )
    out_meta = schema.output_meta()
    if isinstance(strategy, TupleStrategy):
        chosen = [_pick(schema, child, specs) for child in strategy.childs]
        targets: list[Optional[Layout]] = [None] * len(specs)
        for c in chosen:
            for k, lay in enumerate(c.input_specs):
                if lay is not None:
                    targets[k] = lay
        metas = _as_tuple(out_meta)
        outs = tuple(_output(mesh, c.output_specs, m) for c, m in zip(chosen, metas))
        return OutputSharding(tuple(_target(s, t) for s, t in zip(specs, targets)), outs)
    if not isinstance(strategy, OpStrategy):
        raise TypeError(f"strategy function for {schema.op} returned {type(strategy).__name__}, not an OpStrategy")
    best = _pick(schema, strategy, specs)
    inputs = tuple(_target(s, lay) for s, lay in zip(specs, best.input_specs))
    if isinstance(best.output_specs, tuple):
        metas = _as_tuple(out_meta)
        out: Any = tuple(_output(mesh, lay, m) for lay, m in zip(best.output_specs, metas))
    else:
        out = _output(mesh, best.output_specs, out_meta)
    return OutputSharding(inputs, out, best.shape_arg)


def _fallback(schema: OpSchema, intended: bool = False) -> OutputSharding:
    specs = schema.input_specs()
    if _STRICT[0] and not intended:
        raise NotImplementedError(
            f"shardwise has no sharding strategy for {schema.op}, called as {schema}; strict mode is on "
            f"(set_strict(False) runs it replicated instead)"
        )
    if not intended and schema.op not in _WARNED:
        _WARNED.add(schema.op)
        warnings.warn(
            f"shardwise has no sharding strategy for {schema.op}: it runs replicated (inputs gathered, "
            f"outputs Replicate). This warning is shown once per op.",
            stacklevel=4,
        )
    mesh = specs[0].mesh
    replicate = Layout((Replicate(),) * mesh.ndim)
    inputs = tuple(_target(s, replicate) for s in specs)
    try:
        out_meta = schema.output_meta()
    except Exception:  # data-dependent output shapes (nonzero, unique): described after the run
        return OutputSharding(inputs, None, fallback=not intended, dynamic=True)
    if not isinstance(out_meta, TensorMeta) and isinstance(out_meta, tuple):
        out: Any = tuple(_output(mesh, replicate, m) for m in out_meta)
    else:
        out = _output(mesh, replicate, out_meta)
    return OutputSharding(inputs, out, fallback=not intended)


def propagate(schema: OpSchema) -> OutputSharding:
    """The chosen input and output specs for one op call (cached per schema)."""
    hit = _CACHE.get(schema)
    if hit is not None:
        return hit
    fn = get_op_strategy(schema.op)
    if schema.op in REPLICATED_OPS:
        result = _fallback(schema, intended=True)
    elif fn is None:
        result = _fallback(schema)
    else:
        _CALLS[0] += 1
        result = _choose(schema, fn(schema))
    _CACHE[schema] = result
    return result
