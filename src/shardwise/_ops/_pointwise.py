"""Strategies for pointwise ops: every aten op tagged pointwise, plus copies and casts.

Per mesh dim the output may follow any input's shard (on a tensor dim that input does not
broadcast), be replicated, or stay `Partial` where the op is linear in it:

| op | Partial kept when |
|---|---|
| add, sub (tensor + tensor) | every input is the same P(sum) or P(avg), or it and Replicate ones (made its terms for free: torch's `P + R`) |
| add, sub (P first) | a P(max) / P(min) self and a Replicate other (a shift) |
| maximum, fmax, clamp_min (minimum, fmin, clamp_max) | P(max) (P(min)) inputs, the others Replicate |
| mul, div (P first for div) | exactly one input is P(sum)/P(avg), the others Replicate |
| clone, detach, casts | always (one input) |
| neg | P(sum) or P(avg) (it would turn max into min) |

A P(sum)/P(avg) is never kept into an output of another dtype than its own (a cast, a
type-promoting op, an in-place op on a tensor of another dtype): each rank would round its
term, and the sum of rounded terms is not the rounded sum. It is reduced first, so the one
rounding happens on the whole value, as on one device.

The propagator prices every combination and keeps the cheapest, so `S(0) + S(0)` costs
nothing, `S(0) + S(1)` moves the smaller side, and `P(sum) + R` stays Partial with the
replicated value added on one rank only (never a silently wrong local add: added on every
rank it would count n times). In-place ops prefer their self layout; where
none fits (an in-place op on a Partial that must be reduced), the dispatcher writes the
result back into self's layout.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from .._layout import ShardOrder, split_orders
from .._placement import BITWISE_OPS, Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._registry import OpKind, register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import canonical_order, order_like

__all__ = ["pointwise_strategy", "POINTWISE_OPS"]

aten = torch.ops.aten

_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
_MULTIPLICATIVE = {aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}
_DIVISION = {aten.div.Tensor, aten.div_.Tensor}
# One input, output = f(input) with f monotone and additive: every Partial survives.
_IDENTITY_LIKE = {
    aten.clone.default, aten.detach.default, aten.alias.default, aten.contiguous.default,
    aten._to_copy.default, aten.positive.default, aten.zero_.default, aten.lift_fresh.default,
}
# Binary ops that commute with one reduce op: a P(max) (P(min)) beside the same P or a replicated value
_EXTREMUM = {
    aten.maximum.default: "max", aten.fmax.default: "max", aten.clamp_min.Tensor: "max",
    aten.minimum.default: "min", aten.fmin.default: "min", aten.clamp_max.Tensor: "min",
}
# self + other, self - other: a P(max) / P(min) self shifted by a replicated other stays so
_SHIFTS = {aten.add.Tensor, aten.sub.Tensor}
# Additive but order-reversing: P(sum)/P(avg) survive, P(max)/P(min) would swap.
_NEGATION = {aten.neg.default, aten.neg_.default}


def _partial_options(schema: OpSchema, out_dtype: torch.dtype, i: int) -> list[tuple[Placement, list[Placement]]]:
    """Ways to keep a Partial on mesh dim i: (output placement, required input placements)."""
    op, args = schema.op, schema.args_schema
    dspecs = [(k, a) for k, a in enumerate(args) if isinstance(a, DTensorSpec)]
    found: list[tuple[Placement, list[Placement]]] = []
    for k, spec in dspecs:
        p = spec.placements[i]
        if not isinstance(p, Partial):
            continue
        if p.reduce_op in ("sum", "avg") and _rounds_terms(op, spec, dspecs, out_dtype, i):
            # one device rounds the summed value to the output's dtype: rounding each term on its
            # own (a cast, or an op computed or written in another dtype, such as `add_` into a
            # float32 tensor) and summing those is not the rounded sum (max/min survive a cast)
            continue
        if p.reduce_op in BITWISE_OPS and spec.dtype != out_dtype:
            continue  # bits combined in one dtype are not those of another (a float, a bool)
        if op in _IDENTITY_LIKE and len(dspecs) == 1:
            found.append((p, [p]))
        elif _EXTREMUM.get(op) == p.reduce_op:
            # max(max_r a_r, b) = max_r max(a_r, b): the other inputs the same P, or replicated
            found.append((p, [p if isinstance(q.placements[i], Partial) else Replicate() for _, q in dspecs]))
        elif op in _SHIFTS and p.reduce_op in ("max", "min") and k == 0 and len(dspecs) == 2 \
                and not isinstance(dspecs[1][1].placements[i], Partial) and spec.shape == schema.output_meta().shape:
            found.append((p, [p, Replicate()]))  # max_r(a_r) + b = max_r(a_r + b): b added on every rank
        elif p.reduce_op not in ("sum", "avg"):
            continue
        elif op in _NEGATION and len(dspecs) == 1:
            found.append((p, [p]))
        elif op in _ADDITIVE and all(isinstance(a, DTensorSpec) for a in args[:2]):
            # the other inputs the same P, or replicated ones turned into its terms for free
            # (`partialize`: the value on one rank, zeros elsewhere), as long as the Partial
            # input is as large as the output (else the later reduction would grow)
            if all(isinstance(q.placements[i], Partial) for _, q in dspecs) or spec.shape == schema.output_meta().shape:
                found.append((p, [p for _ in dspecs]))
        elif op in _MULTIPLICATIVE and not (op in _DIVISION and k != 0):
            found.append((p, [p if kk == k else Replicate() for kk, _ in dspecs]))
    return found


def _rounds_terms(op: Any, spec: DTensorSpec, dspecs: list[tuple[int, DTensorSpec]], out_dtype: torch.dtype,
                  i: int) -> bool:
    """Whether keeping `spec`'s Partial on mesh dim i would cast terms to the output's dtype
    one by one: that input's own (or, for an additive op, any Partial input's) dtype differs."""
    kept = [q for _, q in dspecs if isinstance(q.placements[i], Partial)] if op in _ADDITIVE else [spec]
    return any(q.dtype != out_dtype for q in kept)


def _in_dim(out_dim: int, spec: DTensorSpec, out_shape: torch.Size) -> Optional[int]:
    """The input tensor dim that feeds output dim `out_dim` without broadcasting, if any."""
    d = out_dim - (len(out_shape) - spec.ndim)
    if d < 0 or spec.shape[d] != out_shape[out_dim]:
        return None
    return d


def _dim_options(schema: OpSchema, out_shape: torch.Size, out_dtype: torch.dtype, i: int) -> list[tuple[Placement, list[Placement]]]:
    """Per mesh dim i: (output placement, required placement of each DTensor input)."""
    dspecs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
    options: list[tuple[Placement, list[Placement]]] = [(Replicate(), [Replicate() for _ in dspecs])]
    seen: set[Placement] = {Replicate()}
    for spec in dspecs:
        p = spec.placements[i]
        if not isinstance(p, Shard):
            continue
        od = p.dim + (len(out_shape) - spec.ndim)
        if _in_dim(od, spec, out_shape) is None or Shard(od) in seen:
            continue
        seen.add(Shard(od))
        need: list[Placement] = []
        for other in dspecs:
            d = _in_dim(od, other, out_shape)
            need.append(Replicate() if d is None else Shard(d))
        options.append((Shard(od), need))
    options.extend(_partial_options(schema, out_dtype, i))
    return options


def pointwise_strategy(schema: OpSchema) -> OpStrategy:
    out_meta = schema.output_meta()
    # several outputs of one elementwise op (frexp: mantissa, exponent) share one layout
    n_outputs = 1 if isinstance(out_meta, TensorMeta) else len(out_meta)
    first = out_meta if isinstance(out_meta, TensorMeta) else out_meta[0]
    assert isinstance(first, TensorMeta)
    out_shape = first.shape
    dspecs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
    extra = len(schema.input_specs()) - len(dspecs)  # DTensors passed by keyword: out= tensors
    mesh_ndim = dspecs[0].mesh.ndim
    per_dim = [_dim_options(schema, out_shape, first.dtype, i) for i in range(mesh_ndim)]
    strategies = []
    for combo in itertools.product(*per_dim):
        out = tuple(o for o, _ in combo)
        needs = [tuple(need[j] for _, need in combo) for j in range(len(dspecs))]
        order = _output_order(dspecs, needs, len(out_shape))
        ins = [Layout(n, _input_order(n, order, len(out_shape) - spec.ndim)) for spec, n in zip(dspecs, needs)]
        # an out= tensor receives the output: it is asked for the output's layout (the
        # dispatcher writes the result back into the layout it had)
        lay = Layout(out, _input_order(out, order, 0))
        outs = lay if n_outputs == 1 else (lay,) * n_outputs
        # an additive op may turn a replicated input into the terms of a Partial one
        free = tuple(range(len(dspecs))) if schema.op in _ADDITIVE else ()
        strategies.append(PlacementStrategy(outs, tuple(ins) + (lay,) * extra, partialize=free))
    return OpStrategy(strategies)


def _output_order(dspecs: list[DTensorSpec], needs: list[tuple[Placement, ...]], out_ndim: int) -> ShardOrder:
    """Keep an input's split order (a tensor dim split by several mesh dims, not outermost
    first) where the candidate splits that dim the same way: otherwise every elementwise op
    would move such a tensor into the default order."""
    for spec, need in zip(dspecs, needs):
        kept = order_like(need, spec)
        if kept:
            shift = out_ndim - spec.ndim
            return tuple((d + shift, ms) for d, ms in kept)
    return ()


def _input_order(placements: tuple[Placement, ...], order: ShardOrder, shift: int) -> ShardOrder:
    """The output's split order seen from an input whose dims are the output's last ones."""
    splits = split_orders(placements)
    return canonical_order([(d - shift, ms) for d, ms in order
                            if d >= shift and sorted(splits.get(d - shift, ())) == sorted(ms)])


# Tagged pointwise, but with a rule of their own elsewhere (one rule per op).
_OWN_RULE = {
    aten.masked_fill.Scalar,  # _index: a P(sum) survives only a zero fill
    aten.native_dropout_backward.default,  # _nn: keeps its mask's split
    aten.alias.default,  # _view
    aten._conj_physical.default, aten.conj_physical.default, aten.conj_physical_.default,  # _fft
    aten.equal.default,  # _replicated: one Python bool for the whole tensors
}


def _pointwise_ops() -> list[torch._ops.OpOverload]:
    """Every registered aten overload tagged pointwise (not random), but those with their own rule.

    Enumerated from the dispatcher's table, not `dir(torch.ops.aten)`, which lists only the
    ops some code has already looked up (so coverage would depend on import order).
    """
    ops = _IDENTITY_LIKE | _NEGATION | {aten.copy_.default}
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        packet = getattr(aten, name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if not isinstance(op, torch._ops.OpOverload):
            continue
        tags = op.tags
        if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
            continue
        ops.add(op)
    return sorted(ops - _OWN_RULE, key=str)


POINTWISE_OPS = _pointwise_ops()
register_op_strategy(POINTWISE_OPS, kind=OpKind.POINTWISE)(pointwise_strategy)
