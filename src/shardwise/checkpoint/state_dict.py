"""`torch.distributed.checkpoint.state_dict`'s functions for models whose tensors are shardwise
DTensors: the same names, arguments and results, so switching is an import change.

torch's own functions take a shardwise model's sharded state dict as it is (keys by
fully-qualified name, values the DTensors), and that is what these do too: they call
torch's for the keys and structure. What torch's cannot do is the `full_state_dict=True`
half: torch gathers only its own DTensor class, so it would hand back shardwise DTensors
as if they were full, and its `broadcast_from_rank0` and full optimizer loads would leave
whole tensors where the optimizer keeps pieces. Here:

- `get_*_state_dict(..., options=StateDictOptions(full_state_dict=True))` gathers every
  DTensor into a plain tensor (every rank takes part, in the state dict's order, which is
  the same on every rank); with `cpu_offload=True` only rank 0 keeps the result (the other
  ranks get `{}`), on CPU, as torch does.
- `set_*_state_dict(..., options=StateDictOptions(full_state_dict=True))` takes plain whole
  tensors and puts each into the layout the model or optimizer keeps it in (each rank takes
  its own piece, no communication); with `broadcast_from_rank0=True` only rank 0 needs the
  values: each tensor is broadcast from it, one at a time, and then cut the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as _torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from .. import _comm as comm
from .._describe import describe
from .._tensor import DTensor, distribute_tensor

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


def get_model_state_dict(model: nn.Module, *, submodules: Optional[set[nn.Module]] = None,
                         options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """`model`'s state dict by fully-qualified name: its DTensors as they are, or, with
    `full_state_dict=True`, gathered into plain tensors (see the module docstring)."""
    options = options or StateDictOptions()
    state: dict[str, Any] = _finish(_torch.get_model_state_dict(model, submodules=submodules,
                                                                options=_sharded(options)), options)
    return state


def get_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, *,
                             submodules: Optional[set[nn.Module]] = None,
                             options: Optional[StateDictOptions] = None) -> Any:
    """The optimizers' state by parameter name (torch's form), gathered as `get_model_state_dict` does."""
    options = options or StateDictOptions()
    return _finish(_torch.get_optimizer_state_dict(model, optimizers, submodules=submodules,
                                                   options=_sharded(options)), options)


def get_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: Optional[set[nn.Module]] = None,
                   options: Optional[StateDictOptions] = None) -> tuple[dict[str, Any], Any]:
    """`(get_model_state_dict(...), get_optimizer_state_dict(...))`."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping[str, Any], *,
                         options: Optional[StateDictOptions] = None) -> Any:
    """Load `model_state_dict` (keys by fully-qualified name) into `model`, each tensor into the
    layout the model keeps it in; returns torch's `_IncompatibleKeys`."""
    options = options or StateDictOptions()
    _check_options(options)
    state = dict(model_state_dict)
    if options.full_state_dict:
        state = _into_layouts(state, _model_targets(model), options, "model state dict")
    return _torch.set_model_state_dict(model, state, options=_sharded(options))


def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: Any, *,
                             options: Optional[StateDictOptions] = None) -> None:
    """Load the optimizers' state (torch's form, by parameter name), each state tensor shaped
    as its parameter into the parameter's layout."""
    options = options or StateDictOptions()
    _check_options(options)
    if options.full_state_dict:
        optim_state_dict = _optimizer_into_layouts(model, optim_state_dict, options)
    _torch.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=_sharded(options))


def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: Mapping[str, Any],
                   optim_state_dict: Any, options: Optional[StateDictOptions] = None) -> Any:
    """`set_model_state_dict` and `set_optimizer_state_dict` in one call; returns the model's incompatible keys."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


# -- helpers -----------------------------------------------------------------------------------

Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    """What rank 0 tells the other ranks about a tensor before it sends it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _sharded(options: StateDictOptions) -> StateDictOptions:
    """What torch's functions are asked for: the sharded state dict, nothing gathered or moved."""
    return dataclasses.replace(options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False)


def _check_options(options: StateDictOptions) -> None:
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("StateDictOptions(broadcast_from_rank0=True) sends rank 0's whole tensors, so it needs "
                         "full_state_dict=True too")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _finish(state: Any, options: StateDictOptions) -> Any:
    """Gather (full_state_dict) and move to CPU (cpu_offload) every tensor of `state`."""
    if not (options.full_state_dict or options.cpu_offload):
        return state
    done = _walk(state, lambda path, t: _gathered(t, options))
    if options.full_state_dict and options.cpu_offload and _rank() != 0:
        return {}  # torch's rule: a full state dict offloaded to CPU lives on rank 0 only
    return done


