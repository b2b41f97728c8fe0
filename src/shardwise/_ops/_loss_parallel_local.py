"""Local implementations of the loss-parallel variants: log_softmax, its backward and
nll_loss on one rank's range of classes, with the per-row reductions all-reduced.

The variants in `_loss_parallel` only say which layouts these ops may run in; a rank
holding classes [c0, c0 + n) cannot then run the aten op on its piece, because a row's max
and sum of exponentials span every rank that splits the row, and a target is a global
class index. So each op here reduces what it must across the mesh dims that split the
class dim (all-reducing O(rows) numbers, never the logits; `LocalCall.all_reduce`) and
shifts targets into the local range; targets outside it are ignored locally, their terms
come from the rank that holds them. For any other layout the op runs as its base rule
says (its own local implementation, or the aten op).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .._spec import DTensorSpec
from ._local import LocalCall, LocalFn
from ._registry import rule_for

__all__ = ["LOSS_PARALLEL_LOCAL", "class_dim"]

aten = torch.ops.aten
_MEAN, _SUM = 1, 2
_LOCAL_IGNORE = -1  # the ignore_index the local op gets: targets outside the rank's classes
_BASE: frozenset[str] = frozenset()  # no mode: an op's base rule


def class_dim(ndim: int) -> int:
    """The class dim of nll_loss's input: 1, or 0 for a single sample of shape (C,)."""
    return 1 if ndim >= 2 else 0


def _as_before(call: LocalCall) -> Any:
    """The op as its base rule runs it (a layout that keeps the classes whole)."""
    base = rule_for(call.func, _BASE).local
    return call.run_op() if base is None else base(call)


# -- log_softmax ---------------------------------------------------------------------------------


def _log_softmax(call: LocalCall) -> torch.Tensor:
    spec = call.input_specs[0]
    x = call.args[0]
    dim = call.arg(1, "dim") % max(spec.ndim, 1)
    dims = call.splitting(spec, [dim])
    if not dims:
        return _as_before(call)  # type: ignore[no-any-return]
    if call.arg(2, "half_to_float"):
        x = x.float()
    if x.size(dim) > 0:
        top = x.amax(dim, keepdim=True)  # (..., 1, ...)
    else:  # an empty piece of the row: the max's identity
        top = x.new_full(x.shape[:dim] + (1,) + x.shape[dim + 1:], float("-inf"))
    top = call.all_reduce(top, spec, dims, "max")  # the row max over every rank
    shifted = x - top
    total = call.all_reduce(shifted.exp().sum(dim, keepdim=True), spec, dims, "sum")  # (..., 1, ...)
    # contiguous, as aten's is (the piece of a transposed tensor is not)
    return (shifted - total.log()).contiguous()  # type: ignore[no-any-return]


def _log_softmax_backward(call: LocalCall) -> torch.Tensor:
    spec = call.input_specs[0]
    grad, out = call.args[0], call.args[1]
    dim = call.arg(2, "dim") % max(spec.ndim, 1)
    dims = call.splitting(spec, [dim])
    if not dims:
        return _as_before(call)  # type: ignore[no-any-return]
    total = call.all_reduce(grad.sum(dim, keepdim=True), spec, dims, "sum")  # (..., 1, ...)
    grad_input = grad - out.exp() * total
    return grad_input.to(call.arg(3, "input_dtype")).contiguous()  # type: ignore[no-any-return]


# -- nll_loss ------------------------------------------------------------------------------------


def _match(tensors: Sequence[Optional[torch.Tensor]], specs: Sequence[DTensorSpec]) -> list[Optional[DTensorSpec]]:
    """The spec of each of `tensors` (in argument order; None for None and 0-dim ones), found
    in `specs` (every DTensor argument's) as the next one with the same number of dims.
    The arguments skipped between them (nll_loss_backward's grad_output) never have it."""
    found: list[Optional[DTensorSpec]] = []
    k = 0
    for t in tensors:
        if t is None or t.ndim == 0:
            found.append(None)
            continue
        while specs[k].ndim != t.ndim:
            k += 1
        found.append(specs[k])
        k += 1
    return found


