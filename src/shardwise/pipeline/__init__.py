"""Pipeline parallelism with skip connections that cross stages (names as torchgpipe's):
micro-batches, schedules as pure data, `Pipe` over devices in one process, stages over
processes, activation checkpointing, balancing, and `skippable` / `stash` / `pop` /
`Namespace` / `verify_skippables`.
"""

from . import skip
from ._balance import *  # noqa: F401,F403
from ._batchnorm import *  # noqa: F401,F403
from ._checkpoint import *  # noqa: F401,F403
from ._hf import *  # noqa: F401,F403
from ._microbatch import *  # noqa: F401,F403
from ._pipe import *  # noqa: F401,F403
from ._runtime import *  # noqa: F401,F403
from ._schedule import *  # noqa: F401,F403
from ._stage import PipelineStage, split_module
from ._timeline import *  # noqa: F401,F403
from ._pipe import GPipe  # torchgpipe's name for Pipe
from .skip import Namespace, inspect_skip_layout, pop, skippable, stash, verify_skippables
from . import _balance, _batchnorm, _checkpoint, _hf, _microbatch, _pipe, _runtime, _schedule, _timeline

__all__ = sorted(
    _balance.__all__ + _batchnorm.__all__ + _checkpoint.__all__ + _hf.__all__ + _microbatch.__all__ + _pipe.__all__ + _runtime.__all__ + _schedule.__all__
    + _timeline.__all__
    + ["GPipe", "Namespace", "PipelineStage", "split_module", "inspect_skip_layout", "pop", "skippable", "skip", "stash", "verify_skippables"]
)
