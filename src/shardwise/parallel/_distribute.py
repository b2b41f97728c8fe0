"""`distribute_module`: turn a module's parameters and buffers into DTensors and hook its inputs and outputs.

A partition function places the parameters it cares about; everything it leaves alone is
replicated, so the module comes out all-DTensor and single-device code runs on it
unchanged. Two things need care beyond a loop over modules. Tied weights (an LM head that
*is* the token embedding) are one parameter reachable from several modules: it must be
distributed once and the same new parameter put back everywhere, or the optimizer would
update two copies. And placing is done in two passes (every partition function first,
then replication of the rest), so that a tied weight the partition function places on its
second owner is not replicated on its first owner before that.

The same helpers (`place_parameter`, `Ties`) serve the tensor-parallel styles and
`shard_module`, which apply to submodules but must keep ties across the whole model.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import nn

from .._describe import describe, refuse_torch
from .._layout import ShardOrderLike, format_placements, normalize_placements, normalize_shard_order
from .._mesh import DeviceMesh, get_current_mesh
from .._mesh import as_device_mesh
from .._placement import Placement, Replicate
from .._tensor import DTensor, check_plain_afresh, distribute_tensor

__all__ = ["distribute_module"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]
HookFn = Callable[..., Any]


class Ties:
    """Parameters reachable from several (module, attribute) slots under one root module.

    After any step that may have replaced a tied parameter in one slot, `retie()` puts the
    replacement into every other slot; two different replacements of one parameter are an
    error naming every slot.
    """

    def __init__(self, root: nn.Module) -> None:
        slots: dict[int, list[tuple[str, nn.Module, str]]] = {}
        originals: dict[int, nn.Parameter] = {}
        seen: set[tuple[int, str]] = set()
        for path, m in root.named_modules(remove_duplicate=False):
            for key, p in m._parameters.items():
                if p is None or (id(m), key) in seen:
                    continue
                seen.add((id(m), key))
                slots.setdefault(id(p), []).append((f"{path}.{key}" if path else key, m, key))
                originals[id(p)] = p
        self._groups = [(originals[i], s) for i, s in slots.items() if len(s) > 1]

    def retie(self) -> None:
        for original, slots in self._groups:
            current = {id(m._parameters[k]): m._parameters[k] for _, m, k in slots if m._parameters[k] is not original}
            if not current:
                continue
            if len(current) > 1:
                detail = ", ".join(
                    f"{name}: {_describe(m._parameters[k])}" for name, m, k in slots
                )
                raise ValueError(
                    f"tied parameter {' / '.join(n for n, _, _ in slots)} was placed in two different ways "
                    f"({detail}): a tied parameter is one tensor, so give every module that shares it the same layout"
                )
            (new,) = current.values()
            for _, m, k in slots:
                m._parameters[k] = new


def _describe(p: Any) -> str:
    if isinstance(p, DTensor):
        return format_placements(p.placements)
    return "not distributed"


def place_parameter(
    module: nn.Module,
    key: str,
    placements: Sequence[Placement],
    mesh: DeviceMesh,
    *,
    shard_order: ShardOrderLike = None,
    src_data_rank: Optional[int] = 0,
    where: str = "",
) -> None:
    """Make `module.<key>` an `nn.Parameter(DTensor)` laid out by `placements`.

    A parameter that already is a DTensor with this layout (a tied weight placed through
    another module) is kept; one with another layout is an error naming both.
    """
    param = module._parameters[key]
    if param is None:
        return
    if isinstance(param, DTensor):
        pl = normalize_placements(placements, mesh.ndim, param.ndim)
        order = normalize_shard_order(pl, shard_order, param.ndim)
        if param.device_mesh != mesh or param.placements != pl or param._spec.shard_order != order:
            raise ValueError(
                f"parameter {where or key} is already a DTensor {param._spec.layout_str()} on {param.device_mesh!r} "
                f"and cannot also be {format_placements(pl)} on {mesh!r}: a tied parameter needs one layout "
                f"in every module that shares it"
            )
        return
    dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank, shard_order=shard_order)
    module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))


def _replicate_rest(module: nn.Module, mesh: DeviceMesh, ties: Ties) -> None:
    """Replicate every parameter and buffer under `module` that is not a DTensor yet."""
    replicate = [Replicate()] * mesh.ndim
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is not None and not isinstance(p, DTensor):
                place_parameter(m, key, replicate, mesh)
                ties.retie()
        for key, b in list(m._buffers.items()):
            if b is not None and not isinstance(b, DTensor):
                if id(b) not in made:
                    made[id(b)] = distribute_tensor(b, mesh, replicate)
                m._buffers[key] = made[id(b)]


def _arity(fn: HookFn, what: str, new_form: str, old_form: str) -> int:
    params = inspect.signature(fn).parameters
    n = len(params)
    if n == 2:
        warnings.warn(
            f"{what} taking two arguments {old_form} is deprecated: take {new_form} instead",
            FutureWarning,
            stacklevel=3,
        )
    elif n != 3:
        raise ValueError(
            f"{what} takes {n} argument(s) ({', '.join(params)}): it must take {new_form} "
            f"(or the deprecated {old_form})"
        )
    return n


def distribute_module(
    module: nn.Module,
    device_mesh: Optional[DeviceMesh] = None,
    partition_fn: Optional[PartitionFn] = None,
    input_fn: Optional[HookFn] = None,
    output_fn: Optional[HookFn] = None,
) -> nn.Module:
    """Place `module`'s parameters on `device_mesh` and install input / output hooks; returns `module`.

    - `partition_fn(name, submodule, device_mesh)` is called for `module` and every
      submodule (`named_modules()` order); it may replace parameters with
      `nn.Parameter(DTensor)`. Every parameter and buffer it leaves plain is then
      replicated. A parameter shared by several modules is distributed once and stays one
      parameter.
    - `input_fn(module, inputs, device_mesh)` runs as a forward pre-hook and
      `output_fn(module, outputs, device_mesh)` as a forward hook; what they return
      replaces the inputs / outputs. Two-argument forms `(inputs, device_mesh)` and
      `(outputs, device_mesh)` still work, with a FutureWarning.

    `device_mesh=None` uses the current mesh (`with mesh:`).
    """
    in_arity = _arity(input_fn, "input_fn", "(module, inputs, device_mesh)", "(inputs, device_mesh)") if input_fn else 0
    out_arity = (
        _arity(output_fn, "output_fn", "(module, outputs, device_mesh)", "(outputs, device_mesh)") if output_fn else 0
    )
    mesh = as_device_mesh(device_mesh if device_mesh is not None else get_current_mesh())
    if not isinstance(mesh, DeviceMesh):
        refuse_torch(mesh, "distribute_module(device_mesh=...)")
        raise TypeError(f"distribute_module needs a DeviceMesh, got {describe(mesh)}: build one with shardwise.init_device_mesh")
    check_plain_afresh(mesh)  # a new model: its first step checks plain tensors meeting DTensors
    ties = Ties(module)
    if partition_fn is not None:
        for name, sub in list(module.named_modules()):
            partition_fn(name, sub, mesh)
            ties.retie()
    _replicate_rest(module, mesh, ties)

    if input_fn is not None:
        fn_in = input_fn
        if in_arity == 2:
            module.register_forward_pre_hook(lambda _m, inputs: fn_in(inputs, mesh))
        else:
            module.register_forward_pre_hook(lambda m, inputs: fn_in(m, inputs, mesh))
    if output_fn is not None:
        fn_out = output_fn
        if out_arity == 2:
            module.register_forward_hook(lambda _m, _inputs, outputs: fn_out(outputs, mesh))
        else:
            module.register_forward_hook(lambda m, _inputs, outputs: fn_out(m, outputs, mesh))
    return module
