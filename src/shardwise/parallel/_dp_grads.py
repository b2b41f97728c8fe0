"""Data parallel's gradients: the compute view's backward and the reducer that averages replicated gradients over dp.

A replicated parameter's forward reads its local piece through `_LocalView`, whose backward
hands the gradient to the `_Reducer` instead of autograd's accumulation: the reducer keeps
the unreduced local sum where `zero_grad()` clears it and, at the end of the backward pass
(the `replicas` phase of the end-of-backward registry, `_tensor/_end_of_backward.py`),
averages every held gradient over dp through the one bucketer, in a fixed order (last
registered first), so the collectives match across ranks even when a rank leaves some
parameters unused. It is the registered reducer of those parameters: it writes their
`.grad` itself, in their layout. Inside `no_sync` it keeps the terms and arms nothing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import _comm as comm
from .._layout import ShardOrder
from .._mesh import DeviceMesh
from .._placement import Placement, Replicate
from .._spec import DTensorSpec
from .._tensor import DTensor, GradientReducer, Step, arm

__all__ = ["_LocalView", "_Param", "_Reducer"]


@dataclass(eq=False)
class _Param:
    """One stored parameter and how to build its compute view."""

    name: str
    param: DTensor  # an nn.Parameter DTensor on the whole mesh
    sharded: bool  # Shard(k) on dp (else Replicate)
    gathered: DTensorSpec  # Replicate on dp, tp placements on the rest: what forward computes with
    grad_spec: DTensorSpec  # Partial("avg") on dp: the layout of a local gradient
    tp_mesh: Optional[DeviceMesh]  # set when the parameter was a DTensor on the tp sub-mesh
    tp_placements: tuple[Placement, ...] = ()
    tp_order: ShardOrder = ()
    piece_shape: tuple[int, ...] = ()  # what a dp gather gives back: the tp piece, or the whole parameter

    def local_shape(self) -> torch.Size:
        return self.param._local_tensor.shape


@dataclass(eq=False)
class _Reducer(Step):
    """Averages replicated parameters' local gradients over dp through the one bucketer
    (`_comm.all_reduce_coalesced`), once per backward (a step of the registry's `replicas` phase).

    Until then a parameter's unreduced local sum lives where `zero_grad()` and `p.grad = None`
    clear it, so an abandoned `no_sync()` accumulation or a backward that failed halfway cannot
    leak into the next step: in `.grad` itself, laid out as the Partial("avg") it is
    (`_Param.grad_spec`), or, when `.grad` already holds a reduced gradient (accumulation over
    a reduced backward), beside it, tied to that very gradient tensor and its version (a
    `zero_()` or a new `.grad` drops it)."""

    params: list[_Param]  # last registered first: about the order backward produces them
    group: Any
    size: int
    bucket_bytes: int
    record: GradientReducer  # what the registry reports
    sync: bool = True
    # id(_Param) -> (the reduced .grad it adds to, that grad's version, the local sum)
    beside: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = field(default_factory=dict)
    reduced: set[int] = field(default_factory=set)
    phase = "replicas"

    def __post_init__(self) -> None:
        self.reduced = {id(p) for p in self.params}

    def gradient_reducer(self) -> GradientReducer:
        return self.record

    def reduced_params(self) -> list[tuple[str, torch.Tensor]]:
        return [(p.name, p.param) for p in self.params]

    def add(self, p: _Param, grad: torch.Tensor) -> None:
        if id(p) not in self.reduced:
            raise ValueError(
                f"parameter {p.name} got a gradient but did not require one when data_parallel placed it: "
                f"set requires_grad before calling data_parallel"
            )
        held = p.param.grad
        if held is None:  # the term becomes the gradient, as the Partial it is
            p.param.grad = DTensor(grad.detach().clone(memory_format=torch.contiguous_format), p.grad_spec,
                                   requires_grad=False)
        elif held._spec == p.grad_spec:  # type: ignore[attr-defined]
            held._local_tensor.add_(grad)  # type: ignore[attr-defined]
        else:
            term = self._beside(p, held)
            if term is None:
                term = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            term.add_(grad)
            self.beside[id(p)] = (weakref.ref(held), held._version, term)
        if self.sync:
            arm(self)

    def finish(self) -> None:
        self.flush()

    def flush(self) -> None:
        """Average the held gradients over dp and add them to the parameters' `.grad` (Replicate
        on dp); a parameter no rank used keeps its gradient as it was."""
        with torch.no_grad():
            grads = [p.param.grad for p in self.params]
            values = [self._unreduced(p, g) for p, g in zip(self.params, grads)]
            self.beside.clear()
            templates = [p.param._local_tensor for p in self.params]
            try:
                averaged = comm.all_reduce_coalesced(values, self.group, self.size, "avg", templates=templates,
                                                     bucket_bytes=self.bucket_bytes)
            except comm.CollectiveError as exc:
                raise exc.add_operation(f"data parallel: averaging the gradients of {len(self.params)} parameters "
                                        f"over {self.size} ranks at the end of backward")
            for p, g, piece in zip(self.params, grads, averaged):
                if piece is None:
                    continue
                if g is None or g._spec == p.grad_spec:  # type: ignore[attr-defined]
                    p.param.grad = DTensor(piece, p.param._spec, requires_grad=False)
                else:
                    g._local_tensor.add_(piece)  # type: ignore[attr-defined]

    def _beside(self, p: _Param, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """The local sum kept beside `grad` (a reduced gradient), if `grad` is still the tensor
        it was kept for and nothing has changed it in place since."""
        found = self.beside.get(id(p))
        if found is None or found[0]() is not grad or grad._version != found[1]:
            return None
        return found[2]

    def _unreduced(self, p: _Param, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """`p`'s unreduced local sum: its `.grad` while that is the Partial("avg") term, else the
        sum kept beside its reduced `.grad`; None when there is none (cleared with the grads)."""
        if grad is None:
            return None
        if grad._spec == p.grad_spec:  # type: ignore[attr-defined]
            return grad._local_tensor  # type: ignore[attr-defined,no-any-return]
        return self._beside(p, grad)


class _LocalView(torch.autograd.Function):
    """This rank's piece of a whole-mesh DTensor as a plain tensor; its gradient goes to the reducer or back as P(avg)."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, p: _Param, reducer: Optional[_Reducer]) -> torch.Tensor:
        ctx.p, ctx.reducer = p, reducer
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        p: _Param = ctx.p
        if isinstance(grad, DTensor):  # a plain view that met tensor-parallel DTensors: replicated on tp
            grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)._local_tensor
        if ctx.reducer is not None:
            ctx.reducer.add(p, grad)
            return None, None, None
        return DTensor(grad, p.grad_spec, requires_grad=False), None, None
