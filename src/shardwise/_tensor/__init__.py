"""The DTensor layer: the tensor subclass, its dispatch, constructors and random numbers."""

from ._api import distribute_tensor, empty, from_local, full, ones, rand, randn, zeros
from . import _random_ops  # noqa: F401  (registers local impls of random ops)
from . import _nn_impls  # noqa: F401  (masked local computations: vocab-sharded embedding, split mean loss)
from . import _loss_parallel_impls  # noqa: F401  (loss-parallel local computations)
from ._compile import CompiledFunction, compile
from ._dispatch import implicit_replication
from ._dtensor import DTensor
from ._random import manual_seed

__all__ = ["CompiledFunction", "DTensor", "compile", "distribute_tensor", "empty", "from_local", "full", "implicit_replication", "manual_seed", "ones", "rand", "randn", "zeros"]
