"""Strategies for the `_foreach_*` ops and the fused optimizer steps: one strategy per list element.

`torch.optim` with `foreach=True` updates every parameter with one call per step phase
(`_foreach_mul_(exp_avgs, beta1)`, `_foreach_addcdiv_(params, ...)`), and with
`fused=True` with one `_fused_adamw_` call. Element k of such a call touches only the k-th
tensor of each list, so each element gets its own strategy (a `TupleStrategy` child) and
the layouts of different parameters never constrain each other:

- pointwise families (`add`, `mul`, `lerp`, `addcdiv`, `sqrt`, ...): element k is priced
  as the single-tensor pointwise op it performs (`_foreach_add_.List` -> `add.Tensor`,
  scalars as replicated 0-dim operands), so shards pass through and Partial survives
  exactly where the pointwise rules allow. In-place calls keep self's layout when some
  candidate can (no write-back);
- `_foreach_norm`, `_foreach_powsum`, `_foreach_max`: a shard becomes a Partial of the
  matching reduction where there is one (sum for ord 0/1 and powsum, max for ord inf and
  max, min for ord -inf); a `_foreach_norm` of another order p > 0 keeps its shards and
  comes out Replicate, its local implementation all-reducing every element's norm^p at
  once (`_norm_terms`); else the element is gathered;
- `_fused_adam(w)_`, `_fused_sgd_`: params, grads and optimizer states of element k move
  to one common layout (one of theirs, Partial reduced, or Replicate).

A tensor shared by all elements (the `other` of `_foreach_mul_.Tensor`, a tensor `lr`) and
step counters are asked to be Replicate by every child, so the children never disagree.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Union

import torch

from .._layout import local_shape_and_offset
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._norm_terms import combines_by_root, foreach_norm_local
from ._pointwise import pointwise_strategy
from ._propagate import redistribute_cost
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy, ScalarTensor, TupleStrategy
from ._utils import current, replicate

__all__ = ["FOREACH_POINTWISE_OPS", "FOREACH_REDUCTION_OPS", "FUSED_OPTIMIZER_OPS", "element_op"]

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload
Key = tuple[Union[int, str], Optional[int]]  # (argument position or keyword, list index)

_UNARY = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
    "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
)
# Family name -> the single-tensor op one element performs (every operand a tensor).
_ELEMENT_OPS: dict[str, OpOverload] = {name: getattr(aten, name).default for name in _UNARY}
_ELEMENT_OPS.update({
    "zero": aten.zero_.default, "clone": aten.clone.default, "copy": aten.copy_.default,
    "add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor,
    "maximum": aten.maximum.default, "minimum": aten.minimum.default,
    "clamp_min": aten.clamp_min.Tensor, "clamp_max": aten.clamp_max.Tensor, "pow": aten.pow.Tensor_Tensor,
    "lerp": aten.lerp.Tensor, "addcmul": aten.addcmul.default, "addcdiv": aten.addcdiv.default,
})


def _family(op: OpOverload) -> str:
    name = op._schema.name.split("::")[-1]
    return name[len("_foreach_"):].rstrip("_")


def _overloads(prefix: str, families: Any) -> list[OpOverload]:
    ops: list[OpOverload] = []
    for family in families:
        for suffix in ("", "_"):
            packet = getattr(aten, f"{prefix}{family}{suffix}", None)
            if packet is None:
                continue
            ops.extend(getattr(packet, o) for o in packet.overloads() if "out" not in o)
    return ops


FOREACH_POINTWISE_OPS = _overloads("_foreach_", _ELEMENT_OPS)
FOREACH_REDUCTION_OPS = [aten._foreach_norm.Scalar, aten._foreach_powsum.Scalar, aten._foreach_max.default]
FUSED_OPTIMIZER_OPS = [
    aten._fused_adam_.default, aten._fused_adam_.tensor_lr, aten._fused_adamw_.default,
    aten._fused_adamw_.tensor_lr, aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr,
]


def element_op(op: OpOverload) -> OpOverload:
    """The single-tensor op that element k of a pointwise `_foreach_*` call performs."""
    return _ELEMENT_OPS[_family(op)]


def _n_operands(op: OpOverload) -> int:
    return sum(1 for a in op._schema.arguments if not a.kwarg_only and isinstance(a.type, torch.TensorType))


def _flat_index(schema: OpSchema) -> dict[Key, int]:
    """Where each DTensor argument sits in `schema.input_specs()` order."""
    where: dict[Key, int] = {}
    for key, value in list(enumerate(schema.args_schema)) + list(schema.kwargs_schema):
        if isinstance(value, DTensorSpec):
            where[(key, None)] = len(where)
        elif isinstance(value, tuple):
            for j, x in enumerate(value):
                if isinstance(x, DTensorSpec):
                    where[(key, j)] = len(where)
    return where


def _arg_key(schema: OpSchema, position: int) -> tuple[Union[int, str], Any]:
    name = schema.op._schema.arguments[position].name
    key: Union[int, str] = position if position < len(schema.args_schema) else name
    return key, schema.arg(position, name)


def _scalar_tensor(x: Any) -> ScalarTensor:
    if isinstance(x, ScalarTensor):
        return x
    if isinstance(x, bool):
        return ScalarTensor(torch.bool, "cpu")
    if isinstance(x, int):
        return ScalarTensor(torch.int64, "cpu")
    if isinstance(x, complex):
        return ScalarTensor(torch.complex64, "cpu")
    return ScalarTensor(torch.get_default_dtype(), "cpu")


def _feasible(specs: list[DTensorSpec], strategy: PlacementStrategy, indices: list[int]) -> bool:
    """No input among `indices` is asked to become a Partial it is not."""
    return all(not math.isinf(redistribute_cost(specs[i], strategy.input_specs[i])) for i in indices)


def _pointwise_child(schema: OpSchema, k: int, where: dict[Key, int], n_flat: int) -> OpStrategy:
    """Element k's candidates: the element op's pointwise strategies, lifted to all inputs."""
    op = element_op(schema.op)
    operands: list[Any] = []
    keys: list[Key] = []  # flat key of each DTensor operand
    for position in range(_n_operands(op)):
        key, value = _arg_key(schema, position)
        loc: Key = (key, k) if isinstance(value, tuple) else (key, None)
        x = value[k] if isinstance(value, tuple) else value
        if isinstance(x, DTensorSpec):
            operands.append(x)
            keys.append(loc)
        else:
            operands.append(_scalar_tensor(x))
    element = OpSchema(op, tuple(operands))
    mesh_ndim = schema.mesh.ndim
    r = replicate(mesh_ndim)
    base: list[Optional[Layout]] = [None] * n_flat
    mine = {where[at] for at in keys}
    for flat_key, idx in where.items():
        if flat_key[1] is None and idx not in mine:
            base[idx] = r  # a shared tensor that is not an operand (addcmul's scalars tensor)
    candidates: list[PlacementStrategy] = []
    for cand in pointwise_strategy(element).strategies:
        if any(at[1] is None and lay != r for at, lay in zip(keys, cand.input_specs)):
            continue  # a tensor shared by every element must be Replicate
        ins = list(base)
        for at, lay in zip(keys, cand.input_specs):
            ins[where[at]] = lay
        candidates.append(PlacementStrategy(cand.output_specs, tuple(ins)))
    if schema.is_inplace() and keys and keys[0] == (0, k):
        # in place: prefer candidates that leave self where it is (no write-back afterwards)
        specs = schema.input_specs()
        own = [where[at] for at in keys]
        keep = [c for c in candidates if c.output_specs == current(operands[0]) and _feasible(specs, c, own)]
        candidates = keep or candidates
    return OpStrategy(candidates)


@register_op_strategy(FOREACH_POINTWISE_OPS, scalars_free=True, positions_alike=True)
def foreach_pointwise_strategy(schema: OpSchema) -> TupleStrategy:
    where = _flat_index(schema)
    n = _list_length(schema)
    return TupleStrategy(tuple(_pointwise_child(schema, k, where, len(where)) for k in range(n)))


def _list_length(schema: OpSchema) -> int:
    for value in schema.args_schema:
        if isinstance(value, tuple):
            return len(value)
    raise TypeError(f"{schema.op} expects a list of tensors, got {schema}")


# -- reductions --------------------------------------------------------------------

def _reduce_op(schema: OpSchema) -> Optional[str]:
    """The Partial reduction that combines per-shard results of this call, if any."""
    if schema.op is aten._foreach_max.default:
        return "max"
    order = float(schema.arg(1, "ord", 2))
    if schema.op is aten._foreach_powsum.Scalar:
        return "sum" if math.isfinite(order) else None
    return {0.0: "sum", 1.0: "sum", math.inf: "max", -math.inf: "min"}.get(order)


def _has_empty_piece(spec: DTensorSpec, layout: Layout) -> bool:
    mesh_shape = tuple(spec.mesh.shape)
    for c in itertools.product(*(range(n) for n in mesh_shape)):
        shape, _ = local_shape_and_offset(spec.shape, mesh_shape, layout.placements, c, layout.shard_order)
        if math.prod(shape) == 0:
            return True
    return False


def _reduction_child(spec: DTensorSpec, idx: int, n_flat: int, reduce_op: Optional[str], rooted: bool) -> OpStrategy:
    r = replicate(spec.mesh.ndim)
    ins: list[Optional[Layout]] = [None] * n_flat
    ins[idx] = r
    candidates = [PlacementStrategy(r, tuple(ins))]
    if rooted and spec.is_sharded():  # shards kept, Partials reduced first; the norm comes out whole
        ins[idx] = Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements), spec.shard_order)
        candidates.append(PlacementStrategy(r, tuple(ins)))
        return OpStrategy(candidates)
    if reduce_op is None or not (spec.is_sharded() or spec.has_partial()):
        return OpStrategy(candidates)
    need: list[Placement] = []
    out: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Shard):
            need.append(p)
            out.append(Partial(reduce_op))
        elif isinstance(p, Partial) and p.reduce_op == reduce_op and reduce_op in ("max", "min"):
            need.append(p)  # the max of maxima: a P(max) input stays P(max)
            out.append(p)
        else:
            need.append(Replicate())
            out.append(Replicate())
    layout = Layout(tuple(need), spec.shard_order)
    if reduce_op in ("max", "min") and _has_empty_piece(spec, layout):
        return OpStrategy(candidates)  # an empty piece has no max to contribute
    ins[idx] = layout
    candidates.append(PlacementStrategy(Layout(tuple(out)), tuple(ins)))
    return OpStrategy(candidates)


@register_op_strategy(FOREACH_REDUCTION_OPS, local={aten._foreach_norm.Scalar: foreach_norm_local}, positions_alike=True)
def foreach_reduction_strategy(schema: OpSchema) -> TupleStrategy:
    where = _flat_index(schema)
    reduce_op = _reduce_op(schema)
    rooted = schema.op is aten._foreach_norm.Scalar and combines_by_root(schema.arg(1, "ord", 2))
    childs = []
    for k, spec in enumerate(schema.args_schema[0]):
        childs.append(_reduction_child(spec, where[(0, k)], len(where), reduce_op, rooted))
    return TupleStrategy(tuple(childs))


# -- fused optimizers ----------------------------------------------------------------

def _without_partial(spec: DTensorSpec) -> Layout:
    return Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements), spec.shard_order)


@register_op_strategy(FUSED_OPTIMIZER_OPS, scalars_free=True, positions_alike=True)
def fused_optimizer_strategy(schema: OpSchema) -> TupleStrategy:
    """Element k: params[k], grads[k] and every state list's [k] share one layout."""
    where = _flat_index(schema)
    params = schema.args_schema[0]
    names = [a.name for a in schema.op._schema.arguments]
    grouped = [
        i for i, value in enumerate(schema.args_schema)
        if isinstance(value, tuple) and names[i] != "state_steps" and len(value) == len(params)
    ]
    r = replicate(schema.mesh.ndim)
    base: list[Optional[Layout]] = [r] * len(where)  # steps, a tensor lr, grad scaling: replicated
    for i in grouped:
        for k in range(len(params)):
            if (i, k) in where:
                base[where[(i, k)]] = None
    childs = []
    for k in range(len(params)):
        members = [(where[(i, k)], schema.args_schema[i][k]) for i in grouped if (i, k) in where]
        options: list[Layout] = []
        for _, spec in members:
            lay = _without_partial(spec)
            if lay not in options:
                options.append(lay)
        if r not in options:
            options.append(r)
        candidates = []
        for lay in options:
            ins = list(base)
            for idx, _ in members:
                ins[idx] = lay
            candidates.append(PlacementStrategy(None, tuple(ins)))
        childs.append(OpStrategy(candidates))
    return TupleStrategy(tuple(childs))
