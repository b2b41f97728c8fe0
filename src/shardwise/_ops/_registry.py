"""The one registry of op sharding rules and the decorator that fills it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch

from ._schema import OpSchema, OutputSharding

__all__ = ["Rule", "register_rule", "get_rule", "registered_ops"]

OpOverload = torch._ops.OpOverload
# A rule maps an op call (global input specs) and the global meta of its outputs (from a
# meta-device run) to the layouts the inputs must have and the outputs will have.
Rule = Callable[[OpSchema, Any], OutputSharding]

_RULES: dict[OpOverload, Rule] = {}


def register_rule(ops: Union[OpOverload, Iterable[OpOverload]]) -> Callable[[Rule], Rule]:
    """Register `rule` for one op overload or a list of them."""
    targets = [ops] if isinstance(ops, OpOverload) else list(ops)

    def wrap(rule: Rule) -> Rule:
        for op in targets:
            _RULES[op] = rule
        return rule

    return wrap


def get_rule(op: OpOverload) -> Optional[Rule]:
    return _RULES.get(op)


def registered_ops() -> list[OpOverload]:
    return list(_RULES)
