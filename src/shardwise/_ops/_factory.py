"""Strategies for ops that make values instead of computing them: `*_like`, `new_*`, fills
and random draws.

None of these read their input's values except `bernoulli` (probabilities) and
`native_dropout` (the tensor it masks), so most need no input movement at all: the output
takes the input's layout and each rank makes only its piece. What changes is Partial:

| op | input Partial on a mesh dim becomes |
|---|---|
| `empty_like`, `new_empty` / `new_empty_strided` (same shape) | kept (no value to disagree with; as torch, so `module.to_empty()` keeps a Partial buffer) |
| `zero_` | kept (every term zero) |
| other `*_like`, `new_*`, `bernoulli.p`, `fill` | Replicate (the value itself, on every rank; as torch) |
| in-place fills: `fill_`, `uniform_`, `normal_`, ... | kept: the local impl writes the value on the first rank of each P(sum) group, zeros elsewhere |
| `bernoulli`, `bernoulli_(p tensor)` | probabilities reduced first |
| `native_dropout` | output kept Partial (x * mask / (1-p) is linear in x), mask Replicate |
| `multinomial` | probabilities reduced first; rows split over ranks draw locally |

`new_*` with a size other than the input's shape has no layout to follow: it is Replicate.
With the same shape each rank allocates only its piece (`new_empty_strided` too: its strides
describe the global tensor, and the piece gets dense strides in the same memory order).
Random values come from the placement-invariant generator: the local implementations in
`_random` (each registration below names them), so the layout chosen here never changes them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._layout import dense_strides_like
from .._placement import Partial, Placement, Replicate, Shard
from ._local import LocalCall
from .._spec import DTensorSpec
from ._pointwise import pointwise_strategy
from ._random import RANDOM_LOCAL
from ._registry import OpKind, register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import current, input_spec, order_like, replicate

__all__ = ["LIKE_OPS", "NEW_OPS", "INPLACE_FILL_OPS", "RANDOM_OPS"]

aten = torch.ops.aten
_RANDOM_FROM = getattr(aten.random_, "from")  # `from` is a Python keyword

# Output follows the input, Partial included (nothing is written).
_EMPTY_LIKE = [aten.empty_like.default]
_VALUE_LIKE = [
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default,
    aten.randint_like.default, aten.randint_like.low_dtype,
    aten.bernoulli.p, aten.fill.Scalar, aten.fill.Tensor,
]
LIKE_OPS = _EMPTY_LIKE + _VALUE_LIKE
NEW_OPS = [aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default]
# Overwrite self whatever its layout; a 0-dim DTensor fill value must be replicated.
INPLACE_FILL_OPS = [
    aten.fill_.Scalar, aten.fill_.Tensor,
    aten.uniform_.default, aten.normal_.default, aten.exponential_.default,
    aten.cauchy_.default, aten.log_normal_.default, aten.geometric_.default,
    aten.bernoulli_.float, aten.random_.default, aten.random_.to, _RANDOM_FROM,
]
RANDOM_OPS = [
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.uniform_.default, aten.normal_.default, aten.exponential_.default, aten.bernoulli_.float,
    aten.cauchy_.default, aten.log_normal_.default, aten.geometric_.default, aten.bernoulli_.Tensor, aten.bernoulli.default, aten.bernoulli.p,
    aten.random_.default, aten.random_.to, _RANDOM_FROM, aten.native_dropout.default,
    aten.normal.Tensor_Tensor, aten.multinomial.default,
]


def _without_partial(spec: DTensorSpec) -> Layout:
    """The spec's layout with every Partial mesh dim turned Replicate (split order kept)."""
    return Layout(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements), spec.shard_order)


def _others_replicated(schema: OpSchema, first: Optional[Layout]) -> tuple[Optional[Layout], ...]:
    """`first` for self, Replicate for every other DTensor input (fill values, probabilities)."""
    n = len(schema.input_specs())
    return (first,) + (replicate(schema.mesh.ndim),) * (n - 1)


@register_op_strategy(_EMPTY_LIKE, positions_alike=True)
def empty_like_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    return OpStrategy([PlacementStrategy(current(spec), _others_replicated(schema, None))])


@register_op_strategy(_VALUE_LIKE, local=RANDOM_LOCAL, positions_alike=True)
def value_like_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    return OpStrategy([PlacementStrategy(_without_partial(spec), _others_replicated(schema, None))])


# (positions alike: they read no value, so `new_empty` of a fused projection's parts must not
# gather them, e.g. in torch's async checkpoint staging, which makes each tensor's copy with it)
@register_op_strategy(NEW_OPS, positions_alike=True)
def new_factory_strategy(schema: OpSchema) -> OpStrategy:
    """Same shape as self: follow self (each rank allocates its piece, the size argument is
    rewritten to the local shape); any other shape: Replicate."""
    spec = input_spec(schema)
    size = tuple(schema.arg(1, "size", ()))
    if size != tuple(spec.shape):
        return OpStrategy([PlacementStrategy(replicate(spec.mesh.ndim), (None,))])
    out = current(spec) if schema.op is aten.new_empty.default else _without_partial(spec)
    return OpStrategy([PlacementStrategy(out, (None,), shape_arg=1)])


