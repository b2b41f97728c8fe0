"""The differentiable conversions: `from_local`, `to_local` and `redistribute` as autograd functions.

A DTensor can live in only part of a model, so these carry gradients across the border
between local and global and between layouts: what flows back through each is the
single-device gradient, redistributed to the layout the other side expects.

| function | forward | backward |
|---|---|---|
| `FromLocal` | a local piece becomes a DTensor of `spec` | the gradient in `spec`'s layout (Partial as Replicate); a P(avg) term's is 1/n of it |
| `ToLocal` | a DTensor's piece as a plain tensor | the plain gradient as a DTensor of `grad_spec` |
| `scale_grad` | the tensor itself | the gradient times a factor (a term's share of a sum the caller makes elsewhere) |
| `Redistribute` | the DTensor in another layout, on its mesh or another (optionally in the background, optionally cast first) | the gradient moved back to the source layout and mesh (Partial as Replicate), optionally in another dtype, and cast to the source's |
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .._placement import Partial, Replicate
from .._spec import DTensorSpec
from ._async import adopt, redistribute_async, resolve
from ._cross import move_local
from ._plans import misplaced, restride
from ._redistribute import redistribute_local
from ._wrap import DTensorBase, wrap

__all__ = ["FromLocal", "Redistribute", "ToLocal", "grad_target", "scale_grad"]


def grad_target(spec: DTensorSpec) -> DTensorSpec:
    """Layout a gradient must take to flow back to an input of layout `spec`.

    The gradient of every term of a Partial sum is the full gradient, so Partial -> Replicate.
    A product's term has no gradient the full one gives (it is the others' product times it):
    ValueError rather than a silently wrong one.
    """
    if not spec.has_partial():
        return spec
    if any(isinstance(p, Partial) and p.reduce_op == "prod" for p in spec.placements):
        raise ValueError(
            f"no gradient flows back into the terms of a {spec.layout_str()} DTensor: a Partial(prod) term's gradient "
            f"needs the other terms; reduce it (redistribute to Replicate) under torch.no_grad(), or from a detached piece"
        )
    return spec.with_placements(
        tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements), spec.shard_order
    )


def _grad_to(grad: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """Local piece of `grad` (a DTensor) in the layout `spec` wants."""
    assert isinstance(grad, DTensorBase)
    return redistribute_local(resolve(grad._local_tensor), grad._spec, grad_target(spec))


class Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: DTensorBase, target: DTensorSpec, async_op: bool = False,
                backward_dtype: Optional[torch.dtype] = None) -> Any:
        # `target` may carry another dtype than `x` (`forward_dtype`): the piece is cast first,
        # so the collectives move the cast bytes
        ctx.src_spec, ctx.backward_dtype = x._spec, backward_dtype
        local, spec = x._local_tensor, x._spec
        if target.dtype != spec.dtype:
            local = resolve(local).to(target.dtype)
            spec = spec.with_meta(spec.tensor_meta._replace(dtype=target.dtype))
        if async_op:
            pending = redistribute_async(local, spec, target)
            out = wrap(pending, target, x.requires_grad)
            adopt(pending, out)
            return out
        return wrap(move_local(resolve(local), spec, target), target, x.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        spec, cast = ctx.src_spec, ctx.backward_dtype
        assert isinstance(grad, DTensorBase)
        local, have = resolve(grad._local_tensor), grad._spec
        if cast is not None and cast != local.dtype:  # moved back in `backward_dtype`
            local = local.to(cast)
            have = have.with_meta(have.tensor_meta._replace(dtype=cast))
        back = move_local(local, have, grad_target(spec))
        return wrap(back.to(spec.dtype), grad_target(spec)), None, None, None


class ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: DTensorBase, grad_spec: DTensorSpec, handed_over: bool = False) -> torch.Tensor:
        ctx.grad_spec = grad_spec
        local = x._local_tensor
        # a view ties later in-place changes of the piece to `x`'s history, which autograd forbids
        # for a custom function's output; a piece handed over (see `to_local`) is an alias instead
        return local.detach() if handed_over else local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        if isinstance(grad, DTensorBase):
            # the local tensor went on as a plain tensor counted as replicated (implicit
            # replication): its gradient is a DTensor whose full value is this rank's piece's
            whole = grad._spec.with_placements((Replicate(),) * grad._spec.mesh.ndim)
            grad = redistribute_local(resolve(grad._local_tensor), grad._spec, whole)
        out = wrap(grad, ctx.grad_spec)
        if misplaced(out)[0]:  # the local gradient came out in another memory order than the global one's
            restride(out)
        return out, None, None


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DTensorSpec) -> Any:
        ctx.spec, ctx.outside = spec, None
        if getattr(spec.mesh, "_coordinate", ()) is None:  # on every call: the slot, not a list copy
            # a rank outside the mesh holds nothing, whatever it passed (torch's rule)
            ctx.outside = local.shape
            empty = torch.zeros((), dtype=local.dtype, device=local.device) if spec.ndim == 0 else local.new_empty((0,))
            return wrap(empty, spec, local.requires_grad)
        return wrap(local.view_as(local), spec, local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # each rank's piece is one term of a Partial: a Partial("avg") over n ranks counts
        # it 1/n, so its gradient is the full gradient / n (a "sum" term's is the full one)
        spec = ctx.spec
        if ctx.outside is not None:  # the piece this rank passed gets no gradient
            piece = grad._local_tensor if isinstance(grad, DTensorBase) else grad
            return piece.new_zeros(ctx.outside), None
        local = _grad_to(grad, spec)
        n = math.prod(size for size, p in zip(spec.mesh.shape, spec.placements)
                      if isinstance(p, Partial) and p.reduce_op == "avg")
        return (local / n if n > 1 else local), None


def to_local(x: DTensorBase, grad_spec: Optional[DTensorSpec] = None, handed_over: bool = False) -> torch.Tensor:
    """`x`'s piece, differentiable when grad mode is on (the gradient comes back in `grad_spec`).
    `handed_over`: `x` is a temporary no one else reads (a parallel style's output given to the
    model as a plain tensor), so the piece may be changed in place as a module's own output can
    be (Llama 4 adds its routed experts into its shared expert's output with `add_`)."""
    if not torch.is_grad_enabled():
        return x._local_tensor
    return ToLocal.apply(x, grad_spec or x._spec, handed_over)  # type: ignore[no-untyped-call,no-any-return]


__all__ += ["to_local"]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(t: torch.Tensor, factor: float) -> torch.Tensor:
    """`t`, whose gradient is multiplied by `factor` on its way back (a view: no copy)."""
    out: torch.Tensor = _ScaleGrad.apply(t, factor)  # type: ignore[no-untyped-call]
    return out
