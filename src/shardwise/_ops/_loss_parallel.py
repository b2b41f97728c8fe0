"""Loss-parallel candidates: log_softmax and nll_loss with the class (vocab) dim split,
offered only while `shardwise.parallel.loss_parallel()` is on.

A cross entropy over a vocabulary split across ranks needs no gathered logits: the row
max and the row sum of exponentials combine over the ranks that split the row, and each
target's log-probability lives on exactly one of them. Those candidates need local
computations that reduce across ranks (`_loss_parallel_local`, through the runtime the
tensor layer gives them).

| op | class dim split on a mesh dim gives | the local computation |
|---|---|---|
| _log_softmax(x, dim) | S(dim) | x - max - log(sum exp(x - max)), max and sum all-reduced per row |
| _log_softmax_backward_data | S(dim) | g - exp(out) * sum(g), the row sum all-reduced |
| nll_loss(2d)_forward, none | loss P(sum), total weight R | each rank picks the targets in its class range |
| nll_loss(2d)_forward, sum | P(sum), P(sum) | as none, summed |
| nll_loss(2d)_forward, mean | P(sum), R | its sum over the all-reduced total weight |
| nll_loss(2d)_backward | S(class dim) | each rank scatters into its class range only |

Class weights are split like the classes (Shard(0) on those mesh dims); other mesh dims
may split the samples as the ordinary strategies do. These rules are the ops' variants for
the mode `LOSS_PARALLEL` (`op_mode`): the ordinary candidates plus the class-split ones,
with plain targets counted as replicated, as in torch. Outside the mode every op plans
exactly as before; the mode is part of the cache keys.

>>> from shardwise import AbstractMesh
>>> from shardwise._ops import propagate
>>> from shardwise._spec import TensorMeta
>>> logits = DTensorSpec(AbstractMesh((4,)), (Shard(1),), TensorMeta(torch.Size([8, 10]), (10, 1), torch.float32))
>>> def plan(op: Any, *args: Any) -> str:  # input move -> output layout
...     r = propagate(OpSchema(op, (logits, *args)))
...     return ("as is" if r.input_specs[0] is None else r.input_specs[0].layout_str()) + " -> " + r.output_spec.layout_str()
>>> plan(aten._log_softmax.default, 1, False)  # ordinarily the class dim must be whole
'(S(0)) -> (S(0))'
>>> with op_mode(LOSS_PARALLEL):
...     plan(aten._log_softmax.default, 1, False)
'as is -> (S(1))'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._args import Args, Option, combine
from ._loss_parallel_local import LOSS_PARALLEL_LOCAL, class_dim
from ._reduction import build_strategy
from ._registry import StrategyFn, get_op_strategy, op_mode, register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy, StrategyType
from ._utils import normalize_dim

__all__ = ["LOSS_PARALLEL", "LOSS_PARALLEL_OPS", "class_dim"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
_NONE, _MEAN, _SUM = 0, 1, 2
LOSS_PARALLEL = "loss_parallel"  # the mode's name (`op_mode(LOSS_PARALLEL)`)

_LOG_SOFTMAX = (aten._log_softmax.default,)
_LOG_SOFTMAX_BACKWARD = (aten._log_softmax_backward_data.default,)
_NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_NLL_BACKWARD = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
LOSS_PARALLEL_OPS = _LOG_SOFTMAX + _LOG_SOFTMAX_BACKWARD + _NLL + _NLL_BACKWARD


# -- the variants: the base rule's candidates plus the class-split ones ----------------------


def _extends(ops: Sequence[Any]) -> Callable[[Callable[[OpSchema], list[PlacementStrategy]]], StrategyFn]:
    """Register, for `ops` under `LOSS_PARALLEL`, their base strategy's candidates (looked up
    when the strategy runs, so import order never matters) plus the decorated function's."""

    def wrap(extra: Callable[[OpSchema], list[PlacementStrategy]]) -> StrategyFn:
        def strategy(schema: OpSchema) -> StrategyType:
            base_fn = get_op_strategy(schema.op)
            if base_fn is None:
                raise LookupError(f"loss parallel extends the strategy of {schema.op}, which has none registered")
            base = base_fn(schema)
            if not isinstance(base, OpStrategy):
                return base
            return OpStrategy(base.strategies + extra(schema))

        register_op_strategy(list(ops), mode=LOSS_PARALLEL, local=LOSS_PARALLEL_LOCAL,
                             plain_as_replicated=True)(strategy)
        return strategy

    return wrap


