"""Collectives as graph nodes: one opaque dispatcher op, `shardwise::collective`, per collective.

A tracer records dispatcher ops. A collective issued through the door is a Python call
around `torch.distributed` (in-place c10d calls with a Work handle and padding), so a
tracer would see its insides, not one step it can replay. `as_node(record, local)` files
the record under a number and calls `shardwise::collective(local, number)` instead: the
op's kernel (registered by `_door`) runs record `number` through the door (so `comm_log()` and the fault checks see
it at run time), and its fake kernel answers the result's shape from the record alone.

Two tracers use it:
- `shardwise.compile` (`shardwise._compile`), whose `make_fx` trace runs on real tensors;
- `torch.compile`: dynamo and AOTAutograd run DTensor dispatch on fake pieces, and the
  door sends every collective of a fake piece here (`is_traced`), so the compiled graph
  holds one node per collective, which inductor calls as an extern kernel.

The op lives here, beside the door, because the door is its kernel and the torch.compile path
starts in the door; `shardwise._compile` imports it from here. That package's own op,
`shardwise::host` (host work at every replay), is `_compile/_host.py`.

Records are kept while their graphs may run; `forget` drops those of a graph that will not
(`shardwise.compile` knows when its programs go). `torch.compile` does not say when a graph
is dropped, so its records (`as_node` without `made`) are filed once per distinct collective:
a recompile that meets the same collective again reuses its number, and the records grow with
the layouts and shapes a program meets, not with its traces.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional

import torch

from .._mesh import CACHE_SIZES
from ._collectives import AllGather, Collective
from ._dry import result_shape

__all__ = ["COLLECTIVE", "LIB", "as_node", "forget", "is_traced", "record"]

_CALLS: dict[int, Collective] = {}
_SHARED: dict[Collective, int] = {}  # torch.compile's records, one number per distinct collective
CACHE_SIZES["traced collective records"] = _CALLS.__len__
_IDS = itertools.count()
_LOCK = threading.Lock()

LIB = torch.library.Library("shardwise", "FRAGMENT")  # type: ignore[no-untyped-call]
LIB.define("collective(Tensor local, int call) -> Tensor")  # type: ignore[no-untyped-call]


def record(call: int) -> Collective:
    """The record filed under `call` (the op's kernel, in `_door`, runs it)."""
    return _CALLS[call]


def _fake(local: torch.Tensor, call: int) -> torch.Tensor:
    return local.new_empty(result_shape(_CALLS[call]))


torch.library.register_fake("shardwise::collective", _fake, lib=LIB)

COLLECTIVE = torch.ops.shardwise.collective.default


_TRACED_TYPES: tuple[type, ...] = (torch._subclasses.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor)


def is_traced(local: torch.Tensor) -> bool:
    """Whether `local` is a tracer's stand-in (a fake or functional tensor), not data."""
    return isinstance(local, _TRACED_TYPES)


def as_node(collective: Collective, local: torch.Tensor, made: Optional[list[int]] = None) -> torch.Tensor:
    """`collective` on `local` as one `shardwise::collective` call (see the module docstring);
    the record's number is appended to `made` when given."""
    if isinstance(collective, AllGather) and collective.in_place:
        collective, local = collective.as_piece(local)
    with _LOCK:
        key = _shared_key(collective) if made is None else None
        if key is None:
            key = next(_IDS)
            _CALLS[key] = collective
            if made is None:
                _share(collective, key)
    if made is not None:
        made.append(key)
    return COLLECTIVE(local, key)  # type: ignore[no-any-return]


def _shared_key(collective: Collective) -> Optional[int]:
    try:
        return _SHARED.get(collective)
    except TypeError:  # a field that cannot be hashed: filed anew each time
        return None


def _share(collective: Collective, key: int) -> None:
    try:
        _SHARED[collective] = key
    except TypeError:
        pass


def forget(keys: list[int]) -> None:
    """Drop the records of a graph that will not run again."""
    for key in keys:
        _CALLS.pop(key, None)
