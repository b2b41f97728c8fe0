"""Op rules: schema types, the one registry, the propagator and one module per op family.

Importing a family module registers its rules; each overload has exactly one rule (per
mode), so the order the families are imported in never changes an answer.
"""

from . import _conv, _embedding, _factory, _foreach, _index, _matmul, _nll, _nn, _norm, _pointwise  # noqa: F401
from . import _fft, _linalg, _loss, _loss_parallel, _misc, _reduction, _replicated, _shape, _spatial, _view  # noqa: F401
from ._call import Location, OpCall, PlainTensor
from ._local import LocalCall, LocalFn, Runtime
from ._plan import OpPlan, make_plan
from ._propagate import is_strict, propagate, redistribute_cost, set_strict, strategy_calls
from ._registry import (
    ACTIVE_MODES,
    OpKind,
    OpRule,
    active_modes,
    get_op_strategy,
    op_mode,
    register_op_kind,
    register_op_strategy,
    registered_ops,
    registered_rules,
    rule_for,
)
from ._schema import (
    Layout,
    OpSchema,
    OpStrategy,
    OutputSharding,
    PlacementStrategy,
    ScalarTensor,
    StrategyType,
    TupleStrategy,
)
from ._utils import expand_to_mesh

__all__ = [
    "ACTIVE_MODES",
    "Layout",
    "LocalCall",
    "LocalFn",
    "Location",
    "OpCall",
    "OpKind",
    "OpPlan",
    "OpRule",
    "OpSchema",
    "OpStrategy",
    "OutputSharding",
    "PlacementStrategy",
    "PlainTensor",
    "Runtime",
    "ScalarTensor",
    "StrategyType",
    "TupleStrategy",
    "active_modes",
    "expand_to_mesh",
    "get_op_strategy",
    "is_strict",
    "make_plan",
    "op_mode",
    "propagate",
    "redistribute_cost",
    "register_op_kind",
    "register_op_strategy",
    "registered_ops",
    "registered_rules",
    "rule_for",
    "set_strict",
    "strategy_calls",
]
