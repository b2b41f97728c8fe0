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

The swap is made once and kept (`_Cache`): each step checks, by identity and in C-level passes
(`map`), that the groups, the pieces, the gradients' specs and the state dicts and their
values are those it was made from, so a step costs about a microsecond per parameter (the
gradients set and cleared, the state dicts put in and taken out). Anything changed since --
a group added, a state tensor replaced, a step that made new state -- is read afresh.

The step falls back to DTensor dispatch, unchanged, for any other optimizer (subclasses
included: one may override `step` with other math), a `differentiable` one, or a parameter
whose gradient is in another layout. A step that raises leaves its swap to be undone by the
next step, `state_dict()` or `load_state_dict()`, whichever comes first; `load_state_dict()`
also drops the kept swap, so the state it replaces is not held until the next step.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._spec import DTensorSpec
from ._async import Pending
from ._wrap import DTensorBase, wrap

__all__ = ["ELEMENTWISE"]

# the optimizers whose update of an element reads only that element (exact types)
ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
})

_SWAP_ATTR, _CACHE_ATTR, _HOOKED_ATTR = "_shardwise_local_step", "_shardwise_local_step_cache", "_shardwise_local_step_hooked"
_LOCAL_OF, _GRAD_OF, _SPEC_OF = (operator.attrgetter(n) for n in ("_local_tensor", "grad", "_spec"))
_is = operator.is_
_NO_STATE: dict[str, Any] = {}  # (never written: what `state.get` answers for a parameter without state)
_VALUES = dict.values


@dataclass(eq=False)
class _Cache:
    """One optimizer's swap, kept from step to step and checked by identity before each.

    `groups`: each group with the `params` list it had and that list with every DTensor's piece
    in its place (`snapshot`: the list's elements); `params` / `locals`: the DTensor parameters
    in order and their pieces; `grad_specs`: the gradient specs last found to be each
    parameter's layout; `owners` / `keys`: every parameter, and what the local step keys its
    state by (a DTensor's piece, a plain tensor itself). The state part is None until read:
    `state_keys` / `mines` the optimizer's state as it was read (its keys, their state dicts),
    `mine_values` those dicts' values in a row; `shadow` the state
    the local step runs with (a DTensor's state as pieces, a plain tensor's own dict),
    `shadow_values` its dicts' values in a row, `shadow_len` its size."""

    groups: list[tuple[dict[str, Any], list[Any], list[Any]]]
    snapshot: list[tuple[Any, ...]]
    params: list[DTensorBase]
    locals: list[torch.Tensor]
    grad_specs: list[Optional[DTensorSpec]]
    owners: list[torch.Tensor]
    keys: list[torch.Tensor]
    state_keys: tuple[Any, ...] = ()
    mines: Optional[list[dict[str, Any]]] = None
    mine_values: tuple[Any, ...] = ()
    shadow: defaultdict[torch.Tensor, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))
    shadow_values: tuple[Any, ...] = ()
    shadow_len: int = 0

    def holds(self, opt: torch.optim.Optimizer) -> bool:
        """Whether the optimizer's groups and parameters' pieces are still the ones cached."""
        groups = opt.param_groups
        if len(groups) != len(self.groups):
            return False
        for group, (kept, params, _), snap in zip(groups, self.groups, self.snapshot):
            now = group["params"]
            if group is not kept or now is not params or len(now) != len(snap) or not all(map(_is, now, snap)):
                return False
        return all(map(_is, map(_LOCAL_OF, self.params), self.locals))

    def pieces(self, grads: list[Any]) -> Optional[list[Optional[torch.Tensor]]]:
        """The gradients' pieces, or None if one is not a DTensor in its parameter's layout."""
        try:  # every gradient a DTensor with the spec it had last step: one pass in C
            if all(map(_is, map(_SPEC_OF, grads), self.grad_specs)):
                pieces: list[Optional[torch.Tensor]] = list(map(_LOCAL_OF, grads))
                if Pending in set(map(type, pieces)):
                    pieces = [g.wait() if type(g) is Pending else g for g in pieces]
                return pieces
        except AttributeError:  # a gradient None or plain
            pass
        pieces = []
        for k, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                pieces.append(None)
                continue
            if not isinstance(g, DTensorBase):
                return None  # a plain gradient: the DTensor step says what it means
            spec = g._spec
            if spec is not self.grad_specs[k]:
                if spec is not p._spec and spec != p._spec:
                    return None  # a gradient in another layout: the DTensor step moves it
                self.grad_specs[k] = spec
            piece = g._local_tensor
            pieces.append(piece.wait() if type(piece) is Pending else piece)
        return pieces

    def read_state(self, state: dict[Any, Any]) -> bool:
        """Makes `shadow` the state the local step runs with, from the optimizer's `state`;
        False if a state tensor is laid out otherwise than its parameter."""
        if (self.mines is not None and len(state) == len(self.mines) and all(map(_is, state, self.state_keys))
                and all(map(_is, state.values(), self.mines)) and sum(map(len, self.mines)) == len(self.mine_values)
                and all(map(_is, chain.from_iterable(map(_VALUES, self.mines)), self.mine_values))):
            # every key, state dict and state tensor as it was: no tensor hashed (`_after` checked
            # that the last step changed none of the shadow's)
            return True
        mines = list(map(state.get, self.owners, repeat(_NO_STATE)))
        shadow: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for owner, key, mine in zip(self.owners, self.keys, mines):
            if mine:
                if owner is key:
                    shadow[key] = mine
                    continue
                moved = _local_state(mine, owner)  # type: ignore[arg-type]  # a DTensor: its key is its piece
                if moved is None:
                    return False
                shadow[key] = moved
        self.state_keys, self.mines, self.shadow = tuple(state), list(state.values()), shadow
        self.mine_values = tuple(chain.from_iterable(map(_VALUES, self.mines)))
        self.shadow_values = tuple(chain.from_iterable(map(_VALUES, shadow.values())))
        self.shadow_len = len(shadow)
        return True

    def unchanged(self) -> bool:
        """Whether the step left the shadow as it was given (every state tensor updated in place)."""
        shadow = self.shadow
        return (len(shadow) == self.shadow_len and sum(map(len, shadow.values())) == len(self.shadow_values)
                and all(map(_is, chain.from_iterable(map(_VALUES, shadow.values())), self.shadow_values)))


