"""nll_loss strategies (the class dim whole) and the masked mean a sample split needs.

| op | runs split by | outputs (loss, total weight) |
|---|---|---|
| nll_loss(2d)_forward, none | samples (self and target alike) | split like the target, R |
| nll_loss(2d)_forward, sum | samples | P(sum), P(sum) |
| nll_loss(2d)_forward, mean | samples of self, target whole | P(sum), R: `nll_loss_local` |
| nll_loss(2d)_backward | samples | split like self |

A mean over samples split across ranks cannot run as the plain aten op: each rank's mean
would divide by its own total weight. Its local implementation (`nll_loss_local`) divides
this rank's share of the loss sum by the total weight of every sample (the target is whole
on every rank), so the P(sum) of the outputs is the global mean. A vocab-split loss (the
class dim split) is `loss_parallel`'s variant of these rules (`_loss_parallel`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from ._args import Args, Option, combine, linear_partial
from ._local import LocalCall
from ._registry import register_op_strategy
from ._schema import OpSchema, OpStrategy

__all__ = ["NLL_BACKWARD", "NLL_FORWARD", "nll_loss_local"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
NLL_FORWARD = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
NLL_BACKWARD = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
_NONE, _MEAN, _SUM = 0, 1, 2


def _class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _sample_dims(ndim: int) -> list[tuple[int, int]]:
    """(self dim, target dim) of every dim but the class dim."""
    c = _class_dim(ndim)
    return [(d, d if d < c else d - 1) for d in range(ndim) if d != c]


def _total_weight(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(dtype)
    return (weight[torch.where(keep, target, 0)] * keep).sum().to(dtype)


def nll_loss_local(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.nll_loss(2d)_forward` on one rank's samples. For a mean over samples split across
    ranks while the target is whole: this rank's share of the loss sum divided by the total
    weight of every sample, so the P(sum) of the outputs is the global mean."""
    func, args, kwargs = call.func, call.args, call.kwargs
    self_spec, target_spec = call.input_specs[0], call.input_specs[1]
    me, target, weight, reduction, ignore_index = (call.arg(k, name) for k, name in
                                                    enumerate(("self", "target", "weight", "reduction", "ignore_index")))
    shape, offset = self_spec.local_shape_and_offset(call.coordinate(self_spec))
    dims = _sample_dims(self_spec.ndim)
    whole_target = tuple(target.shape) == tuple(target_spec.shape)
    if reduction != _MEAN or not whole_target or all(shape[d] == self_spec.shape[d] for d, _ in dims):
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    piece = target
    for d, t in dims:
        piece = piece.narrow(t, offset[d], shape[d])
    part, _ = func(me, piece, weight, _SUM, ignore_index)
    total = _total_weight(target, weight, ignore_index, me.dtype)
    return part / total, total


@register_op_strategy(NLL_FORWARD, local=nll_loss_local)
def _nll_loss_forward_strategy(schema: OpSchema) -> OpStrategy:
    # The class dim is whole (a vocab-parallel loss is a different op). Samples may be split:
    # none -> each rank its losses; sum -> P(sum) of loss and total weight; mean -> the
    # masked local computation divides by the total weight of all samples (target R).
    a = Args(schema)
    me = a.need("self")
    reduction = int(schema.arg(3, "reduction", _MEAN))
    per_dim = []
    for i in range(a.mesh_ndim):
        opts: list[Option] = []
        for d, t in _sample_dims(me.ndim):
            if reduction == _NONE:
                opts.append(a.opt((Shard(t), R), {"self": Shard(d), "target": Shard(t)}))
            elif reduction == _SUM:
                opts.append(a.opt((SUM, SUM), {"self": Shard(d), "target": Shard(t)}))
            else:  # the local implementation divides by the total weight of every sample
                opts.append(a.opt((SUM, R), {"self": Shard(d)}))
        p = linear_partial(a, "self", i)
        if p is not None:
            opts.append(a.opt((p, R), {"self": p}))  # linear in the log-probabilities
        per_dim.append(opts)
    return combine(a, per_dim, n_outputs=2)


@register_op_strategy(NLL_BACKWARD)
def _nll_loss_backward_strategy(schema: OpSchema) -> OpStrategy:
    a = Args(schema)
    me = a.need("self")
    reduction = int(schema.arg(4, "reduction", _MEAN))
    per_dim = []
    for i in range(a.mesh_ndim):
        opts: list[Option] = []
        for d, t in _sample_dims(me.ndim):
            ins: dict[str, Placement] = {"self": Shard(d), "target": Shard(t)}
            if reduction == _NONE:
                ins["grad_output"] = Shard(t)
            opts.append(a.opt((Shard(d),), ins))  # a mean divides by the (replicated) total weight
        p = linear_partial(a, "grad_output", i)
        if p is not None:
            opts.append(a.opt((p,), {"grad_output": p, "self": a.shape_only("self", i)}))
        per_dim.append(opts)
    tw = a.pos("total_weight")
    free = [tw] if tw is not None and reduction != _MEAN else []  # read only by a mean
    return combine(a, per_dim, free=free)
