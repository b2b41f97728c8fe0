"""Sharded data parallel by units, under the names of torch's FSDP2 (`torch.distributed.fsdp`).

Changing `from torch.distributed.fsdp import fully_shard` to `from shardwise.fsdp import
fully_shard` (and the mesh to `shardwise.init_device_mesh`) is the whole switch: each
`fully_shard` call makes one unit whose parameters are gathered by one all_gather before
its forward, freed after, gathered again for its backward and reduce-scattered by one
collective; the next unit is gathered while this one computes.
"""

from ._api import fully_shard
from ._module import FSDPModule, UnshardHandle
from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._state import reduce_accumulated as reduce_accumulated  # not public (not in __all__): for shardwise.pipelining

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
]