def _splits(layout: Any, dim: int) -> bool:
    return isinstance(layout, Layout) and Shard(dim) in layout.placements


# -- log_softmax ---------------------------------------------------------------------------------


@_extends(_LOG_SOFTMAX)
def _log_softmax_candidates(schema: OpSchema) -> list[PlacementStrategy]:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dim = normalize_dim(int(schema.arg(1, "dim")), spec.ndim)
    every = build_strategy(schema, lambda i: [(Shard(d), Shard(d)) for d in range(spec.ndim)])
    return [c for c in every.strategies if _splits(c.input_specs[0], dim)]


@_extends(_LOG_SOFTMAX_BACKWARD)
def _log_softmax_backward_candidates(schema: OpSchema) -> list[PlacementStrategy]:
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dim = normalize_dim(int(schema.arg(2, "dim")), spec.ndim)
    every = build_strategy(schema, lambda i: [(Shard(d),) * 3 for d in range(spec.ndim)])
    return [c for c in every.strategies if _splits(c.input_specs[0], dim)]


# -- nll_loss ------------------------------------------------------------------------------------


def _sample_dims(ndim: int) -> list[tuple[int, int]]:
    """(input dim, target dim) of every dim but the class dim."""
    c = class_dim(ndim)
    return [(d, d if d < c else d - 1) for d in range(ndim) if d != c]


def _forward_outputs(reduction: int) -> tuple[Placement, Placement]:
    """(loss, total weight) of a rank that holds some of the classes or samples."""
    return {_NONE: (SUM, R), _SUM: (SUM, SUM), _MEAN: (SUM, R)}[reduction]


@_extends(_NLL)
def _nll_loss_candidates(schema: OpSchema) -> list[PlacementStrategy]:
    a = Args(schema)
    me = a.need("self")
    c = class_dim(me.ndim)
    reduction = int(schema.arg(3, "reduction", _MEAN))
    vocab = _forward_outputs(reduction)
    per_dim: list[list[Option]] = []
    for _ in range(a.mesh_ndim):
        opts = [a.opt(vocab, {"self": Shard(c), "weight": Shard(0)})]
        for d, t in _sample_dims(me.ndim):
            outs = (Shard(t), R) if reduction == _NONE else vocab
            opts.append(a.opt(outs, {"self": Shard(d), "target": Shard(t)}))
            opts.append(a.opt(outs, {"self": Shard(d)}))  # target whole: each rank reads its samples'
        per_dim.append(opts)
    k = a.pos("self") or 0
    return [s for s in combine(a, per_dim, n_outputs=2).strategies if _splits(s.input_specs[k], c)]


@_extends(_NLL_BACKWARD)
def _nll_loss_backward_candidates(schema: OpSchema) -> list[PlacementStrategy]:
    a = Args(schema)
    me = a.need("self")
    c = class_dim(me.ndim)
    reduction = int(schema.arg(4, "reduction", _MEAN))
    per_dim: list[list[Option]] = []
    for _ in range(a.mesh_ndim):
        opts = [a.opt((Shard(c),), {"self": Shard(c), "weight": Shard(0)})]
        for d, t in _sample_dims(me.ndim):
            grad: dict[str, Placement] = {"grad_output": Shard(t)} if reduction == _NONE else {}
            opts.append(a.opt((Shard(d),), {"self": Shard(d), "target": Shard(t), **grad}))
            opts.append(a.opt((Shard(d),), {"self": Shard(d), **grad}))
        per_dim.append(opts)
    tw = a.pos("total_weight")
    free = [tw] if tw is not None and reduction != _MEAN else []  # read only by a mean
    k = a.pos("self") or 0
    return [s for s in combine(a, per_dim, free=free).strategies if _splits(s.input_specs[k], c)]
