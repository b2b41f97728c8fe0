"""The DTensor layer: the tensor subclass, its dispatch, constructors and random numbers."""

from ._api import distribute_tensor, empty, from_local, full, ones, rand, randn, zeros
from ._dtensor import DTensor
from ._random import manual_seed

__all__ = ["DTensor", "distribute_tensor", "empty", "from_local", "full", "manual_seed", "ones", "rand", "randn", "zeros"]
