"""Sharding rule for pointwise ops: every aten op tagged pointwise, plus copies and casts.

Per mesh dim the output follows the first input sharded on a non-broadcast tensor dim;
the other inputs are brought to the matching shard (or to `Replicate` where they
broadcast). `Partial` survives only where the op is linear in it:

| op | Partial kept when |
|---|---|
| add, sub (tensor + tensor) | every input is the same P(sum) or P(avg) |
| mul, div (P first for div) | exactly one input is P(sum)/P(avg), the others Replicate or Python scalars |
| clone, detach, casts | always (one input) |
| neg | P(sum) or P(avg) (it would turn max into min) |

Anything else reduces the Partial input first (`P(sum) + R` is `all_reduce` then add,
never a silently wrong local add). In-place ops keep their self layout; an in-place op
that would have to change it is an error.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._layout import ShardOrder, split_orders
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._registry import register_rule
from ._schema import Layout, OpSchema, OutputSharding

__all__ = ["pointwise_rule", "POINTWISE_OPS"]

aten = torch.ops.aten

_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
_MULTIPLICATIVE = {aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}
_DIVISION = {aten.div.Tensor, aten.div_.Tensor}
# One input, output = f(input) with f monotone and additive: every Partial survives.
_IDENTITY_LIKE = {
    aten.clone.default, aten.detach.default, aten.alias.default, aten.contiguous.default,
    aten._to_copy.default, aten.positive.default, aten.zero_.default, aten.lift_fresh.default,
}
# Additive but order-reversing: P(sum)/P(avg) survive, P(max)/P(min) would swap.
_NEGATION = {aten.neg.default, aten.neg_.default}


def _is_inplace(op: torch._ops.OpOverload) -> bool:
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _partial_kept(op: torch._ops.OpOverload, args: tuple[Any, ...], i: int) -> Optional[Partial]:
    """The Partial the output keeps on mesh dim i, or None if the inputs must be reduced."""
    dspecs = [(k, a) for k, a in enumerate(args) if isinstance(a, DTensorSpec)]
    partials = [(k, a.placements[i]) for k, a in dspecs if isinstance(a.placements[i], Partial)]
    if not partials:
        return None
    first = partials[0][1]
    assert isinstance(first, Partial)
    if op in _IDENTITY_LIKE:
        return first if len(dspecs) == 1 else None
    if first.reduce_op not in ("sum", "avg"):
        return None
    if op in _NEGATION:
        return first
    if op in _ADDITIVE:
        tensors = args[:2]
        if all(isinstance(a, DTensorSpec) and a.placements[i] == first for a in tensors):
            return first
        return None
    if op in _MULTIPLICATIVE and len(partials) == 1:
        k = partials[0][0]
        if op in _DIVISION and k != 0:
            return None
        if all(isinstance(a.placements[i], Replicate) for kk, a in dspecs if kk != k):
            return first
    return None


def _in_dim(out_dim: int, spec: DTensorSpec, out_shape: torch.Size) -> Optional[int]:
    """The input tensor dim that feeds output dim `out_dim` without broadcasting, if any."""
    d = out_dim - (len(out_shape) - spec.ndim)
    if d < 0 or spec.shape[d] != out_shape[out_dim]:
        return None
    return d


def pointwise_rule(schema: OpSchema, out_meta: Any) -> OutputSharding:
    op, args = schema.op, schema.args_schema
    assert isinstance(out_meta, TensorMeta)
    out_shape = out_meta.shape
    dspecs = [(k, a) for k, a in enumerate(args) if isinstance(a, DTensorSpec)]
    mesh_ndim = dspecs[0][1].mesh.ndim
    inplace = _is_inplace(op)
    self_spec = args[0] if inplace and isinstance(args[0], DTensorSpec) else None

    out: list[Placement] = []
    for i in range(mesh_ndim):
        kept = _partial_kept(op, args, i)
        if self_spec is not None:
            p = self_spec.placements[i]
            if isinstance(p, Partial) and kept != p:
                raise ValueError(
                    f"in-place {op} on a tensor with layout {self_spec.layout_str()} would have to reduce its "
                    f"{p} on mesh dim {i} ({schema}): redistribute it to Replicate() or Shard() first"
                )
            out.append(p)
            continue
        if kept is not None:
            out.append(kept)
            continue
        chosen: Placement = Replicate()
        for _, spec in dspecs:
            p = spec.placements[i]
            if isinstance(p, Shard):
                od = p.dim + (len(out_shape) - spec.ndim)
                if _in_dim(od, spec, out_shape) is not None:
                    chosen = Shard(od)
                    break
        out.append(chosen)

    out_t = tuple(out)
    out_order = _pick_order(out_t, dspecs, out_shape)
    needs = []
    for k, a in enumerate(args):
        if not isinstance(a, DTensorSpec):
            continue
        req: list[Placement] = []
        for i, p in enumerate(out_t):
            if isinstance(p, Shard):
                d = _in_dim(p.dim, a, out_shape)
                req.append(Replicate() if d is None else Shard(d))
            elif isinstance(p, Partial):
                req.append(a.placements[i] if isinstance(a.placements[i], Partial) else Replicate())
            else:
                req.append(Replicate())
        req_t = tuple(req)
        order = _order_for_input(out_order, a, out_shape, req_t)
        needs.append(None if (req_t == a.placements and order == a.shard_order) else Layout(req_t, order))
    return OutputSharding(tuple(needs), Layout(out_t, out_order))


def _pick_order(out: tuple[Placement, ...], dspecs: list[tuple[int, DTensorSpec]], out_shape: torch.Size) -> ShardOrder:
    """Keep the split order of the first input that already splits a dim the same way."""
    want = split_orders(out)
    result = []
    for od, ms in want.items():
        if len(ms) < 2:
            continue
        for _, spec in dspecs:
            d = _in_dim(od, spec, out_shape)
            if d is None:
                continue
            have = spec.split_orders().get(d, ())
            if sorted(have) == sorted(ms):
                if have != ms:
                    result.append((od, have))
                break
    return tuple(sorted(result))


def _order_for_input(out_order: ShardOrder, spec: DTensorSpec, out_shape: torch.Size, req: tuple[Placement, ...]) -> ShardOrder:
    result = []
    for od, ms in out_order:
        d = _in_dim(od, spec, out_shape)
        if d is not None and all(req[m] == Shard(d) for m in ms):
            result.append((d, ms))
    return tuple(sorted(result))


def _pointwise_ops() -> list[torch._ops.OpOverload]:
    ops = _IDENTITY_LIKE | _NEGATION | {aten.copy_.default}
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():  # type: ignore[no-untyped-call]
            op = getattr(packet, overload)
            tags = op.tags
            if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
                continue
            if any(a.is_out for a in op._schema.arguments):
                continue  # out= variants: the propagation issue
            ops.add(op)
    return sorted(ops, key=str)


POINTWISE_OPS = _pointwise_ops()
register_rule(POINTWISE_OPS)(pointwise_rule)
