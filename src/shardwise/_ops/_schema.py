"""The data that op sharding rules consume and produce: `OpSchema` and `OutputSharding`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from .._layout import ShardOrder
from .._placement import Placement
from .._spec import DTensorSpec

__all__ = ["OpSchema", "OutputSharding", "Layout"]


class OpSchema:
    """One op call as a rule sees it: the op, argument specs (DTensorSpec for a distributed
    tensor argument, the value itself otherwise) and keyword arguments. Hashable, so
    propagation results are cached per schema."""

    __slots__ = ("op", "args_schema", "kwargs_schema", "_types", "_hash")

    def __init__(self, op: torch._ops.OpOverload, args_schema: tuple[Any, ...], kwargs_schema: tuple[tuple[str, Any], ...] = ()) -> None:
        self.op = op
        self.args_schema = args_schema
        self.kwargs_schema = kwargs_schema
        # Types too: 2 == 2.0 == True, but int, float and bool scalars give different dtypes.
        self._types = tuple(map(type, args_schema))
        self._hash = hash((op, args_schema, kwargs_schema, self._types))

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

    def tensor_specs(self) -> list[DTensorSpec]:
        return [a for a in self.args_schema if isinstance(a, DTensorSpec)]

    def __repr__(self) -> str:
        args = ", ".join(a.layout_str() if isinstance(a, DTensorSpec) else repr(a) for a in self.args_schema)
        return f"{self.op}({args})"


@dataclass(frozen=True)
class Layout:
    """Placements plus split order: what a rule asks of an input or promises of an output."""

    placements: tuple[Placement, ...]
    shard_order: ShardOrder = ()


@dataclass(frozen=True)
class OutputSharding:
    """A rule's answer: the layout each tensor input must have (None: as it is), the layout
    of each output, and which argument (if any) holds a shape to rewrite for the local op."""

    input_layouts: tuple[Optional[Layout], ...]
    output_layouts: Union[Layout, tuple[Optional[Layout], ...], None]
    shape_arg: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict)