class _Pieces:
    """One rank's view of an nll_loss call whose input splits the classes."""

    def __init__(self, call: LocalCall, me: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                 ignore_index: int) -> None:
        me_spec, t_spec, w_spec = _match([me, target, weight], call.input_specs)
        assert me_spec is not None
        self.spec = me_spec
        c = class_dim(me_spec.ndim)
        self.classes = call.splitting(me_spec, [c])
        self.samples = call.splitting(me_spec, [d for d in range(me_spec.ndim) if d != c])
        if not self.classes:
            return
        coordinate = call.coordinate(me_spec)
        shape, offset = me_spec.local_shape_and_offset(coordinate)
        first, n = offset[c], shape[c]
        if t_spec is not None:  # a target whole along a split sample dim: keep this rank's samples
            t_offset = t_spec.local_shape_and_offset(coordinate)[1]
            for d in range(me_spec.ndim):
                if d != c:
                    t = d if d < c else d - 1
                    target = target.narrow(t, offset[d] - t_offset[t], shape[d])
        if weight is not None:
            w_offset = w_spec.local_shape_and_offset(coordinate)[1][0] if w_spec is not None else 0
            weight = weight.narrow(0, first - w_offset, n)
        _check_targets(target, me_spec.shape[c], ignore_index)
        inside = (target != ignore_index) & (target >= first) & (target < first + n)
        self.target = torch.where(inside, target - first, _LOCAL_IGNORE)  # local class or ignored
        self.weight = weight
        self.kept = target != ignore_index


def _check_targets(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    if target.is_meta:  # a dry run: no values to check
        return
    bad = target[(target != ignore_index) & ((target < 0) | (target >= n_classes))]
    if bad.numel():
        raise ValueError(
            f"nll_loss / cross_entropy got targets {sorted(set(bad.tolist()))[:8]} out of range for "
            f"{n_classes} classes: a target must be in [0, {n_classes - 1}] or equal ignore_index={ignore_index}"
        )


def _nll_loss(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
    func = call.func
    me, target, weight, reduction, ignore_index = (call.arg(k, name) for k, name in
                                                   enumerate(("self", "target", "weight", "reduction", "ignore_index")))
    p = _Pieces(call, me, target, weight, ignore_index)
    if not p.classes:
        return _as_before(call)  # type: ignore[no-any-return]
    if reduction != _MEAN:  # none: each sample's term; sum: this rank's terms and weights (P(sum))
        return func(me, p.target, p.weight, reduction, _LOCAL_IGNORE)  # type: ignore[no-any-return]
    loss, total = func(me, p.target, p.weight, _SUM, _LOCAL_IGNORE)
    if p.weight is None:  # the total is a count of kept targets: each rank has them all
        total = call.all_reduce(p.kept.sum().to(me.dtype), p.spec, p.samples, "sum")
    else:  # each kept target's weight sits on the rank that holds its class
        total = call.all_reduce(total, p.spec, p.classes + p.samples, "sum")
    return loss / total, total


def _nll_loss_backward(call: LocalCall) -> torch.Tensor:
    func = call.func
    names = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
    grad, me, target, weight, reduction, ignore_index, total = (call.arg(k, n) for k, n in enumerate(names))
    p = _Pieces(call, me, target, weight, ignore_index)
    if not p.classes:
        return _as_before(call)  # type: ignore[no-any-return]
    # -w[t] * grad (over the global total weight for a mean) at each local target's class
    return func(grad, me, p.target, p.weight, reduction, _LOCAL_IGNORE, total)  # type: ignore[no-any-return]


# op -> its local implementation under loss parallel
LOSS_PARALLEL_LOCAL: dict[Any, LocalFn] = {
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss2d_forward.default: _nll_loss,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten.nll_loss2d_backward.default: _nll_loss_backward,
}
