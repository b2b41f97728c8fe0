"""A torch program's `torch.distributed.tensor.parallel.loss_parallel()` around shardwise DTensors.

torch's context manager turns loss parallelism on for torch's own DTensor (it installs
handlers in torch DTensor's dispatcher). A program ported by changing its imports may still
call it by its full path, as torchtitan does; its loss ops on shardwise DTensors then run as
under `shardwise.parallel.loss_parallel()`: the logits stay split over the classes, and only
the small per-row reductions move. torch's module is only looked at where the program
imported it; shardwise never imports it, and changes nothing in torch.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["torch_loss_parallel_on"]

_NLL = torch.ops.aten.nll_loss_forward.default


def torch_loss_parallel_on() -> bool:
    """Whether torch's loss_parallel() is on (its nll_loss handler is installed in torch DTensor's
    dispatcher; torch's module is read only where the program imported it)."""
    torch_tensor = sys.modules.get("torch.distributed.tensor")
    if torch_tensor is None:
        return False
    dtensor = getattr(torch_tensor, "DTensor", None)
    handlers = getattr(getattr(dtensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    return isinstance(handlers, dict) and _NLL in handlers
