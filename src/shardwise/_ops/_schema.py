"""What strategy functions consume and produce.

- `OpSchema`: one op call as the propagator sees it: the op, its arguments with every
  DTensor replaced by its `DTensorSpec` (lists of DTensors by tuples of specs), and its
  keyword arguments. Hashable, so propagation results are cached per schema.
- `Layout`: placements plus split order, what a strategy asks of an input or promises of
  an output (no mesh, no shape: those come from the schema).
- `PlacementStrategy`: one way to run the op: the layout of each output and of each
  DTensor input, plus the cost of moving each input there (filled in by the propagator).
- `OpStrategy`: the candidate `PlacementStrategy`s of an op call.
- `TupleStrategy`: for ops whose outputs are independent (the `_foreach_*` family): one
  `OpStrategy` per output, each constraining only its own inputs.
- `OutputSharding`: the propagator's answer for one schema: the chosen input and output
  specs, plus what the local op needs rewritten.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .._layout import Layout
from .._placement import Placement
from .._spec import DTensorSpec, TensorMeta

__all__ = [
    "OpSchema",
    "Layout",
    "PlacementStrategy",
    "OpStrategy",
    "TupleStrategy",
    "StrategyType",
    "OutputSharding",
    "ScalarTensor",
]


@dataclass(frozen=True)
class ScalarTensor:
    """A plain 0-dim tensor argument: a replicated scalar."""

    dtype: torch.dtype
    device: str


class OpSchema:
    """One op call with DTensor arguments replaced by their specs."""

    __slots__ = ("op", "args_schema", "kwargs_schema", "_types", "_hash", "_out_meta")

    def __init__(
        self, op: torch._ops.OpOverload, args_schema: tuple[Any, ...], kwargs_schema: tuple[tuple[str, Any], ...] = ()
    ) -> None:
        self.op = op
        self.args_schema = args_schema
        self.kwargs_schema = kwargs_schema
        # Types too: 2 == 2.0 == True, but int, float and bool scalars give different dtypes.
        self._types = tuple(map(type, args_schema))
        self._hash = hash((op, args_schema, kwargs_schema, self._types))
        self._out_meta: Any = _UNSET

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, OpSchema)
            and self._hash == other._hash
            and self.op == other.op
            and self.args_schema == other.args_schema
            and self._types == other._types
            and self.kwargs_schema == other.kwargs_schema
        )

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs_schema)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument `index` if given positionally, else keyword `name`, else `default`."""
        if index < len(self.args_schema):
            return self.args_schema[index]
        for k, v in self.kwargs_schema:
            if k == name:
                return v
        return default

    def input_specs(self) -> list[DTensorSpec]:
        """Every DTensor argument's spec, in argument order (lists flattened, then kwargs)."""
        return list(_iter_specs(self.args_schema)) + list(_iter_specs(tuple(v for _, v in self.kwargs_schema)))

    @property
    def mesh(self) -> Any:
        return self.input_specs()[0].mesh

    def is_inplace(self) -> bool:
        args = self.op._schema.arguments
        return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write

    def is_out_variant(self) -> bool:
        return any(a.is_out for a in self.op._schema.arguments)

    def output_meta(self) -> Any:
        """Global shape/stride/dtype of each output: a meta-device run of the op (cached)."""
        if self._out_meta is _UNSET:
            if not self.op._schema.returns:  # `-> ()` ops (_foreach_add_, _fused_sgd_): nothing to describe
                self._out_meta = None
            else:
                args = [_to_meta(a) for a in self.args_schema]  # lists of specs included
                # a meta run rejects a real generator and must not create tensors on a real
                # device; neither affects shapes
                kwargs = {k: "meta" if k == "device" else _to_meta(v) for k, v in self.kwargs_schema if k != "generator"}
                self._out_meta = _fix_meta(self, _meta_of(self.op(*args, **kwargs)))
        return self._out_meta

    def __repr__(self) -> str:
        def show(a: Any) -> str:
            if isinstance(a, DTensorSpec):
                return f"{a.layout_str()}{list(a.shape)}"
            if isinstance(a, tuple) and any(isinstance(x, DTensorSpec) for x in a):
                return "[" + ", ".join(show(x) for x in a) + "]"
            return repr(a)

        args = [show(a) for a in self.args_schema] + [f"{k}={show(v)}" for k, v in self.kwargs_schema]
        return f"{self.op}({', '.join(args)})"