def _build(opt: torch.optim.Optimizer) -> _Cache:
    groups: list[tuple[dict[str, Any], list[Any], list[Any]]] = []
    snapshot: list[tuple[Any, ...]] = []
    params: list[DTensorBase] = []
    locals_: list[torch.Tensor] = []
    for group in opt.param_groups:
        plist = group["params"]
        swapped = list(plist)
        for i, p in enumerate(plist):
            if isinstance(p, DTensorBase):
                local = p._local_tensor
                if type(local) is Pending:
                    local = local.wait()
                swapped[i] = local
                params.append(p)
                locals_.append(local)
        groups.append((group, plist, swapped))
        snapshot.append(tuple(plist))
    owners = [p for _, plist, _ in groups for p in plist]
    keys = [p for _, _, swapped in groups for p in swapped]
    return _Cache(groups, snapshot, params, locals_, [None] * len(params), owners, keys)


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
    cache: Optional[_Cache] = opt.__dict__.get(_CACHE_ATTR)
    if cache is None or not cache.holds(opt):
        cache = opt.__dict__[_CACHE_ATTR] = _build(opt)
    if not cache.params or any(g.get("differentiable") for g in opt.param_groups):
        return
    pieces = cache.pieces(list(map(_GRAD_OF, cache.params)))
    state = opt.state
    if pieces is None or not cache.read_state(state):
        return  # a gradient or a state tensor in another layout: the DTensor step moves it
    # nothing changed until every parameter was checked
    for group, _, swapped in cache.groups:
        group["params"] = swapped
    for local, piece in zip(cache.locals, pieces):  # (None clears a gradient)
        local.grad = piece
    opt.state = cache.shadow
    opt.__dict__[_SWAP_ATTR] = (cache, state)
    if not opt.__dict__.get(_HOOKED_ATTR):  # a swap a raising step left is undone before any state_dict too
        opt.__dict__[_HOOKED_ATTR] = True
        opt.register_state_dict_pre_hook(_undo)
        opt.register_load_state_dict_pre_hook(_forget)


def _undo(opt: torch.optim.Optimizer, *rest: Any) -> None:
    _after(opt, (), {})


def _forget(opt: torch.optim.Optimizer, *rest: Any) -> None:
    """Before `load_state_dict`: undo a swap left behind and drop the kept one, which holds the
    state being replaced (the next step builds it afresh), so the old state is freed now."""
    _after(opt, (), {})
    opt.__dict__.pop(_CACHE_ATTR, None)


def _after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    swap: Optional[tuple[_Cache, defaultdict[Any, dict[str, Any]]]] = opt.__dict__.pop(_SWAP_ATTR, None)
    if swap is None:
        return
    cache, state = swap
    opt.state = state
    for group, params, _ in cache.groups:
        group["params"] = params
    for local in cache.locals:
        local.grad = None
    if cache.unchanged():
        return  # updated in place, as every step after an optimizer's first
    cache.mines = None  # the next step reads the state afresh
    shadow = cache.shadow
    for owner, key in zip(cache.owners, cache.keys):
        made = shadow.get(key)
        if made is None:
            continue
        if owner is key:  # a plain tensor's state: its own
            if state.get(owner) is not made:
                state[owner] = made
            continue
        mine = state[owner]
        for name, v in made.items():
            old = mine.get(name)
            if old is v or (isinstance(old, DTensorBase) and old._local_tensor is v):
                continue  # updated in place
            mine[name] = _as_state(v, owner) if isinstance(v, torch.Tensor) else v  # type: ignore[arg-type]


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
