"""The partition-spec API (names as torch_xla's `torch_xla.distributed.spmd`): meshes with
named axes, `mark_sharding` with partition specs, `ShardingSpec` with tile assignment and
replication groups, manual sharding and `shard_map`. One layout underneath: every
partition spec maps to DTensor placements and back without loss.
"""

from ._manual import *  # noqa: F401,F403
from ._mark import *  # noqa: F401,F403
from ._mesh import *  # noqa: F401,F403
from ._sharding_spec import *  # noqa: F401,F403
from . import _manual, _mark, _mesh, _sharding_spec

__all__ = sorted(_manual.__all__ + _mark.__all__ + _mesh.__all__ + _sharding_spec.__all__)
