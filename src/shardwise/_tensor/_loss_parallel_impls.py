"""Local computations of the loss-parallel candidates: log_softmax, its backward and
nll_loss on one rank's range of classes, with the per-row reductions all-reduced.

The strategies in `shardwise._ops._loss_parallel` only say which layouts these ops may
run in; a rank holding classes [c0, c0 + n) cannot then run the aten op on its piece,
because a row's max and sum of exponentials span every rank that splits the row, and a
target is a global class index. So each op here reduces what it must across the mesh dims
that split the class dim (all-reducing O(rows) numbers, never the logits) and shifts
targets into the local range; targets outside it are ignored locally, their terms come
from the rank that holds them. For any other layout the op runs as it did before.

`switch_loss_parallel` turns the candidates on or off and swaps the dispatch plans of these
ops for those made under the other mode: plans are keyed by op and specs, not by the mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import _comm as comm
from .._mesh import DeviceMesh
from .._ops._loss_parallel import LOSS_PARALLEL_OPS, class_dim, loss_parallel_enabled, set_loss_parallel
from .._placement import Shard
from .._spec import DTensorSpec
from . import _nn_impls  # noqa: F401  (registered first: layouts that keep the classes whole still use its nll_loss)
from ._dispatch import _LOCAL_IMPLS, _PLANS, _WITH_INPUT_SPECS, plain_as_replicated, register_local_impl

__all__ = ["switch_loss_parallel"]

aten = torch.ops.aten
_MEAN, _SUM = 1, 2
_LOCAL_IGNORE = -1  # the ignore_index the local op gets: targets outside the rank's classes

# What ran for these ops before this module registered its own (masked nll_loss over split
# samples, or the plain op): layouts that do not split the class dim still get it.
_PREVIOUS = {op: (_LOCAL_IMPLS.get(op), op in _WITH_INPUT_SPECS) for op in LOSS_PARALLEL_OPS}


# Dispatch plans for these ops made under the mode that is off, put aside until it is back on.
_SET_ASIDE: dict[bool, dict[tuple[Any, ...], Any]] = {False: {}, True: {}}


def switch_loss_parallel(on: bool) -> None:
    """Offer (or stop offering) the class-split candidates; a dispatch plan made for these
    ops under one mode is never used under the other."""
    on = bool(on)
    was = loss_parallel_enabled()
    if on == was:
        return
    set_loss_parallel(on)
    plain_as_replicated(LOSS_PARALLEL_OPS, on)  # plain targets count as replicated, as in torch
    leaving = {k: plan for k, plan in _PLANS.items() if k[0] in LOSS_PARALLEL_OPS}
    for key in leaving:
        del _PLANS[key]
    _SET_ASIDE[was] = leaving
    _PLANS.update(_SET_ASIDE[on])
    _SET_ASIDE[on] = {}


def _as_before(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any,
               input_specs: tuple[DTensorSpec, ...]) -> Any:
    impl, with_specs = _PREVIOUS[func]
    if impl is None:
        return func(*args, **kwargs)
    if with_specs:
        return impl(func, args, kwargs, output_spec, input_specs=input_specs)
    return impl(func, args, kwargs, output_spec)


def _mesh(spec: DTensorSpec) -> DeviceMesh:
    assert isinstance(spec.mesh, DeviceMesh)  # specs met while running have a real mesh
    return spec.mesh


def _coordinate(spec: DTensorSpec) -> tuple[int, ...]:
    coordinate = _mesh(spec).get_coordinate()
    if coordinate is None:
        raise ValueError(f"this process is not part of the mesh {spec.mesh!r} of the DTensor it computes on")
    return tuple(coordinate)


def _mesh_dims(spec: DTensorSpec, dims: Sequence[int]) -> list[tuple[Any, int]]:
    """(process group, size) of each mesh dim that splits one of tensor `dims`."""
    mesh = _mesh(spec)
    return [(mesh.get_group(i), mesh.size(i)) for i, p in enumerate(spec.placements)
            if isinstance(p, Shard) and p.dim in dims]


def _all_reduce(t: torch.Tensor, groups: Sequence[tuple[Any, int]], op: str) -> torch.Tensor:
    for group, n in groups:
        t = comm.all_reduce(t, group, n, op)  # by module: compile() swaps it while tracing
    return t


def _arg(args: Sequence[Any], kwargs: dict[str, Any], k: int, name: str) -> Any:
    return args[k] if k < len(args) else kwargs[name]


# -- log_softmax ---------------------------------------------------------------------------------


@register_local_impl(aten._log_softmax.default, with_input_specs=True)
def _log_softmax(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
                 input_specs: tuple[DTensorSpec, ...]) -> torch.Tensor:
    spec = input_specs[0]
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim") % max(spec.ndim, 1)
    groups = _mesh_dims(spec, [dim])
    if not groups:
        return _as_before(func, args, kwargs, output_spec, input_specs)  # type: ignore[no-any-return]
    if _arg(args, kwargs, 2, "half_to_float"):
        x = x.float()
    if x.size(dim) > 0:
        top = x.amax(dim, keepdim=True)  # (..., 1, ...)
    else:  # an empty piece of the row: the max's identity
        top = x.new_full(x.shape[:dim] + (1,) + x.shape[dim + 1:], float("-inf"))
    top = _all_reduce(top, groups, "max")  # the row max over every rank
    shifted = x - top
    total = _all_reduce(shifted.exp().sum(dim, keepdim=True), groups, "sum")  # (..., 1, ...)
    # contiguous, as aten's is (the piece of a transposed tensor is not)
    return (shifted - total.log()).contiguous()  # type: ignore[no-any-return]


@register_local_impl(aten._log_softmax_backward_data.default, with_input_specs=True)
def _log_softmax_backward(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
                          input_specs: tuple[DTensorSpec, ...]) -> torch.Tensor:
    spec = input_specs[0]
    grad, out = args[0], args[1]
    dim = _arg(args, kwargs, 2, "dim") % max(spec.ndim, 1)
    groups = _mesh_dims(spec, [dim])
    if not groups:
        return _as_before(func, args, kwargs, output_spec, input_specs)  # type: ignore[no-any-return]
    total = _all_reduce(grad.sum(dim, keepdim=True), groups, "sum")  # (..., 1, ...)
    grad_input = grad - out.exp() * total
    return grad_input.to(_arg(args, kwargs, 3, "input_dtype")).contiguous()  # type: ignore[no-any-return]


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

    def __init__(self, me: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                 input_specs: Sequence[DTensorSpec]) -> None:
        me_spec, t_spec, w_spec = _match([me, target, weight], input_specs)
        assert me_spec is not None
        c = class_dim(me_spec.ndim)
        self.classes = _mesh_dims(me_spec, [c])
        self.samples = _mesh_dims(me_spec, [d for d in range(me_spec.ndim) if d != c])
        if not self.classes:
            return
        coordinate = _coordinate(me_spec)
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
    bad = target[(target != ignore_index) & ((target < 0) | (target >= n_classes))]
    if bad.numel():
        raise ValueError(
            f"nll_loss / cross_entropy got targets {sorted(set(bad.tolist()))[:8]} out of range for "
            f"{n_classes} classes: a target must be in [0, {n_classes - 1}] or equal ignore_index={ignore_index}"
        )


@register_local_impl([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default], with_input_specs=True)
def _nll_loss(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
              input_specs: tuple[DTensorSpec, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    me, target, weight, reduction, ignore_index = (_arg(args, kwargs, k, name) for k, name in
                                                   enumerate(("self", "target", "weight", "reduction", "ignore_index")))
    p = _Pieces(me, target, weight, ignore_index, input_specs)
    if not p.classes:
        return _as_before(func, args, kwargs, output_spec, input_specs)  # type: ignore[no-any-return]
    if reduction != _MEAN:  # none: each sample's term; sum: this rank's terms and weights (P(sum))
        return func(me, p.target, p.weight, reduction, _LOCAL_IGNORE)  # type: ignore[no-any-return]
    loss, total = func(me, p.target, p.weight, _SUM, _LOCAL_IGNORE)
    if p.weight is None:  # the total is a count of kept targets: each rank has them all
        total = _all_reduce(p.kept.sum().to(me.dtype), p.samples, "sum")
    else:  # each kept target's weight sits on the rank that holds its class
        total = _all_reduce(total, p.classes + p.samples, "sum")
    return loss / total, total


@register_local_impl([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default], with_input_specs=True)
def _nll_loss_backward(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
                       input_specs: tuple[DTensorSpec, ...]) -> torch.Tensor:
    names = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
    grad, me, target, weight, reduction, ignore_index, total = (_arg(args, kwargs, k, n) for k, n in enumerate(names))
    p = _Pieces(me, target, weight, ignore_index, input_specs)
    if not p.classes:
        return _as_before(func, args, kwargs, output_spec, input_specs)  # type: ignore[no-any-return]
    # -w[t] * grad (over the global total weight for a mean) at each local target's class
    return func(grad, me, p.target, p.weight, reduction, _LOCAL_IGNORE, total)  # type: ignore[no-any-return]
