"""Experimental APIs, named as torch's `torch.distributed.tensor.experimental`: context
parallelism (`context_parallel`, `context_parallel_unshard`, `set_rotate_method`), and its
plan style `ContextParallel` (also in `shardwise.parallel`)."""

from ..parallel._context_parallel import (
    context_parallel,
    context_parallel_unshard,
    set_load_balance,
    set_rotate_method,
)
from ..parallel import ContextParallel

__all__ = ["ContextParallel", "context_parallel", "context_parallel_unshard", "set_load_balance", "set_rotate_method"]
