"""Op rules: schema types, the one registry, the propagator and one module per op family.

Importing a family module registers its rules; each overload has exactly one rule (per
mode), so the order the families are imported in never changes an answer.
"""

from . import _conv, _embedding, _factory, _foreach, _index, _matmul, _nll, _nn, _norm, _pointwise  # noqa: F401
from . import _fft, _linalg, _loss, _loss_parallel, _misc, _reduction, _replicated, _shape, _spatial, _view  # noqa: F401
from ._batched_linear import LinearLayouts, linear_layouts
from ._call import Location, OpCall, PlainTensor
from ._local import LocalCall, LocalFn, Runtime
from ._loss_parallel import LOSS_PARALLEL, LOSS_PARALLEL_OPS
from ._plan import OpPlan, RunDecomposed, RunOutside, RunPerMesh, RunSharded, make_plan
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
from ._random import neutral_term
from ._strided_plan import CatParts, SliceBackwardParts, SliceParts, SplitParts, Unstride
from ._utils import expand_to_mesh, order_like

__all__ = [
    "ACTIVE_MODES",
    "LOSS_PARALLEL",
    "LOSS_PARALLEL_OPS",
    "CatParts",
    "Layout",
    "LinearLayouts",
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
    "RunDecomposed",
    "RunOutside",
    "RunPerMesh",
    "RunSharded",
    "Runtime",
    "ScalarTensor",
    "SliceBackwardParts",
    "SliceParts",
    "SplitParts",
    "StrategyType",
    "TupleStrategy",
    "Unstride",
    "active_modes",
    "expand_to_mesh",
    "get_op_strategy",
    "is_strict",
    "linear_layouts",
    "make_plan",
    "neutral_term",
    "op_mode",
    "order_like",
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
