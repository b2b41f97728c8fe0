"""The propagator: from an op call's input specs to the specs its inputs need and its
outputs get. It enumerates the candidates of the op's rule (`rule_for`, under the modes on
now), prices each by the cost of the plan that would move every input to the layout it
wants (`plan_between`, the plan that then runs), and keeps the cheapest (ties: fewer
Partial outputs, fewer inputs moved, fewer bytes held per rank). Results are cached per
`OpSchema` and rule (a mode's variant is another rule).

An op without a strategy falls back to running replicated: its inputs are gathered, the
op runs on every rank, the outputs are `Replicate`; a warning names the op once per
process, and strict mode (`set_strict(True)` or env `SHARDWISE_STRICT=1`) makes it an error.
For the ops replicated by design (`OpKind.REPLICATED`, see `_replicated`) that *is* the
strategy: they run the same way, without a warning, in strict mode too.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch

from .._layout import max_local_shape
from .._placement import Partial, Replicate
from .._redistribute import plan_between
from .._spec import DTensorSpec, TensorMeta
from ._registry import OpKind, OpRule, rule_for
from ._schema import Layout, OpSchema, OpStrategy, OutputSharding, PlacementStrategy, StrategyType, TupleStrategy

__all__ = ["propagate", "set_strict", "is_strict", "redistribute_cost", "strategy_calls"]

_CACHE: dict[tuple[OpSchema, Optional[str]], OutputSharding] = {}
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
    return plan_between(spec, spec.with_placements(target.placements, target.shard_order)).cost


def _as_tuple(meta: Any) -> tuple[Any, ...]:
    """Output metas as a tuple (TensorMeta is itself a NamedTuple: one output, not many)."""
    return meta if isinstance(meta, tuple) and not isinstance(meta, TensorMeta) else (meta,)


def _local_bytes(meta: TensorMeta, mesh_shape: tuple[int, ...], layout: Layout) -> int:
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


def _writeback_cost(schema: OpSchema, rule: OpRule, candidate: PlacementStrategy) -> float:
    """In-place ops: the cost of moving the result back into self's layout, if it differs."""
    if not schema.is_inplace() or not isinstance(schema.args_schema[0], DTensorSpec) or rule.relayout:
        return 0.0
    me, out = schema.args_schema[0], candidate.output_specs
    if not isinstance(out, Layout) or (out.placements == me.placements and out.shard_order == me.shard_order):
        return 0.0
    plan = plan_between(me.with_placements(out.placements, out.shard_order), me)
    return plan.cost + 1e-3  # a write-back is a copy even when it moves no bytes


def _pick(schema: OpSchema, rule: OpRule, strategy: OpStrategy, specs: list[DTensorSpec], out_meta: Any) -> PlacementStrategy:
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
        cost += _writeback_cost(schema, rule, candidate)
        if math.isinf(cost):
            continue
        # ties: fewer Partial outputs (each is a reduction still to pay), then fewer inputs
        # re-laid out (keep what the inputs have: chunking a replicated bias gradient to sum
        # it saves memory now and costs a gather in every optimizer op after), then less memory
        moved = sum(_target(s, lay) is not None for s, lay in zip(specs, candidate.input_specs))
        key = (round(cost, 6), _pending(candidate), moved, _memory(candidate, specs, out_meta), candidate)
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


def _choose(schema: OpSchema, rule: OpRule, strategy: StrategyType) -> OutputSharding:
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
        metas = _as_tuple(out_meta)  # child k makes output k (an in-place call: none)
        chosen = [_pick(schema, rule, child, specs, metas[k] if k < len(metas) else None)
                  for k, child in enumerate(strategy.childs)]
        targets: list[Optional[Layout]] = [None] * len(specs)
        for c in chosen:
            for k, lay in enumerate(c.input_specs):
                if lay is not None:
                    targets[k] = lay
        outs = tuple(_output(mesh, c.output_specs, m) for c, m in zip(chosen, metas))
        return OutputSharding(tuple(_target(s, t) for s, t in zip(specs, targets)), outs)
    if not isinstance(strategy, OpStrategy):
        raise TypeError(f"strategy function for {schema.op} returned {type(strategy).__name__}, not an OpStrategy")
    best = _pick(schema, rule, strategy, specs, out_meta)
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


def propagate(schema: OpSchema, rule: Optional[OpRule] = None) -> OutputSharding:
    """The chosen input and output specs for one op call, by `rule` (default: the op's rule
    under the modes on now); cached per schema and rule."""
    if rule is None:
        rule = rule_for(schema.op)
    key = (schema, rule.mode)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if rule.kind is OpKind.REPLICATED:
        result = _fallback(schema, intended=True)
    elif rule.strategy is None:
        result = _fallback(schema)
    else:
        _CALLS[0] += 1
        result = _choose(schema, rule, rule.strategy(schema))
    _CACHE[key] = result
    return result
