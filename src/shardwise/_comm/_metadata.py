"""Bookkeeping collectives: ranks agreeing on small lists of ints (shapes, seeds, fingerprints).

They go through the door like every collective (counted by `comm_log()`, kept in program
order), but never become graph nodes in a trace (`traceable=False`). `all_gather_ints`
exchanges Python ints the program already has (shapes, agreement flags): under
`shardwise.compile`'s trace it runs at trace time and is not recorded, so a step that checks
its ranks agree on every call (context parallel's entry and attention) still replays; the
replay, whose signature pins those shapes, does not exchange them again.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ._collectives import AllGather, Broadcast
from ._door import run

__all__ = ["all_gather_ints", "broadcast", "broadcast_object", "gather_over_mesh"]


def all_gather_ints(values: Sequence[int], group: Any, n: int) -> list[list[int]]:
    """Every rank's list of ints (all lists the same length), in group rank order."""
    device = torch.get_default_device()  # (not meta: under `with torch.device("meta")` the ints are still real)
    with disable_proxy_modes_tracing():  # Python ints in and out: nothing a trace should record
        t = torch.tensor(list(values), dtype=torch.int64, device="cpu" if device.type == "meta" else device)
        gather = AllGather(group=group, size=n, shape=tuple(t.shape), dtype=t.dtype, tensor_dim=0,
                           pieces=(len(values),) * n)
        out = run(gather, t, traceable=False)
        return out.view(n, len(values)).tolist()


def gather_over_mesh(values: Sequence[int], groups: Sequence[Any], mesh_shape: Sequence[int]) -> list[list[int]]:
    """Every mesh rank's `values` (same length everywhere), in row-major order of mesh coordinates.

    Gathers along the last mesh dim first, then each earlier one, so no whole-mesh group is needed.
    """
    flat = list(values)
    for i in reversed(range(len(mesh_shape))):
        n = mesh_shape[i]
        rows = all_gather_ints(flat, groups[i], n) if n > 1 else [flat]
        flat = [v for row in rows for v in row]
    width = len(values)
    return [flat[k : k + width] for k in range(0, len(flat), width)]


def broadcast(tensor: torch.Tensor, group: Any, n: int, src: int) -> torch.Tensor:
    """Global rank `src`'s `tensor` on every rank of `group` (a contiguous tensor, returned)."""
    record = Broadcast(group=group, size=n, shape=tuple(tensor.shape), dtype=tensor.dtype, src=src)
    return run(record, tensor, traceable=False)


def broadcast_object(obj: Any, group: Any, n: int, src: int, device: Any = "cpu") -> Any:
    """Global rank `src`'s picklable `obj` on every rank of `group` (its length, then its
    bytes: two broadcasts). Only for objects this job made: the bytes are unpickled."""
    mine = dist.get_rank() == src
    data = pickle.dumps(obj) if mine else b""
    size = int(broadcast(torch.tensor([len(data)], dtype=torch.int64, device=device), group, n, src).item())
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if mine else
              torch.empty(size, dtype=torch.uint8, device=device))
    got = broadcast(buffer, group, n, src)
    return obj if mine else pickle.loads(got.cpu().numpy().tobytes())
