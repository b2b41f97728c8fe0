"""`from_pretrained`: a Hugging Face model loaded straight into shards on a shardwise mesh, each rank reading its own bytes.

transformers' own `from_pretrained(path, tp_plan="auto", device_mesh=mesh)` cannot take a
shardwise mesh. A `tp_plan` (or `tp_size`) makes transformers build its own mesh with
`torch.distributed.init_device_mesh` over every process and shard with torch's DTensor and
torch's styles: the `device_mesh` given is overwritten, never read (transformers 5.x,
`DistributedConfig`). Without a `tp_plan` the mesh is only used to place the weights no file
holds, and every rank loads the whole model. Nothing there takes another mesh or other
styles short of replacing transformers' functions in the process, so shardwise's entry point
is its own function with transformers' arguments:

    model = shardwise.parallel.from_pretrained(transformers.AutoModelForCausalLM, "llama/",
                                               device_mesh=mesh, tp_plan="auto", fsdp="dp")

It does what transformers does on its own mesh, on shardwise's. The model is built from the
config on the meta device, so no rank ever holds the whole of it; the plan is applied there:
the model's own tensor-parallel plan through `HFPlanner` on the mesh's tp dim (the whole of a
1-D mesh, else the dim named "tp", as transformers requires), then, with `fsdp=` naming a
mesh dim, `fully_shard` over it, one unit per block the model declares
(`_no_split_modules`, transformers' own unit of sharding) and one at the root; each rank
then allocates its own pieces (`to_empty`) and `checkpoint.load_pretrained` fills them,
reading from the safetensors files only the bytes of those pieces; the buffers no file holds
(rotary tables) are computed by the model's own init, as in `from_pretrained`. The result
equals transformers' `from_pretrained(path)` followed by the same sharding, bit for bit.

Where it differs from transformers, on purpose: a key the files lack (or one they hold and
the model lacks) is an error before anything is read, not a warning and a random init
(memory from `to_empty` is no initial value); `path` is a local directory (download a Hub
model first).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path as FilePath
from typing import Any, Optional, Union

import torch
from torch import nn

from .._describe import describe, refuse_torch
from .._mesh import DeviceMesh
from ..fsdp import fully_shard
from ._hf_plan import HFPlanner, hf_tp_plan
from ._parallelize import parallelize_module
from ._plan import match

__all__ = ["from_pretrained"]

# transformers' from_pretrained arguments that load some other way than this one
_REFUSED = {
    "device_map": "the mesh places the model: drop device_map",
    "tp_size": "the mesh's tp dim sets it",
    "distributed_config": "pass tp_plan= and fsdp= with a shardwise device_mesh",
    "state_dict": "this reads the files at the path",
    "gguf_file": "this reads safetensors files",
    "quantization_config": "quantized loading is transformers' own",
}


def from_pretrained(cls: Any, pretrained_model_name_or_path: Union[str, "os.PathLike[str]"], *,
                    device_mesh: DeviceMesh, tp_plan: Union[None, str, Mapping[str, Any]] = None,
                    fsdp: Optional[str] = None, dtype: Any = "auto", **kwargs: Any) -> nn.Module:
    """`cls.from_pretrained(path, tp_plan=..., device_mesh=...)` on a shardwise mesh; every rank of it calls this.

    `cls` is a transformers model class (`LlamaForCausalLM`) or an Auto class
    (`AutoModelForCausalLM`); `pretrained_model_name_or_path` the directory transformers'
    `save_pretrained` wrote. `tp_plan`: None (no tensor parallelism), "auto" (the model's own
    plan, `model.tp_plan`) or a dict of transformers' style names (or shardwise styles) that
    replaces or adds entries of that plan (`{}`: none), applied by `HFPlanner` on the mesh's
    tp dim. `fsdp`: None or the name of the mesh dim `fully_shard` shards over (FSDP x TP on
    a ("dp", "tp") mesh with `fsdp="dp"`); a mesh dim neither uses holds the model
    replicated. `dtype` and the other keyword arguments are `from_pretrained`'s ("auto": the
    config's dtype, else the files'; `attn_implementation=...`, config overrides). Returns
    the model in eval mode, as `from_pretrained` does.

    >>> from_pretrained("LlamaForCausalLM", "llama/", device_mesh=None, tp_plan="auto")
    Traceback (most recent call last):
    ...
    TypeError: from_pretrained(device_mesh=...) needs a shardwise DeviceMesh, got None (NoneType): build one with shardwise.init_device_mesh
    """
    if not isinstance(device_mesh, DeviceMesh):
        refuse_torch(device_mesh, "from_pretrained(device_mesh=...)")
        raise TypeError(f"from_pretrained(device_mesh=...) needs a shardwise DeviceMesh, got {describe(device_mesh)}: "
                        f"build one with shardwise.init_device_mesh")
    refused = [f"{k}= ({why})" for k, why in _REFUSED.items() if k in kwargs]
    if refused:
        raise TypeError(f"shardwise's from_pretrained loads safetensors into the shards of a mesh; it does not take "
                        f"{', '.join(refused)}")
    build, config_class = _builders(cls)
    path = FilePath(pretrained_model_name_or_path)
    if tp_plan is not None and not isinstance(tp_plan, Mapping) and tp_plan != "auto":
        raise ValueError(f"from_pretrained(tp_plan={tp_plan!r}): \"auto\" (the model's own plan), a dict of entries "
                         f"that change it, or None")
    tp = tp_plan is not None and tp_plan != {}
    tp_mesh, fsdp_mesh = _sub_meshes(device_mesh, tp, fsdp)
    if not path.is_dir():
        raise ValueError(f"from_pretrained({str(pretrained_model_name_or_path)!r}): not a directory: pass the "
                         f"directory transformers' save_pretrained wrote (a Hub model: download it first, e.g. with "
                         f"huggingface_hub.snapshot_download)")

    config, model_kwargs = config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
    config.name_or_path = str(pretrained_model_name_or_path)
    dtype = _dtype(dtype, config, path)
    with torch.device("meta"):  # no rank ever holds the whole model
        model: nn.Module = build(config, dtype=dtype, **model_kwargs)
    if tp_mesh is not None:
        overrides = dict(tp_plan) if isinstance(tp_plan, Mapping) else {}
        _check_keys(model, overrides)
        model = parallelize_module(model, tp_mesh, HFPlanner(overrides))
    if fsdp_mesh is not None:
        _fully_shard(model, fsdp_mesh)
    model.to_empty(device=_device(device_mesh))
    from ..checkpoint import load_pretrained  # checkpoint is imported when a model loads

    load_pretrained(model, path)
    _generation_config(model, path)
    return model.eval()


def _builders(cls: Any) -> tuple[Any, Any]:
    """How `cls` builds a model from a config, and the class that reads its config."""
    if hasattr(cls, "from_config") and hasattr(cls, "_model_mapping"):  # an Auto class
        import transformers

        return cls.from_config, transformers.AutoConfig
    if isinstance(cls, type) and hasattr(cls, "_from_config") and getattr(cls, "config_class", None):
        return cls._from_config, getattr(cls, "config_class")
    raise TypeError(f"from_pretrained takes a transformers model class (e.g. LlamaForCausalLM) or an Auto class "
                    f"(e.g. AutoModelForCausalLM), got {describe(cls)}")


def _sub_meshes(mesh: DeviceMesh, tp: bool, fsdp: Optional[str]) -> tuple[Optional[DeviceMesh], Optional[DeviceMesh]]:
    """The tensor-parallel and fully-sharded sub-meshes of `mesh` (None: not used); one
    ValueError listing every problem."""
    if fsdp is not None and not isinstance(fsdp, str):
        raise TypeError(f"from_pretrained(fsdp=...) takes the name of a mesh dim, got {describe(fsdp)}")
    names = tuple(mesh.mesh_dim_names or ())
    problems = []
    if fsdp is not None and fsdp not in names:
        problems.append(f"fsdp={fsdp!r} is not a dim of the mesh (dims: {names or 'unnamed'})")
    tp_mesh: Optional[DeviceMesh] = None
    if tp and mesh.ndim == 1 and fsdp is None:
        tp_mesh = mesh
    elif tp and "tp" not in names:
        problems.append(f"a tp_plan on a mesh of shape {tuple(mesh.shape)} with dims {names or 'unnamed'}: name its "
                        f"tensor-parallel dim 'tp' (init_device_mesh(..., mesh_dim_names=(..., 'tp')))")
    elif tp and fsdp == "tp":
        problems.append("fsdp='tp' names the tensor-parallel dim: fully_shard over another dim")
    elif tp:
        tp_mesh = mesh["tp"]
    if not tp and fsdp is None:
        problems.append("neither tp_plan nor fsdp was given: nothing would be sharded on the mesh; pass "
                        "tp_plan='auto', fsdp=<mesh dim name>, or both")
    if problems:
        raise ValueError("from_pretrained cannot shard over the mesh:\n" + "\n".join(f"  - {p}" for p in problems))
    return tp_mesh, (mesh[fsdp] if fsdp is not None else None)


def _check_keys(model: nn.Module, overrides: Mapping[str, Any]) -> None:
    """ValueError listing the `tp_plan` entries that name nothing in `model` (nor in its own plan)."""
    own = hf_tp_plan(model)
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters(remove_duplicate=False)]
    lost = [k for k in overrides if k not in own and not any(match(k, n) for n in names)]
    if lost:
        lines = []
        for key in lost:
            close = difflib.get_close_matches(key, sorted(set(own) | {n for n in names if n}), n=3)
            lines.append(f"  - {key!r}" + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""))
        raise ValueError(f"from_pretrained(tp_plan=...): entries that name no module or parameter of "
                         f"{type(model).__name__}:\n" + "\n".join(lines) + "\n  patterns match module paths atom by "
                         "atom ('model.layers.*.mlp.up_proj')")


def _dtype(dtype: Any, config: Any, path: FilePath) -> torch.dtype:
    """`from_pretrained`'s dtype: "auto" is the config's, else the first floating tensor's in the files."""
    given = dtype
    if isinstance(dtype, str) and dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            from ..checkpoint import HuggingFaceStorageReader

            reader = HuggingFaceStorageReader(path)
            reader.read_table()  # headers only
            floating = (i.dtype for h in reader.headers.values() for i in h.tensors.values() if i.dtype.is_floating_point)
            return next(floating, torch.get_default_dtype())
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"from_pretrained(dtype={given!r}): \"auto\", a torch.dtype or its name (\"bfloat16\")")
    return dtype


def _fully_shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """One unit per block the model declares (`_no_split_modules`), innermost first, and one at the root."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    units = [(name, m) for name, m in model.named_modules() if name and type(m).__name__ in blocks]
    for _, module in sorted(units, key=lambda item: -item[0].count(".")):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's pieces live on: the mesh's device type, this process's current device of it."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def _generation_config(model: Any, path: FilePath) -> None:
    """The generation config beside the weights, as `from_pretrained` reads it for a model that generates."""
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and (path / "generation_config.json").is_file():
        import transformers

        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
