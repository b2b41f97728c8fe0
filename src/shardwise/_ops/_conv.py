"""Strategies for convolution and its backward (conv1d/2d/3d and transposed convs arrive
as `aten.convolution` and `aten.convolution_backward`).

A convolution is a contraction over input channels and kernel taps, batched over N, so
along one mesh dim it can run as (weight dims are (C_out, C_in, k...), or (C_in, C_out, k...)
for a transposed conv):

| option | input (N, C_in, ...) | weight | bias | output (N, C_out, ...) |
|---|---|---|---|---|
| batch split (data parallel) | S(0) | R | R | S(0) |
| output channels split | R | S(C_out dim) | S(0) | S(1) |
| input channels split | S(1) | S(C_in dim) | P(sum) | P(sum) |
| linear in input / weight | P(op) / R | R / P(op) | P(op) | P(op) |

and the backward `(grad_input, grad_weight, grad_bias)` from `(grad_output, input, weight)`:

| option | grad_output | input | weight | grad_input | grad_weight | grad_bias |
|---|---|---|---|---|---|---|
| batch split | S(0) | S(0) | R | S(0) | P(sum) | P(sum) |
| output channels split | S(1) | R | S(C_out dim) | P(sum) | S(C_out dim) | S(0) |
| input channels split | R | S(1) | S(C_in dim) | S(1) | S(C_in dim) | R |
| linear in grad_output | P(op) | R | R | P(op) | P(op) | P(op) |
| linear in input | R | P(op) | R | R | P(op) | R |
| linear in weight | R | R | P(op) | P(op) | R | R |

Channel splits need `groups == 1` (a local conv cannot be told it holds a slice of the
groups), and a channel split that would leave a rank without channels is not offered:
torch rejects a weight without output channels and, given no input channels, returns an
output without channels instead of zeros. Spatial (halo) splits are not offered: a spatially
split input is gathered first. Like the matmul family, an output is split or Partial along a
mesh dim only where an input already is (`anchored`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from .._layout import chunk_range
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._matmul import anchored, linear_partial_ops
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import expand_to_mesh

__all__: list[str] = []

aten = torch.ops.aten


def _never_empty(spec: DTensorSpec, layout: Optional[Layout], mesh_shape: Sequence[int]) -> bool:
    """Whether every rank's piece of `spec` under `layout` (default split order) has every
    sharded tensor dim non-empty."""
    if layout is None:
        return True
    for d in range(spec.ndim):
        sizes = {spec.shape[d]}
        for m, p in enumerate(layout.placements):
            if p == Shard(d):
                sizes = {chunk_range(s, mesh_shape[m], j)[1] for s in sizes for j in range(mesh_shape[m])}
        if 0 in sizes:
            return False
    return True


def _channel_dims(transposed: bool) -> tuple[int, int]:
    """(C_out dim, C_in dim) of the weight."""
    return (1, 0) if transposed else (0, 1)


def _weights_never_empty(strategy: OpStrategy, weight: DTensorSpec, slot: int) -> OpStrategy:
    mesh_shape = tuple(weight.mesh.shape)
    return OpStrategy([s for s in strategy.strategies if _never_empty(weight, s.input_specs[slot], mesh_shape)])


@register_op_strategy(aten.convolution.default)
def _convolution_strategy(schema: OpSchema) -> OpStrategy:
    x, w, bias = schema.args_schema[0], schema.args_schema[1], schema.args_schema[2]
    assert isinstance(x, DTensorSpec) and isinstance(w, DTensorSpec)
    has_bias = isinstance(bias, DTensorSpec)
    transposed, groups = bool(schema.arg(6, "transposed")), int(schema.arg(8, "groups", 1))
    w_out, w_in = _channel_dims(transposed)
    R = Replicate()

    def opt(out: Placement, xp: Placement, wp: Placement, bp: Placement) -> tuple[Placement, ...]:
        return (out, xp, wp, bp) if has_bias else (out, xp, wp)

    options = [opt(Shard(0), Shard(0), R, R)]
    if groups == 1:
        options.append(opt(Shard(1), R, Shard(w_out), Shard(0)))
        options.append(opt(Partial(), Shard(1), Shard(w_in), Partial()))
    for op in linear_partial_ops(x):
        options.append(opt(Partial(op), Partial(op), R, Partial(op)))
    for op in linear_partial_ops(w):
        options.append(opt(Partial(op), R, Partial(op), Partial(op)))
    specs = schema.input_specs()
    strategy = expand_to_mesh(x.mesh.ndim, options)
    strategy = anchored(strategy, specs, [True, True, False][: len(specs)])
    return _weights_never_empty(strategy, w, 1)


@register_op_strategy(aten.convolution_backward.default)
def _convolution_backward_strategy(schema: OpSchema) -> OpStrategy:
    go, x, w = schema.args_schema[0], schema.args_schema[1], schema.args_schema[2]
    assert isinstance(go, DTensorSpec) and isinstance(x, DTensorSpec) and isinstance(w, DTensorSpec)
    transposed, groups = bool(schema.arg(7, "transposed")), int(schema.arg(9, "groups", 1))
    mask = tuple(bool(m) for m in schema.arg(10, "output_mask", (True, True, True)))
    w_out, w_in = _channel_dims(transposed)
    R, P = Replicate(), Partial()
    # (grad_input, grad_weight, grad_bias; grad_output, input, weight)
    options: list[tuple[Placement, ...]] = [(Shard(0), P, P, Shard(0), Shard(0), R)]
    if groups == 1:
        options.append((P, Shard(w_out), Shard(0), Shard(1), R, Shard(w_out)))
        options.append((Shard(1), Shard(w_in), R, R, Shard(1), Shard(w_in)))
    for op in linear_partial_ops(go):
        options.append((Partial(op), Partial(op), Partial(op), Partial(op), R, R))
    for op in linear_partial_ops(x):
        options.append((R, Partial(op), R, R, Partial(op), R))
    for op in linear_partial_ops(w):
        options.append((Partial(op), R, R, R, R, Partial(op)))
    strategy = expand_to_mesh(go.mesh.ndim, options, n_outputs=3)
    masked = []
    for s in strategy.strategies:  # outputs not asked for are None: no layout to promise
        outs = s.output_specs
        assert isinstance(outs, tuple)
        kept = tuple(o if m else None for o, m in zip(outs, mask))
        masked.append(PlacementStrategy(kept, s.input_specs))
    strategy = anchored(OpStrategy(masked), schema.input_specs())
    return _weights_never_empty(strategy, w, 2)
