"""Portals: a skip tensor's private path from the stashing partition to the popping one.

A skip tensor passed along with the activations would be copied to every partition
between its stash and its pop and kept alive on each. A `Portal` instead hides the
tensor from autograd at the stash (`blue`), moves it once, straight to the popping
partition's device (`copy`), and reveals it there (`orange`). Three autograd functions
carry the gradient back the same way: `PortalOrange`'s backward stores the gradient in
the portal, `PortalCopy`'s moves it to the stash device, and `PortalBlue`'s hands it to
the stashed tensor. They are chained to the activations by phonies (see
`_dependency`), so autograd runs them in that order.

Tensor life. The portal counts the uses it still expects and drops the tensor at the
last one, so a skip is freed the moment it has been popped:

    no checkpointing (life 2)      checkpointing (life 3)
    stash:     blue()   -> 1       stash:      blue()   -> 2
    pop:       orange() -> 0 free  pop:        orange() -> 1
                                   recompute pop:   orange() -> 0 free
                                   recompute stash: put back with life 1,
                                                    blue() -> 0 free

A stashed `None` (a skip that is not taken this time) goes through as `None` without
any autograd node. The gradient is single-use; a popped tensor that received no gradient
(unused, or used without grad) gives the stashed tensor no gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .._dependency import get_phony
from .._stream import AbstractStream, Copy

__all__ = ["Portal", "PortalBlue", "PortalCopy", "PortalOrange"]


class Portal:
    """Holds one skip tensor of one micro-batch and its gradient while they travel."""

    def __init__(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.tensor: Optional[Tensor] = None
        self.tensor_life = 0
        self.grad: Optional[Tensor] = None
        self.put_tensor(tensor, tensor_life)

    def __repr__(self) -> str:
        held = "None" if self.tensor is None else f"Tensor{tuple(self.tensor.shape)}"
        return f"Portal(tensor={held}, tensor_life={self.tensor_life})"

    # -- the three ends ---------------------------------------------------------------

    def blue(self) -> Tensor:
        """Hide the tensor from autograd; return a phony whose backward emits its gradient."""
        tensor = self.use_tensor()
        if tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        phony: Tensor = PortalBlue.apply(self, tensor)  # type: ignore[no-untyped-call]
        return phony

    def orange(self, phony: Tensor) -> Optional[Tensor]:
        """Reveal the (copied) tensor where it is popped; its gradient goes into the portal."""
        self.check_tensor_life()
        if self.tensor is None:
            return self.use_tensor()
        tensor: Tensor = PortalOrange.apply(self, phony)  # type: ignore[no-untyped-call]
        return tensor

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Move the tensor to `next_stream`'s device; the gradient comes back in backward."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        out: Tensor = PortalCopy.apply(self, prev_stream, next_stream, phony)  # type: ignore[no-untyped-call]
        return out

    # -- tensor life ------------------------------------------------------------------

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError(
                "tensor in portal has been removed: the skip tensor was used more often than "
                "the portal expected (a partition run a third time?); report this as a bug"
            )

    def put_tensor(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        """Hold `tensor` for `tensor_life` more uses (dropped now if that is 0)."""
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def use_tensor(self) -> Optional[Tensor]:
        """Take the tensor for one use; the last use drops it from the portal."""
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Tensor) -> None:
        self.grad = grad

    def use_grad(self) -> Tensor:
        """Take the gradient (once)."""
        grad = self.grad
        if grad is None:
            raise RuntimeError(
                "grad in portal has been removed or never set: the popping side's backward did "
                "not run before the stashing side's (a missing phony edge); report this as a bug"
            )
        self.grad = None
        return grad

    def take_grad(self) -> Optional[Tensor]:
        """Take the gradient if the popped tensor received one (`None`: it got no gradient)."""
        grad, self.grad = self.grad, None
        return grad


class PortalBlue(torch.autograd.Function):
    """Stash end: forward swallows the tensor; backward returns the gradient the portal holds."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> tuple[None, Optional[Tensor]]:
        portal: Portal = ctx.portal
        return None, portal.take_grad()


class PortalOrange(torch.autograd.Function):
    """Pop end: forward returns the hidden tensor; backward puts its gradient in the portal."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor) -> Tensor:
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None  # orange() handles None without building this node
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        portal: Portal = ctx.portal
        portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    """Move the hidden tensor between devices in forward and its gradient back in backward."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream,
                phony: Tensor) -> Tensor:
        ctx.portal, ctx.prev_stream, ctx.next_stream = portal, prev_stream, next_stream
        assert portal.tensor is not None  # copy() handles None without building this node
        (portal.tensor,) = Copy.forward(ctx, prev_stream, next_stream, portal.tensor)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> tuple[None, None, None, None]:
        portal: Portal = ctx.portal
        grad = portal.take_grad()
        if grad is not None:  # None: the pop side's output did not depend on the skip
            (grad,) = Copy.backward(ctx, grad)[2:]
            portal.put_grad(grad)
        return None, None, None, None
