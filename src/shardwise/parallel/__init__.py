"""Module-level parallelism: distribute_module, sharding plans and planners, tensor-parallel
styles and parallelize_module, loss parallel, data parallel (replicated or ZeRO-3 sharded),
and `from_pretrained` (a Hugging Face model loaded straight into its shards).

Public names mirror `torch.distributed.tensor.parallel`, `torch.distributed.tensor`'s
`distribute_module` and `torch.distributed._shard.sharding_plan`; the implementation is in
private modules, one job each.
"""

from ._coverage import *  # noqa: F401,F403
from ._cp_style import *  # noqa: F401,F403
from ._data_parallel import *  # noqa: F401,F403
from ._distribute import *  # noqa: F401,F403
from ._expert_balance import *  # noqa: F401,F403
from ._experts import *  # noqa: F401,F403
from ._hf_from_pretrained import *  # noqa: F401,F403
from ._hf_plan import *  # noqa: F401,F403
from ._hf_trainer import *  # noqa: F401,F403
from ._loss import *  # noqa: F401,F403
from ._megatron import *  # noqa: F401,F403
from ._parallelize import *  # noqa: F401,F403
from ._plan import *  # noqa: F401,F403
from ._prepare import *  # noqa: F401,F403
from ._replicate import *  # noqa: F401,F403
from ._router_loss import *  # noqa: F401,F403
from ._style import *  # noqa: F401,F403
from . import _coverage, _cp_style, _data_parallel, _distribute, _expert_balance, _experts, _hf_from_pretrained, _hf_plan, _hf_trainer, _loss, _megatron, _parallelize, _plan, _prepare, _replicate, _router_loss, _style

__all__ = sorted(
    _coverage.__all__ + _cp_style.__all__ + _data_parallel.__all__ + _distribute.__all__ + _expert_balance.__all__ + _experts.__all__ + _hf_from_pretrained.__all__ + _hf_plan.__all__ + _hf_trainer.__all__ + _loss.__all__ + _megatron.__all__ + _parallelize.__all__
    + _plan.__all__ + _prepare.__all__ + _replicate.__all__ + _router_loss.__all__ + _style.__all__
)
