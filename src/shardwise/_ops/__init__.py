"""Op sharding strategies: schema types, the registry, the propagator and one module per op family."""

# Importing a family module registers its strategies; later modules override earlier ones.
from . import _pointwise  # noqa: F401
from . import _conv, _factory, _foreach, _index, _matmul, _nn, _norm, _reduction, _shape, _view  # noqa: F401
from . import _fft, _linalg, _loss, _misc, _spatial  # noqa: F401
from . import _loss_parallel  # noqa: F401  (last: wraps the log_softmax / nll_loss strategies)
from ._propagate import RELAYOUT_OPS, REPLICATED_OPS, is_strict, propagate, redistribute_cost, set_strict, strategy_calls
from ._registry import get_op_strategy, register_op_strategy, registered_ops
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
    "Layout",
    "OpSchema",
    "OpStrategy",
    "OutputSharding",
    "PlacementStrategy",
    "ScalarTensor",
    "StrategyType",
    "TupleStrategy",
    "expand_to_mesh",
    "get_op_strategy",
    "is_strict",
    "RELAYOUT_OPS",
    "REPLICATED_OPS",
    "propagate",
    "redistribute_cost",
    "register_op_strategy",
    "registered_ops",
    "set_strict",
    "strategy_calls",
]
