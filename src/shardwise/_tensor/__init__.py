"""The DTensor layer: the tensor subclass, its dispatch, constructors and random numbers; and the
end-of-backward registry every layer below registers its gradient reductions with."""

from ._api import distribute_tensor, empty, from_local, full, ones, rand, randn, zeros
from ._dtensor import DTensor
from ._end_of_backward import LEVELS, GradientReducer, Step, arm, averaged_within_layout, caller_place, disarm, is_armed, reducers_at, register, unregister
from ._grad_reduce import deferred, layout_reducer, unwatch_leaf, watch_plain_leaf
from ._group_sum import GroupSum
from . import _local_step  # noqa: F401  (registers the local optimizer step: see its docstring)
from ._plans import implicit_replication
from ._random import manual_seed
from ._autograd import scale_grad, to_local
from ._cross import CrossMove, _region, plan_cross, ranks_of
from ._dispatch import check_plain_afresh
from ._plain import FINGERPRINT_WIDTH, fingerprint, same_fingerprint
from ._redistribute import redistribute_local
from ._traceable import eager_hook, mark_loaded, redistribute_node
from ._wrap import DTENSOR_CLASSES

__all__ = ["DTensor", "distribute_tensor", "empty", "from_local", "full", "implicit_replication", "manual_seed", "ones", "rand", "randn", "zeros"]
# the end-of-backward registry, for the layers that reduce gradients (parallel, fsdp, debug)
__all__ += ["LEVELS", "GradientReducer", "GroupSum", "Step", "arm", "caller_place", "deferred", "disarm", "is_armed",
            "layout_reducer", "averaged_within_layout", "reducers_at", "register", "unregister", "unwatch_leaf", "watch_plain_leaf"]
# for the layers above: the root, parallel, pipeline, fsdp, spmd, debug, _explain
__all__ += ["DTENSOR_CLASSES", "FINGERPRINT_WIDTH", "CrossMove", "_region", "check_plain_afresh", "eager_hook",
            "fingerprint", "mark_loaded", "plan_cross", "ranks_of", "redistribute_local", "redistribute_node",
            "same_fingerprint", "scale_grad", "to_local"]
