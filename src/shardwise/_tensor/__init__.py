"""The DTensor layer: the tensor subclass, its dispatch, constructors and random numbers."""

from ._api import distribute_tensor, empty, from_local, full, ones, rand, randn, zeros
from ._compile import CompiledFunction, compile
from ._dtensor import DTensor
from . import _local_step  # noqa: F401  (registers the local optimizer step: see its docstring)
from ._plans import implicit_replication
from ._random import manual_seed

__all__ = ["CompiledFunction", "DTensor", "compile", "distribute_tensor", "empty", "from_local", "full", "implicit_replication", "manual_seed", "ones", "rand", "randn", "zeros"]