def _gathered(t: torch.Tensor, options: StateDictOptions) -> torch.Tensor:
    if options.full_state_dict and (isinstance(t, DTensor) or hasattr(t, "device_mesh")):
        t = t.full_tensor()  # type: ignore[attr-defined]  # a shardwise DTensor or torch's own
    return t.cpu() if options.cpu_offload else t


def _walk(value: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """`value` with `fn(path, leaf)` in place of each tensor (or `_TensorSpec`), in order."""
    if isinstance(value, (torch.Tensor, _TensorSpec)):
        return fn(path, value)
    if isinstance(value, dict):
        return {k: _walk(v, fn, path + (k,)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        walked = [_walk(v, fn, path + (i,)) for i, v in enumerate(value)]
        return tuple(walked) if isinstance(value, tuple) else walked
    return value


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _whole_state(state: Any, cut: Callable[[Path, torch.Tensor], Any], options: StateDictOptions) -> Any:
    """`state` with each whole tensor cut to the layout it is kept in (`cut`); with
    `broadcast_from_rank0`, rank 0's state on every rank, each tensor cut as it arrives
    (so no rank holds more than one whole tensor it does not keep)."""
    if not (options.broadcast_from_rank0 and _distributed()):
        return _walk(state, cut)
    group, n, device = dist.group.WORLD, dist.get_world_size(), _comm_device()
    mine = _rank() == 0
    skeleton = _walk(state, lambda path, t: _TensorSpec(tuple(t.shape), t.dtype)) if mine else None
    skeleton = comm.broadcast_object(skeleton, group, n, 0, device)

    def arrive(path: Path, leaf: Any) -> Any:
        buffer = (leaf.detach().to(device).contiguous() if mine else
                  torch.empty(leaf.shape, dtype=leaf.dtype, device=device))
        return cut(path, comm.broadcast(buffer, group, n, 0))
    return _walk(state if mine else skeleton, arrive)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(value: torch.Tensor, target: Optional[torch.Tensor], key: str, what: str) -> torch.Tensor:
    """`value` (a whole tensor) laid out as `target` (a DTensor: each rank cuts its own piece)."""
    if not isinstance(target, DTensor) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{what}: {key!r} has shape {tuple(value.shape)}, the model keeps {tuple(target.shape)} "
                         "(global): a full state dict holds whole tensors of the model's shapes")
    return distribute_tensor(value.detach().to(device=_local(target).device), target.device_mesh,
                             target.placements, src_data_rank=None, shard_order=target.shard_order)


def _into_layouts(state: dict[str, Any], targets: Mapping[str, torch.Tensor], options: StateDictOptions,
                  what: str) -> dict[str, Any]:
    """Each whole tensor of `state` in the layout of the model's tensor of the same key."""
    def cut(path: Path, full: torch.Tensor) -> torch.Tensor:
        key = str(path[0])
        return _like(full, targets.get(key), key, what)
    out: dict[str, Any] = _whole_state(state, cut, options)
    return out


def _model_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by the fully-qualified names torch's functions use."""
    return {k: v for k, v in _torch.get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}


def _optimizer_into_layouts(model: nn.Module, optim_state_dict: Any, options: StateDictOptions) -> Any:
    """The full optimizer state with each tensor shaped as its parameter in the parameter's
    layout (torch's nested form `state[fqn][name]`, or the flattened `state.fqn.name`)."""
    if not isinstance(optim_state_dict, Mapping) and not (options.broadcast_from_rank0 and _rank() != 0):
        raise TypeError(f"set_optimizer_state_dict takes the dict get_optimizer_state_dict returns, got "
                        f"{describe(optim_state_dict)}")
    params = _model_targets(model)  # by the fully-qualified names the optimizer state dict uses

    def cut(path: Path, full: torch.Tensor) -> torch.Tensor:
        if len(path) == 3 and path[0] == "state":  # state[fqn][name]
            fqn, key = str(path[1]), f"{path[1]}.{path[2]}"
        elif len(path) == 1 and str(path[0]).startswith("state."):  # "state.fqn.name"
            key = str(path[0])[len("state."):]
            fqn = key.rsplit(".", 1)[0]
        else:
            return full
        param = params.get(fqn)
        if param is None or tuple(full.shape) != tuple(param.shape):
            return full  # a scalar ("step"), or a state of its own shape: kept whole, as torch keeps it
        return _like(full, param, key, "optimizer state dict")
    return _whole_state(dict(optim_state_dict) if isinstance(optim_state_dict, Mapping) else {}, cut, options)