_UNSET = object()


def _fix_meta(schema: OpSchema, meta: Any) -> Any:
    """Correct the meta kernels that disagree with the CPU kernels.

    native_batch_norm (and _native_batch_norm_legit) in eval mode: the meta kernel describes save_mean/save_invstd as (C,),
    the CPU kernel returns them empty (0,).
    """
    aten = torch.ops.aten
    if schema.op in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default) and not schema.arg(
        5, "training", True
    ):
        empty = TensorMeta(torch.Size([0]), (1,), meta[1].dtype)
        return (meta[0], empty, empty)
    return meta


def _iter_specs(values: tuple[Any, ...]) -> Iterator[DTensorSpec]:
    for a in values:
        if isinstance(a, DTensorSpec):
            yield a
        elif isinstance(a, tuple):
            yield from (x for x in a if isinstance(x, DTensorSpec))


def _to_meta(a: Any) -> Any:
    if isinstance(a, DTensorSpec):
        return torch.empty_strided(a.shape, a.tensor_meta.stride, dtype=a.dtype, device="meta")
    if isinstance(a, ScalarTensor):
        return torch.empty((), dtype=a.dtype, device="meta")
    if isinstance(a, tuple):
        return [_to_meta(x) for x in a] if any(isinstance(x, (DTensorSpec, ScalarTensor)) for x in a) else a
    return a


def _meta_of(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return TensorMeta(out.shape, tuple(out.stride()), out.dtype)
    if isinstance(out, (list, tuple)):
        return tuple(_meta_of(o) for o in out)
    return None


OutputLayouts = Union[Layout, tuple[Optional[Layout], ...], None]


@dataclass(frozen=True)
class PlacementStrategy:
    """One way to run an op: output layout(s), the layout each DTensor input must have
    (None: whatever it has), and the cost of moving each input there."""

    output_specs: OutputLayouts
    input_specs: tuple[Optional[Layout], ...]
    redistribute_cost: tuple[float, ...] = ()
    shape_arg: Optional[int] = None  # argument that holds output 0's shape: rewritten per rank
    # inputs (input_specs index) that may go from Replicate to the Partial this candidate asks
    # for (the planner's free `partialize`): e.g. a bias added once into partial sums
    partialize: tuple[int, ...] = ()

    def __str__(self) -> str:
        ins = ", ".join("*" if s is None else str(s) for s in self.input_specs)
        outs = self.output_specs
        out = ", ".join(str(o) for o in outs) if isinstance(outs, tuple) else str(outs)
        return f"[{ins}] -> {out}"


class StrategyType:
    """Base of `OpStrategy` and `TupleStrategy`."""


class OpStrategy(StrategyType):
    """The candidate placement strategies of one op call."""

    def __init__(self, strategies: list[PlacementStrategy]) -> None:
        self.strategies = strategies

    def __repr__(self) -> str:
        return "OpStrategy[" + "; ".join(str(s) for s in self.strategies) + "]"


class TupleStrategy(StrategyType):
    """Independent strategies, one per output (each sees all inputs, constrains its own)."""

    def __init__(self, childs: tuple[OpStrategy, ...]) -> None:
        self.childs = childs

    def __repr__(self) -> str:
        return "TupleStrategy(" + ", ".join(repr(c) for c in self.childs) + ")"


@dataclass(frozen=True)
class OutputSharding:
    """The propagator's answer for one schema.

    `input_specs[k]`: the spec DTensor input k (flattened order) must be moved to, or None to
    use it as it is; `output_spec`: the spec of each output; `shape_arg`: an argument to
    replace by output 0's local shape; `fallback`: the op ran replicated without a strategy;
    `dynamic`: its output shapes depend on the data, so they are read off the local result.
    """

    input_specs: tuple[Optional[DTensorSpec], ...]
    output_spec: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None]
    shape_arg: Optional[int] = None
    fallback: bool = False
    dynamic: bool = False

    @property
    def needs_redistribute(self) -> bool:
        return any(s is not None for s in self.input_specs)
