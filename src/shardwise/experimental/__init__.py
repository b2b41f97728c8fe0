"""Experimental APIs, named as torch's `torch.distributed.tensor.experimental`: context
parallelism (`context_parallel`, `context_parallel_unshard`, `set_rotate_method`)."""

from ..parallel._context_parallel import (
    context_parallel,
    context_parallel_unshard,
    set_load_balance,
    set_rotate_method,
)

__all__ = ["context_parallel", "context_parallel_unshard", "set_load_balance", "set_rotate_method"]
