"""`save_pretrained`: a model whose parameters are DTensors as a `from_pretrained` directory, no tensor gathered.

Every rank calls it; the weights go through `HuggingFaceStorageWriter` (each rank writes its
own pieces' bytes into the shared safetensors files), and the config, and the generation
config of a model that generates, are written by rank 0 and switched in with the weights,
as transformers' own `save_pretrained` writes them. A weight tied to another (an LM head
sharing the embedding) is one tensor under two names; safetensors holds it once, under the
name transformers keeps: the names the model declares as tied targets are left out.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path as FilePath
from typing import Any, Optional, Union

from torch import nn

from .._source_names import source_names
from ._hf_layout import DEFAULT_MAX_SHARD_SIZE
from ._hf_write import HuggingFaceStorageWriter
from ._transaction import save

__all__ = ["save_pretrained"]

_IGNORED = {"safe_serialization": True, "is_main_process": None}  # every rank writes; only safetensors


def save_pretrained(model: nn.Module, save_directory: Union[str, os.PathLike[str]], config: Any = None, *,
                    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                    state_dict: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
    """Write `model` (its `state_dict()`, or `state_dict`) as a Hugging Face model directory; call on every rank.

    `model` may be a pipeline cut from a transformers model (`hf_sequential(model)`, or a
    `DistributedPipe` of it): each rank writes the tensors its stages hold, under the names
    of the model they were cut from, with that model's config.

    `config` (a transformers config) is written as config.json; None writes the model's own
    `config`, if it has one, with its dtype and architecture set as transformers does. The
    weights are split into files of at most `max_shard_size`. transformers' `from_pretrained`
    loads the directory in one process, or on another mesh through `shardwise.checkpoint.load`.
    """
    bad = [k for k in kwargs if k not in _IGNORED or (k == "safe_serialization" and kwargs[k] is not True)]
    if bad:
        raise TypeError(f"save_pretrained writes safetensors from every rank's own pieces; it takes config=, "
                        f"max_shard_size= and state_dict=, not {', '.join(f'{k}={kwargs[k]!r}' for k in bad)}")
    state = dict(model.state_dict(keep_vars=True) if state_dict is None else state_dict)
    source = source_names(model)
    if source is not None:  # a pipeline's stages: each rank writes the tensors its stages hold, by the model's names
        hf = source.source_model()
        if hf is None:
            raise ValueError(f"{type(model).__name__} was cut from a model that no longer exists, and save_pretrained "
                             "writes that model's names, config and tied weights: keep the model given to "
                             "hf_sequential alive until the save is done")
        tied = dict(getattr(hf, "all_tied_weights_keys", None) or {})
        state = {source.names.get(k, k): v for k, v in state.items()}
        # a tied weight's copy on another stage: the files hold it once, under its source's name
        state = {k: v for k, v in state.items() if not (k in tied and tied[k] in source.keys)}
        model = hf
    writer = HuggingFaceStorageWriter(save_directory, max_shard_size, extra_files=_config_files(model, config))
    save(_untied(model, state), storage_writer=writer)


def _untied(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each tensor held under several names kept under one: the name that is not
    a declared tied target (transformers' `all_tied_weights_keys`), else the first."""
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    names: dict[int, list[str]] = {}
    for name, value in state.items():
        names.setdefault(id(value), []).append(name)
    dropped: set[str] = set()
    for group in names.values():
        if len(group) > 1:
            keep = next((n for n in group if n not in targets), group[0])
            dropped.update(n for n in group if n != keep)
    return {name: value for name, value in state.items() if name not in dropped}


def _config_files(model: nn.Module, config: Any) -> dict[str, bytes]:
    """The files transformers' config (and generation config) `save_pretrained` writes, by name."""
    configs = []
    if config is None and getattr(model, "config", None) is not None:
        config = model.config
        dtype = getattr(model, "dtype", None)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard's subclass: the model's own
    if config is not None:
        configs.append(config)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        configs.append(model.generation_config)
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="shardwise-config-") as scratch:
        for each in configs:
            each.save_pretrained(scratch)
        for path in sorted(FilePath(scratch).iterdir()):
            files[path.name] = path.read_bytes()
    return files
