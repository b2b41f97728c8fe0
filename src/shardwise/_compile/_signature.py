"""A call's signature: what `compile` keys its programs on, and the state it reads besides the arguments.

The arguments' pytree structure and each leaf's key (`tensor_key`: a DTensor's spec, a plain
tensor's shape, stride, dtype and device, any other value itself) say which program a call
runs. A function may also read and write state its arguments reach: the parameters and
buffers of `nn.Module` arguments, the `.grad` of every parameter, and the state tensors and
hyperparameters of `torch.optim.Optimizer` arguments. `find_slots` lists those places, each
a `Slot` (a getter, and a setter where the function may rebind it), so a trace takes their
tensors as inputs and a replay writes back the ones it rebound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Optional

import torch

from .._tensor import DTensor

__all__ = ["Slot", "find_slots", "local_piece", "tensor_key"]

# A place holding a tensor besides the arguments: (getter, setter or None when fn may not rebind it).
Slot = tuple[Callable[[], Any], Optional[Callable[[Any], None]]]


def _attr_slot(obj: Any, name: str) -> Slot:
    return (lambda: getattr(obj, name)), (lambda v: setattr(obj, name, v))


def _state_slot(state: dict[str, Any], name: str) -> Slot:
    return (lambda: state.get(name)), (lambda v: state.__setitem__(name, v))


def _fixed_slot(value: Any) -> Slot:
    """A tensor fn may change in place but not rebind (a parameter, a buffer)."""
    return (lambda: value), None


def _keys_slot(state: dict[str, Any]) -> Slot:
    """The names in one parameter's optimizer state: a step that creates state changes them."""
    return (lambda: frozenset(state)), None


def find_slots(leaves: list[Any], lrs: dict[int, torch.Tensor]) -> tuple[list[Slot], list[Hashable]]:
    """The tensor-holding places reachable from module and optimizer arguments, and the
    non-tensor parts of the signature they add (hyperparameters, state keys). A group's
    learning rate in `lrs` (see `_optim.lr_inputs`) is an input, not a part of the signature."""
    slots: list[Slot] = []
    extra: list[Hashable] = []
    params: dict[int, Any] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            for param in leaf.parameters():
                params.setdefault(id(param), param)
            slots.extend(_fixed_slot(buffer) for buffer in leaf.buffers())
        elif isinstance(leaf, torch.optim.Optimizer):
            for group in leaf.param_groups:
                lr = lrs.get(id(group))
                extra.append(tuple(sorted((k, v) for k, v in group.items()
                                          if k != "params" and _hashable(v) and not (k == "lr" and lr is not None))))
                if lr is not None:
                    slots.append(_fixed_slot(lr))
                for p in group["params"]:
                    params.setdefault(id(p), p)
                    state = leaf.state[p]  # a defaultdict: creating the empty entry here is harmless
                    names = tuple(sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)))
                    extra.append(names)
                    slots.extend(_state_slot(state, k) for k in names)
                    slots.append(_keys_slot(state))
    for p in params.values():
        slots.append(_fixed_slot(p))
        slots.append(_attr_slot(p, "grad"))
    return slots, extra


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def tensor_key(t: Any) -> Hashable:
    """One leaf's part of the signature (an argument, or the value in a slot)."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        return (t._spec, t.requires_grad)
    if isinstance(t, torch.Tensor):
        return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
    return (type(t), t) if _hashable(t) else (type(t), id(t))


def local_piece(t: Any) -> Any:
    """What the traced graph takes for `t`: a DTensor's local tensor, anything else itself."""
    return t._local_tensor if isinstance(t, DTensor) else t
