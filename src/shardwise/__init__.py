"""shardwise: run single-device PyTorch code as one SPMD program over a mesh of devices.

Public names mirror `torch.distributed.tensor`, so switching is an import change:

>>> from shardwise import Shard, Replicate, Partial
>>> [str(p) for p in (Shard(0), Replicate(), Partial())]
['S(0)', 'R', 'P(sum)']
"""

from ._comm import CollectiveError, CommRecord, comm_log
from ._explain import explain_redistribute, plan_for
from ._explicit import ImplicitRedistributionError, explicit
from ._mesh import AbstractMesh, DeviceMesh, current_mesh, get_current_mesh, init_device_mesh
from ._placement import Partial, Placement, Replicate, Shard
from ._redistribute import COST_MODEL, RedistributePlan
from ._spec import DTensorSpec, TensorMeta
from ._ops import set_strict
from ._compile import compile
from ._tensor import (
    DTensor,
    distribute_tensor,
    empty,
    from_local,
    full,
    implicit_replication,
    manual_seed,
    ones,
    rand,
    randn,
    zeros,
)

from .parallel import distribute_module

__version__ = "0.1.0"

__all__ = [
    "AbstractMesh",
    "COST_MODEL",
    "CollectiveError",
    "CommRecord",
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "ImplicitRedistributionError",
    "Partial",
    "Placement",
    "RedistributePlan",
    "Replicate",
    "Shard",
    "TensorMeta",
    "comm_log",
    "compile",
    "current_mesh",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "explain_redistribute",
    "explicit",
    "from_local",
    "full",
    "get_current_mesh",
    "implicit_replication",
    "init_device_mesh",
    "manual_seed",
    "ones",
    "plan_for",
    "rand",
    "randn",
    "set_strict",
    "zeros",
]

# torch.compile: once torch._dynamo is loaded, dynamo never starts a frame in shardwise's code
# (modules still loading when it registered are covered here; later ones on import)
from ._tensor import mark_loaded as _mark_loaded  # noqa: E402

_mark_loaded()
