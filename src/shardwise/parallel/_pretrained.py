"""`model.save_pretrained` for a Hugging Face model whose parameters are DTensors.

transformers' own `model.save_pretrained(path)` writes the tensors of `model.state_dict()`
through safetensors, which reads their storage: a DTensor has no single storage (each rank
holds a piece), so the save fails, and writing the pieces as the wholes would be silently
wrong. `shard_module`, `parallelize_module` and `data_parallel` make `model.save_pretrained`
`shardwise.checkpoint.save_pretrained` for the models they shard (an attribute of that one
model instance), so a training script's `model.save_pretrained(path)` works unchanged, on
every rank: each rank writes its own pieces' bytes into the standard safetensors files
(config, `model*.safetensors`, the index for several files), no tensor is gathered, and
the directory loads with `from_pretrained` in one process.

The writer lives in `checkpoint` (its files, agreements and crash consistency); this module
only installs it, importing it when a model saves.
"""

from __future__ import annotations

import os
import types
from typing import Any, Union

from torch import nn

__all__ = ["save_pretrained"]

_ADOPTED = "_shardwise_save_pretrained"


def save_pretrained(model: nn.Module, save_directory: Union[str, "os.PathLike[str]"], **kwargs: Any) -> None:
    """`shardwise.checkpoint.save_pretrained(model, save_directory, **kwargs)`; call on every rank."""
    from ..checkpoint import save_pretrained as write

    write(model, save_directory, **kwargs)


def adopt_save_pretrained(model: nn.Module) -> None:
    """Make this model instance's `save_pretrained` the sharded one (a Hugging Face model only)."""
    if getattr(type(model), "save_pretrained", None) is None or not hasattr(model, "config"):
        return
    if _ADOPTED not in model.__dict__:
        object.__setattr__(model, _ADOPTED, True)
        object.__setattr__(model, "save_pretrained", types.MethodType(save_pretrained, model))
