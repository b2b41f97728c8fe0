"""Partial gradients of DTensor leaves, reduced into the leaves' layouts once per backward, in buckets.

The gradient of a replicated weight used on a split batch arrives Partial (one term per
rank). torch's DTensor keeps it Partial, so every optimizer op that reads it reduces it
again (an AdamW step reads each gradient three or four times). Here a hook on every leaf
that requires grad (registered by `DTensor.requires_grad_`, which `nn.Parameter` calls)
notes the leaf when backward has accumulated its gradient, and at the end of the backward
pass the noted gradients are reduced into their leaves' placements: `param.grad` then has
`param`'s layout and the optimizer step moves nothing.

Gradients whose reduction is one all_reduce over the same group, with the same reduce op,
travel together through the one bucketer (`_comm.all_reduce_coalesced`: buckets of about
25 MiB per dtype, one all_reduce each, in the order backward produced them, the same on
every rank). Any other reduction (a reduce_scatter into a Shard leaf, several steps) runs on its
own; so does a gradient split part by part for a leaf that is not (`_StridedShard`, the
backward of a `split`), or the other way round. With several backward passes before an optimizer step, each pass reduces its own term,
unless the passes run inside `shardwise.parallel.no_sync(model)` (`deferred` here): then
the terms accumulate unreduced and the first backward after the block reduces their sum.

A plain leaf (a parameter a plan left plain) that meets DTensors counts as replicated, so its
gradient can come back as a DTensor: Partial, or split (the bias of a decoder tied to a
vocab-split embedding gets `Shard(0)`). Its layout is "whole on every rank", so that gradient
is reduced or gathered here too, into a plain whole tensor: the optimizer's in-place updates
of the leaf and of its plain state never meet a DTensor. Dispatch hooks such a leaf the first
time it meets a DTensor (`watch_plain_leaf`).

The reduction is the `layout` phase of the end-of-backward registry (`_end_of_backward`): it
runs after units finish and before sums over replicas (data parallel, context parallel) and
checks read the gradients. It is every leaf's default reducer at level `layout`, so a leaf
needs no registration; `layout_reducer` describes it for the public query.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from .. import _comm
from .._placement import Replicate, _StridedShard
from ._async import resolve
from ._end_of_backward import GradientReducer, Step, arm
from ._redistribute import move_between, redistribute_local
from ._wrap import DTensorBase, wrap

__all__ = ["deferred", "layout_reducer", "note_accumulated", "reduce_noted", "unwatch_leaf", "watch_plain_leaf"]

_NOTED: list[Any] = []  # leaves (DTensors) whose gradient this backward pass still has to reduce
_DEFERRED: dict[int, int] = {}  # id(leaf) -> how many `deferred` blocks hold it


class _Layout(Step):
    """The end-of-backward step of every noted leaf (the registry's `layout` phase). A pass that
    raises never reaches its end; the next pass arms it again and reduces both passes' leaves."""

    phase = "layout"

    def finish(self) -> None:
        reduce_noted()


_LAYOUT = _Layout()


@contextlib.contextmanager
def deferred(leaves: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside the block, backward leaves these leaves' Partial gradients Partial (terms keep
    accumulating, locally); the first backward after it reduces the sum, once."""
    ids = [id(t) for t in leaves]
    for i in ids:
        _DEFERRED[i] = _DEFERRED.get(i, 0) + 1
    try:
        yield
    finally:
        for i in ids:
            _DEFERRED[i] -= 1
            if not _DEFERRED[i]:
                del _DEFERRED[i]


def watch_plain_leaf(leaf: torch.Tensor) -> None:
    """Hook a plain leaf that requires grad and meets DTensors (once): a DTensor gradient
    it receives is made plain and whole at the end of the backward pass."""
    hooks = leaf._post_accumulate_grad_hooks
    if not hooks or note_accumulated not in hooks.values():
        leaf.register_post_accumulate_grad_hook(note_accumulated)  # type: ignore[no-untyped-call]


def unwatch_leaf(leaf: torch.Tensor) -> None:
    """Take `leaf` out of this reduction: its registered reducer sets its gradient in its layout
    itself (data parallel's). Autograd still runs the leaf's accumulate-grad hooks when its
    gradient is handed elsewhere, and would note the reducer's unreduced term."""
    hooks = leaf._post_accumulate_grad_hooks
    for key, hook in list((hooks or {}).items()):
        if hook is note_accumulated:
            del hooks[key]


def layout_reducer(leaf: torch.Tensor) -> Optional[GradientReducer]:
    """This reduction as `leaf`'s reducer at level `layout`: for a DTensor leaf, or a plain leaf
    hooked beside DTensors (it met one, or a plan left it plain); None for any other plain leaf."""
    hooks = leaf._post_accumulate_grad_hooks
    if not hooks or note_accumulated not in hooks.values():
        return None
    if not isinstance(leaf, DTensorBase):
        return GradientReducer("its layout (a plain leaf beside DTensors)", "layout",
                               "a DTensor gradient made plain and whole", (), "the mesh of the DTensors it met",
                               "its first op with a DTensor")
    mesh = leaf._spec.mesh
    grid = getattr(mesh, "mesh", None)  # (a concrete mesh's grid of ranks)
    ranks = tuple(int(r) for r in grid.flatten().tolist()) if isinstance(grid, torch.Tensor) else ()
    return GradientReducer("its layout (a DTensor leaf)", "layout", "Partial terms summed into its placements",
                           ranks, f"its mesh {tuple(mesh.shape)}", "requires_grad_")


def note_accumulated(leaf: torch.Tensor) -> None:
    """Post-accumulate-grad hook: queue `leaf` for the reduction at the end of this backward."""
    grad = leaf.grad
    if not isinstance(grad, DTensorBase) or id(leaf) in _DEFERRED:
        return
    if isinstance(leaf, DTensorBase):
        have, want = grad._spec, leaf._spec
        if not _to_relay(have, want) or have.mesh != want.mesh:
            return
    arm(_LAYOUT)
    _NOTED.append(leaf)


def _to_relay(have: Any, want: Any) -> bool:
    """Whether a gradient of layout `have` is moved into its leaf's layout `want`: a Partial
    one (reduced), or one split part by part where the leaf is not, or the other way round
    (the backward of a `split` into a fused projection's parts)."""
    if have.has_partial():
        return not want.has_partial()
    return have.placements != want.placements and any(
        type(p) is _StridedShard for p in have.placements + want.placements)


def _target(leaf: torch.Tensor, have: Any) -> Any:
    """The layout `leaf`'s gradient (now `have`) is moved into; None: it stays as it is."""
    if not isinstance(leaf, DTensorBase):  # a plain leaf: whole on every rank
        return have.with_placements((Replicate(),) * have.mesh.ndim)
    if not _to_relay(have, leaf._spec):
        return None
    return have.with_placements(leaf._spec.placements, leaf._spec.shard_order)


def _set_grad(leaf: torch.Tensor, piece: torch.Tensor, target: Any) -> None:
    leaf.grad = wrap(piece, target) if isinstance(leaf, DTensorBase) else piece


def reduce_noted() -> None:
    """Move every gradient noted in this backward pass into its leaf's layout (at the end of the
    pass, before the steps of later phases read them)."""
    leaves = list(_NOTED)
    _NOTED.clear()
    buckets: dict[tuple[Any, ...], list[tuple[Any, Any, torch.Tensor]]] = {}
    with torch.no_grad():
        for leaf in leaves:
            grad = leaf.grad
            if not isinstance(grad, DTensorBase):
                continue  # replaced or reduced since it was noted
            have = grad._spec
            target = _target(leaf, have)
            if target is None:
                continue
            local = resolve(grad._local_tensor)
            if target == have:  # a replicated gradient of a plain leaf: its piece is the whole
                _set_grad(leaf, local, target)
                continue
            single = move_between(have, target).single
            if isinstance(single, _comm.AllReduce):
                key = (single.group, single.size, single.op, single.mesh_dims)
                buckets.setdefault(key, []).append((leaf, target, local))
            else:
                _set_grad(leaf, redistribute_local(local, have, target), target)
        for (group, n, op, mesh_dims), items in buckets.items():
            reduced = _comm.all_reduce_coalesced([local for _, _, local in items], group, n, op, mesh_dims=mesh_dims)
            for (leaf, target, _), piece in zip(items, reduced):
                assert piece is not None  # every value was given: no absent ones
                _set_grad(leaf, piece, target)
