"""The one registry of op strategies and the decorator that fills it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional, Union

import torch

from ._schema import OpSchema, StrategyType

__all__ = ["StrategyFn", "register_op_strategy", "get_op_strategy", "registered_ops"]

OpOverload = torch._ops.OpOverload
# A strategy function maps an op call (global specs of its inputs, on an abstract or real
# mesh) to its candidate strategies. Pure: it never talks to processes.
StrategyFn = Callable[[OpSchema], StrategyType]

_STRATEGIES: dict[OpOverload, StrategyFn] = {}


def register_op_strategy(ops: Union[OpOverload, Iterable[OpOverload]]) -> Callable[[StrategyFn], StrategyFn]:
    """Register a strategy function for one aten op overload or a list of them::

        @register_op_strategy([aten.relu.default, aten.gelu.default])
        def activation_strategy(schema: OpSchema) -> OpStrategy: ...
    """
    targets = [ops] if isinstance(ops, OpOverload) else list(ops)

    def wrap(fn: StrategyFn) -> StrategyFn:
        for op in targets:
            if not isinstance(op, OpOverload):
                raise TypeError(f"register_op_strategy takes aten op overloads (aten.add.Tensor), got {op!r}")
            _STRATEGIES[op] = fn
        return fn

    return wrap


def get_op_strategy(op: OpOverload) -> Optional[StrategyFn]:
    return _STRATEGIES.get(op)


def registered_ops() -> list[OpOverload]:
    return list(_STRATEGIES)
