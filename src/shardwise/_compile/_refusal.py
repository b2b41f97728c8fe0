"""What a traced graph may not hold: why it cannot be replayed, and tensors read from outside.

A graph is refused when its values were read into Python at trace time (`.item()`,
data-dependent shapes: `nonzero`, indexing by a boolean mask, not by integer tensors), when it draws random numbers whose generator state it does not carry
(not ops whose dropout probability is a literal 0), or when it holds a collective issued
outside `shardwise._comm`. A graph that reads tensors from outside its arguments (a closure,
a global) replays with them baked in by identity: `outside_tensors` counts them for the
warning, leaving out the buffers shardwise keeps for good (`mark_persistent`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx

from .._comm import COLLECTIVE
from ._host import HOST

__all__ = ["mark_persistent", "outside_tensors", "refusal"]

# Op tags that make a graph unfit to replay: its values were read into Python at trace time,
# or it draws random numbers whose generator state the graph does not carry.
_DATA_DEPENDENT_TAGS = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}
_NOT_REPLAYABLE = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
# Ops tagged as of dynamic output shape only for some inputs: indexing by integer tensors has
# the shape of its indices, known at trace time; only a boolean mask's shape depends on values.
_MASK_INDEXED = {torch.ops.aten.index.Tensor}


def _draws(node: torch.fx.Node) -> bool:
    """Whether a seeded op really draws random numbers: not when its dropout probability is a
    literal 0 (attention with `dropout_p=0.0`, as models call it in eval or with no dropout)."""
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def _masked(node: torch.fx.Node) -> bool:
    """Whether an indexing node takes a boolean mask (or an index whose dtype the trace did not record)."""
    indices = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else [None]
    dtypes = [getattr(i.meta.get("val"), "dtype", None) for i in indices if isinstance(i, torch.fx.Node)]
    return not dtypes or any(d not in (torch.int64, torch.int32) for d in dtypes)


def refusal(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why this graph cannot be replayed, or None."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in (COLLECTIVE, HOST):
            continue
        if target in _MASK_INDEXED and not _masked(node):
            continue
        if target in _NOT_REPLAYABLE or _DATA_DEPENDENT_TAGS.intersection(target.tags):
            return f"{target} reads tensor values at trace time (data-dependent shape or value)"
        if torch.Tag.nondeterministic_seeded in target.tags and _draws(node):
            return f"{target} draws random numbers (the replay would repeat the traced ones)"
        if target.namespace in ("c10d", "_c10d_functional"):
            return f"{target} is a collective issued outside shardwise._comm"
    return None


def mark_persistent(t: torch.Tensor) -> torch.Tensor:
    """Mark a buffer shardwise keeps for the life of a module and only changes in place
    (`fully_shard`'s unsharded parameters): a replay reading it by identity is right, and
    `compile` does not warn about it."""
    t._shardwise_persistent = True  # type: ignore[attr-defined]
    return t


def outside_tensors(gm: torch.fx.GraphModule) -> int:
    """Tensor constants read by ops directly: tensors fn took from outside its arguments (a
    tensor fn builds from Python data, `torch.tensor([...])`, is copied out of its constant),
    other than the buffers shardwise marks persistent."""
    lift = torch.ops.aten.lift_fresh_copy.default
    return sum(
        1 for n in gm.graph.nodes
        if n.op == "get_attr" and isinstance(t := getattr(gm, str(n.target), None), torch.Tensor)
        and not getattr(t, "_shardwise_persistent", False) and any(u.target is not lift for u in n.users)
    )
