"""torch's own DTensor and FSDP meeting shardwise DTensors: refused, with the fix.

torch's `DTensor` and shardwise's are different classes that know nothing of each other,
and `torch.distributed.fsdp.fully_shard` knows only torch's. Given a module whose
parameters are shardwise DTensors (after `shardwise.parallel.parallelize_module` or
`shardwise.distribute_tensor`), torch's `fully_shard` takes each for a plain tensor: it cuts
its dim-0 piece with ordinary ops (which run, as they would for a user) and wraps that in
torch's DTensor. At the first forward it would all-gather those pieces as plain tensors,
which is wrong: the ranks' buffers differ, shardwise's plain-tensor check then blamed a
missing `from_local`, and on some ranks the all-gather hung.

torch's FSDP lets a tensor subclass take over its all-gather: it asks every parameter piece
for `fsdp_pre_all_gather` / `fsdp_post_all_gather` when `fully_shard` runs, and calls
`fsdp_pre_all_gather` at the forward, on every rank, before any collective. `DTensor`
answers with `refuse_torch_fsdp`: a TypeError naming the module, the parameter, its layout
and `shardwise.fsdp.fully_shard`, raised on every rank at the same point, so none waits
alone. None of torch's modules is imported; its DTensor is known by its class's name.
"""

from __future__ import annotations

from typing import Any

import torch

from ._wrap import DTensorBase

__all__ = ["FIX", "is_torch_dtensor", "refuse_torch_dtensor", "refuse_torch_fsdp"]

_RULE = "torch.distributed.fsdp.fully_shard does not know shardwise DTensors"
_USE = "shardwise.fsdp.fully_shard (same signature), as in `from shardwise.fsdp import fully_shard`"
FIX = f"{_RULE}; use {_USE}"


def is_torch_dtensor(t: object) -> bool:
    """Whether `t` is torch's own DTensor (`torch.distributed.tensor.DTensor` or a subclass)."""
    return any(c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed")
               for c in type(t).__mro__)


def _layout(t: DTensorBase) -> str:
    return f"{t._spec.layout_str()}{list(t.shape)} on {t._spec.mesh!r}"


def refuse_torch_fsdp(piece: DTensorBase, mesh: Any, outer_size: Any, module: Any) -> TypeError:
    """The error for torch's `fully_shard` about to all-gather `piece`, the part of one of
    `module`'s parameters (global shape `outer_size`) it keeps on this rank of `mesh`."""
    names = [n for n, p in module.named_parameters(recurse=False) if getattr(p, "_local_tensor", None) is piece]
    param = f"parameter {names[0]!r} of a {type(module).__name__}" if names else f"a parameter of a {type(module).__name__}"
    return TypeError(
        f"{_RULE}: before the forward, its all-gather over {mesh!r} met {param} (global shape "
        f"{tuple(outer_size)}), a shardwise DTensor on {piece._spec.mesh!r} (torch's piece of it here: "
        f"{piece._spec.layout_str()}{list(piece.shape)}), and would gather it as a plain tensor: wrong values, "
        f"or ranks that wait forever. Use {_USE}: it shards shardwise DTensors, tensor "
        f"parallel included"
    )


def refuse_torch_dtensor(func: Any, where: str, foreign: torch.Tensor, ours: DTensorBase) -> TypeError:
    """The error for torch's DTensor `foreign` (in `where` of `func`) meeting shardwise's `ours`."""
    spec = getattr(foreign, "_spec", None)
    theirs = f"{list(getattr(spec, 'placements', ()))}{list(foreign.shape)} on {getattr(spec, 'mesh', None)!r}"
    return TypeError(
        f"{func}: the torch.distributed.tensor.DTensor in {where} ({theirs}) meets a shardwise DTensor "
        f"({_layout(ours)}); the two classes do not mix. Make every DTensor with shardwise "
        f"(shardwise.distribute_tensor, shardwise.parallel.parallelize_module). If torch's came from "
        f"torch.distributed.fsdp.fully_shard: {FIX}"
    )
