"""Host work as a graph node: one opaque dispatcher op, `shardwise::host`, per step.

A graph `shardwise.compile` replays holds only dispatcher ops, but some work must happen in
Python at every call: a pipeline's messages, whose headers carry shapes and failures read on
the host (see `pipeline._wire`), and a ring's rotation. `host_node(fn, inputs, made)` files
`fn` (a function of a list of tensors to a list of tensors) under a number and calls
`shardwise::host(inputs, number)`, whose kernel calls `fn` now and at every replay.

Steps are kept while their graphs may run; `forget` drops those of a graph that will not.
The collectives' op, `shardwise::collective`, is the door's (`_comm/_traced.py`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

from .._mesh import CACHE_SIZES

__all__ = ["HOST", "HostFn", "forget", "host_node"]

HostFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]

_HOSTS: dict[int, HostFn] = {}
CACHE_SIZES["traced host steps"] = _HOSTS.__len__
_IDS = itertools.count()
_LOCK = threading.Lock()

_LIB = torch.library.Library("shardwise", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define("host(Tensor[] inputs, int call) -> Tensor[]")  # type: ignore[no-untyped-call]


def _host_kernel(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    return _HOSTS[call](list(inputs))


_LIB.impl("host", _host_kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

HOST = torch.ops.shardwise.host.default


def host_node(fn: HostFn, inputs: list[torch.Tensor], made: list[int]) -> list[torch.Tensor]:
    """`fn(inputs)` as one `shardwise::host` call: run now (while a trace records the call)
    and at every replay of the graph; its number is appended to `made` (`forget` it with the graph)."""
    with _LOCK:
        key = next(_IDS)
        _HOSTS[key] = fn
    made.append(key)
    return HOST(inputs, key)  # type: ignore[no-any-return]


def forget(keys: list[int]) -> None:
    """Drop the steps of a graph that will not run again."""
    for key in keys:
        _HOSTS.pop(key, None)
