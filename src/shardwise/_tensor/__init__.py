"""The DTensor layer: the tensor subclass, its dispatch, constructors and random numbers; and the
end-of-backward registry every layer below registers its gradient reductions with."""

from ._api import distribute_tensor, empty, from_local, full, ones, rand, randn, zeros
from ._compile import CompiledFunction, compile
from ._dtensor import DTensor
from ._end_of_backward import LEVELS, GradientReducer, Step, arm, caller_place, disarm, is_armed, reducers_at, register, unregister
from ._grad_reduce import deferred, layout_reducer, unwatch_leaf, watch_plain_leaf
from ._group_sum import GroupSum
from . import _local_step  # noqa: F401  (registers the local optimizer step: see its docstring)
from ._plans import implicit_replication
from ._random import manual_seed

__all__ = ["CompiledFunction", "DTensor", "compile", "distribute_tensor", "empty", "from_local", "full", "implicit_replication", "manual_seed", "ones", "rand", "randn", "zeros"]
# the end-of-backward registry, for the layers that reduce gradients (parallel, fsdp, debug)
__all__ += ["LEVELS", "GradientReducer", "GroupSum", "Step", "arm", "caller_place", "deferred", "disarm", "is_armed",
            "layout_reducer", "reducers_at", "register", "unregister", "unwatch_leaf", "watch_plain_leaf"]
