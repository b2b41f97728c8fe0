"""Op sharding rules: schema types, the registry, the propagator and one module per op family."""

from . import _basic, _pointwise  # noqa: F401  (register their rules)
from ._propagate import PropagationResult, ScalarTensor, propagate
from ._registry import get_rule, register_rule, registered_ops
from ._schema import Layout, OpSchema, OutputSharding

__all__ = [
    "Layout",
    "OpSchema",
    "OutputSharding",
    "PropagationResult",
    "ScalarTensor",
    "get_rule",
    "propagate",
    "register_rule",
    "registered_ops",
]
