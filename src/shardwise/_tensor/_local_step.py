"""Elementwise optimizers step DTensor parameters on their local pieces, as plain tensors.

SGD, Adam, AdamW and the other elementwise optimizers of `torch.optim` update each element of
a parameter from the same element of its gradient and state. When a DTensor parameter's
gradient has its layout, and its state tensors too, the DTensor step is exactly the plain
step over the local pieces, so it is run as that: a global optimizer step pre-hook puts each
DTensor parameter's piece in its place in `param_groups` (its gradient's piece as `.grad`,
its state's pieces as its state), the optimizer runs as it would over plain tensors
(torch's foreach default included, which it only picks for tensor types it knows), and the
post-hook puts the DTensors back, wrapping the state a first step made in the parameter's
layout. Host time is then the plain step's plus one pass over the parameters each way,
rather than one DTensor dispatch per foreach op and per parameter in `_init_group`.

The step falls back to DTensor dispatch, unchanged, for any other optimizer (subclasses
included: one may override `step` with other math), a `differentiable` one, or a parameter
whose gradient is in another layout. A step that raises leaves its swap to be undone by the
next step, `state_dict()` or `load_state_dict()`, whichever comes first.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._async import Pending
from ._wrap import DTensorBase, wrap

__all__ = ["ELEMENTWISE"]

# the optimizers whose update of an element reads only that element (exact types)
ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
})

_SWAP_ATTR, _HOOKED_ATTR = "_shardwise_local_step", "_shardwise_local_step_hooked"

# one swapped parameter: (its group's params list, its index there, the DTensor, its piece)
_Swapped = tuple[list[Any], int, DTensorBase, torch.Tensor]


def _local_state(mine: dict[str, Any], p: DTensorBase) -> Optional[dict[str, Any]]:
    """A parameter's state with each DTensor as its piece; None if one is laid out otherwise."""
    out = {}
    for k, v in mine.items():
        if isinstance(v, DTensorBase):
            if v._spec is not p._spec and v._spec.placements != p._spec.placements:
                return None
            v = v._local_tensor
            if type(v) is Pending:
                v = v.wait()
        out[k] = v
    return out


def _before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _after(opt, args, kwargs)  # a step that raised left its swap: undo it first
    if type(opt) not in ELEMENTWISE:
        return
    state = opt.state
    swapped: list[_Swapped] = []
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for group in opt.param_groups:
        if group.get("differentiable"):
            return
        params = group["params"]
        for i, p in enumerate(params):
            if not isinstance(p, DTensorBase):
                continue
            grad = p.grad
            if grad is not None and not (isinstance(grad, DTensorBase) and (grad._spec is p._spec
                                                                             or grad._spec == p._spec)):
                return  # a gradient in another layout: the DTensor step moves it
            local = p._local_tensor
            if type(local) is Pending:
                local = local.wait()
            mine = state.get(p)
            if mine:
                moved = _local_state(mine, p)
                if moved is None:
                    return
                states.append((local, moved))
            swapped.append((params, i, p, local))
    if not swapped:
        return
    for params, i, p, local in swapped:  # (nothing changed until every parameter was checked)
        grad = p.grad
        if grad is None:
            local.grad = None
        else:
            g = grad._local_tensor  # type: ignore[attr-defined]
            local.grad = g.wait() if type(g) is Pending else g
        params[i] = local
    for local, moved in states:
        state[local] = moved
    opt.__dict__[_SWAP_ATTR] = swapped
    if not opt.__dict__.get(_HOOKED_ATTR):  # a swap a raising step left is undone before any state_dict too
        opt.__dict__[_HOOKED_ATTR] = True
        opt.register_state_dict_pre_hook(_undo)
        opt.register_load_state_dict_pre_hook(_undo)


def _undo(opt: torch.optim.Optimizer, *rest: Any) -> None:
    _after(opt, (), {})


def _after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    swapped: Optional[list[_Swapped]] = opt.__dict__.pop(_SWAP_ATTR, None)
    if swapped is None:
        return
    state = opt.state
    for params, i, p, local in swapped:
        params[i] = p
        local.grad = None
        made = state.pop(local, None)
        if made is None:
            continue
        kept = state[p]
        for k, v in made.items():
            old = kept.get(k)
            if old is v or (isinstance(old, DTensorBase) and old._local_tensor is v):
                continue  # updated in place
            kept[k] = _as_state(v, p) if isinstance(v, torch.Tensor) else v


def _as_state(v: torch.Tensor, p: DTensorBase) -> Any:
    """A state tensor the local step made, in its parameter's layout when it is one per element."""
    spec = p._spec
    if v.dim() == 0 or v.shape != p._local_tensor.shape:
        return v  # a step count, or a factor of another shape: as the optimizer made it
    if v.dtype != spec.dtype:
        spec = spec.with_meta(spec.tensor_meta._replace(dtype=v.dtype))
    return wrap(v, spec, False)


register_optimizer_step_pre_hook(_before)
register_optimizer_step_post_hook(_after)