def _new_empty_strided_local(call: LocalCall) -> torch.Tensor:
    """The piece of a `new_empty_strided`: the local shape (already rewritten), dense strides
    in the memory order the global strides give."""
    args = list(call.args)
    args[2] = dense_strides_like(args[1], args[2])
    return call.func(*args, **call.kwargs)  # type: ignore[no-any-return]


@register_op_strategy(aten.new_empty_strided.default, local=_new_empty_strided_local)
def new_empty_strided_strategy(schema: OpSchema) -> OpStrategy:
    """Same shape as self: self's layout, each rank allocating its piece; else Replicate."""
    spec = input_spec(schema)
    if tuple(schema.arg(1, "size", ())) != tuple(spec.shape):
        return OpStrategy([PlacementStrategy(replicate(spec.mesh.ndim), (None,))])
    return OpStrategy([PlacementStrategy(current(spec), (None,), shape_arg=1)])


@register_op_strategy(INPLACE_FILL_OPS, local=RANDOM_LOCAL)
def inplace_fill_strategy(schema: OpSchema) -> OpStrategy:
    spec = input_spec(schema)
    return OpStrategy([PlacementStrategy(current(spec), _others_replicated(schema, None))])


@register_op_strategy(aten.bernoulli.default, local=RANDOM_LOCAL)
def bernoulli_strategy(schema: OpSchema) -> OpStrategy:
    """bernoulli(probs): shards pass through, Partial probabilities are reduced first."""
    lay = _without_partial(input_spec(schema))
    return OpStrategy([PlacementStrategy(lay, (lay,))])


@register_op_strategy(aten.multinomial.default, local=RANDOM_LOCAL)
def multinomial_strategy(schema: OpSchema) -> OpStrategy:
    """multinomial(probs, n): rows split over ranks draw locally (the output's rows split
    alike); the category dim is whole; Partial probabilities are reduced first."""
    spec = input_spec(schema)
    last = spec.ndim - 1
    placements = tuple(Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == last) else p
                       for p in spec.placements)
    lay = Layout(placements, order_like(placements, spec))
    return OpStrategy([PlacementStrategy(lay, (lay,))])


def _follow(self_spec: DTensorSpec, other: DTensorSpec) -> Layout:
    """Layout of `other` (broadcast against self) matching self's shards; Replicate elsewhere."""
    off = self_spec.ndim - other.ndim

    def image(d: int) -> Optional[int]:
        od = d - off
        return od if od >= 0 and other.shape[od] == self_spec.shape[d] else None

    out: list[Placement] = []
    for p in self_spec.placements:
        d = image(p.dim) if isinstance(p, Shard) else None
        out.append(Shard(d) if d is not None else Replicate())
    order = tuple((od, ms) for od, ms in ((image(d), ms) for d, ms in self_spec.shard_order) if od is not None)
    return Layout(tuple(out), order)


@register_op_strategy(aten.bernoulli_.Tensor, local=RANDOM_LOCAL)
def bernoulli_tensor_strategy(schema: OpSchema) -> OpStrategy:
    """bernoulli_(self, p): self keeps its layout, the probabilities follow self's shards."""
    spec = input_spec(schema)
    p = schema.arg(1, "p")
    ins: tuple[Optional[Layout], ...] = (None,)
    if isinstance(p, DTensorSpec):
        ins = (None, _follow(spec, p))
    return OpStrategy([PlacementStrategy(current(spec), ins)])


@register_op_strategy(aten.native_dropout.default, local=RANDOM_LOCAL)
def native_dropout_strategy(schema: OpSchema) -> OpStrategy:
    """Per mesh dim: a shard gives shards of output and mask; a Partial stays Partial in the
    output (scaling by a nonnegative mask is linear and monotone) with the mask replicated.
    Also offered: everything replicated (Partial reduced first)."""
    spec = input_spec(schema)
    out: list[Placement] = []
    mask: list[Placement] = []
    for p in spec.placements:
        out.append(p)
        mask.append(p if isinstance(p, Shard) else Replicate())
    keep = PlacementStrategy((current(spec), Layout(tuple(mask), spec.shard_order)), (None,))
    r = replicate(spec.mesh.ndim)
    return OpStrategy([keep, PlacementStrategy((r, r), (r,))])


# normal(mean, std) with tensor arguments: elementwise in mean and std (the draws come from the
# placement-invariant generator at the output's global indices), so it shards like a pointwise op;
# it is not linear in a Partial mean or std, which the pointwise rules already reduce.
register_op_strategy(aten.normal.Tensor_Tensor, kind=OpKind.POINTWISE, local=RANDOM_LOCAL)(pointwise_strategy)
