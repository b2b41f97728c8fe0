"""`save_pretrained` for a Hugging Face model whose parameters are DTensors.

transformers' own `model.save_pretrained(path)` writes the tensors of `model.state_dict()`
through safetensors, which reads their storage: a DTensor has no single storage (each rank
holds a piece), so the save fails, and writing the pieces as the wholes would be silently
wrong. Here every rank calls `save_pretrained(model, path)`; each DTensor of the state
dict is gathered whole, one at a time (a tied weight once), and rank 0 calls the model's
own `save_pretrained` with those tensors, so the directory is the standard one (config,
`model*.safetensors`, the index for a large model) that `from_pretrained` loads in one
process. The ranks then agree that rank 0 finished: a failed write raises on every rank.

`shard_module`, `parallelize_module` and `data_parallel` make `model.save_pretrained` this
function for the models they shard (an attribute of that one model instance), so a training
script's `model.save_pretrained(path)` works unchanged. Rank 0 holds the whole model in
memory while it writes; `shardwise.checkpoint` writes sharded checkpoints without that.
"""

from __future__ import annotations

import os
import types
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import _comm as comm
from .._mesh import DeviceMesh
from .._tensor import DTensor

__all__ = ["save_pretrained"]

_ADOPTED = "_shardwise_save_pretrained"


def save_pretrained(model: nn.Module, save_directory: Union[str, "os.PathLike[str]"], **kwargs: Any) -> None:
    """Write `model` as a Hugging Face model directory, its DTensors gathered whole; call on every rank.

    `kwargs` go to the model's own `save_pretrained` on rank 0 (`max_shard_size`,
    `safe_serialization`, ...); `state_dict` and `is_main_process` are set here.
    """
    own = getattr(type(model), "save_pretrained", None)
    if own is None:
        raise TypeError(f"save_pretrained writes a Hugging Face model (a transformers PreTrainedModel); "
                        f"{type(model).__name__} has no save_pretrained: use shardwise.checkpoint.save")
    for key in ("state_dict", "is_main_process"):
        if key in kwargs:
            raise TypeError(f"save_pretrained gathers the model's own state dict on every rank and writes on rank 0: "
                            f"drop {key}=")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    whole: dict[str, torch.Tensor] = {}
    gathered: dict[int, Optional[torch.Tensor]] = {}  # id(parameter) -> its whole tensor: a tied weight once
    mesh: Optional[DeviceMesh] = None
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, DTensor):
                mesh = mesh or value.device_mesh
                if id(value) not in gathered:  # every rank gathers the same tensors in the same order
                    full = value.full_tensor().detach()
                    gathered[id(value)] = full if rank == 0 else None  # the others keep one at a time
                if rank == 0:
                    whole[name] = gathered[id(value)]  # type: ignore[assignment]
            elif rank == 0:
                whole[name] = value.detach()
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            own(model, save_directory, state_dict=whole, is_main_process=True, **kwargs)
        except Exception as exc:  # the others must hear of it, not wait for a write that never ends
            error = exc
    if mesh is not None and mesh.size() > 1:
        rows = comm.gather_over_mesh([0 if error is None else 1], mesh.get_all_groups(), mesh.shape)
        if any(row[0] for row in rows) and error is None:
            raise RuntimeError(f"save_pretrained to {os.fspath(save_directory)!r} failed on rank 0 (its error says why): "
                               f"the directory may hold a partial save")
    if error is not None:
        raise error


def adopt_save_pretrained(model: nn.Module) -> None:
    """Make this model instance's `save_pretrained` the gathering one (a Hugging Face model only)."""
    if getattr(type(model), "save_pretrained", None) is None or not hasattr(model, "config"):
        return
    if _ADOPTED not in model.__dict__:
        object.__setattr__(model, _ADOPTED, True)
        object.__setattr__(model, "save_pretrained", types.MethodType(save_pretrained, model))
