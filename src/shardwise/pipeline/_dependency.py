"""Phony tensors and `fork` / `join`: backward-order edges that carry no data.

Autograd runs a node's backward once every gradient it waits for has arrived, in an
order it chooses. The pipeline needs two orders autograd cannot infer: micro-batch `i`'s
backward through a partition before micro-batch `i-1`'s (so the partitions' backward
passes pipeline like the forward ones), and a skip's gradient moved back to the stashing
partition before that partition's backward needs it. A *phony* is an empty tensor; an
edge made of phonies costs no memory and no copy. `fork(x)` returns `x` and a phony whose
gradient `x`'s producer must wait for; `join(y, phony)` makes `y`'s backward emit that
gradient. `depend(a, b)` = fork `a`, join into `b`: `a`'s backward runs after `b`'s.

>>> x = torch.ones(2, requires_grad=True)
>>> y, phony = fork(x * 2)
>>> tuple(phony.shape), phony.requires_grad
((0,), True)
>>> z = join(y + 1, phony)
>>> z.sum().backward(); x.grad
tensor([2., 2.])
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import Tensor

from ._microbatch import Batch

__all__ = ["depend", "fork", "get_phony", "join"]

_phonies: dict[tuple[torch.device, bool], Tensor] = {}
_phony_lock = threading.Lock()


def get_phony(device: torch.device, *, requires_grad: bool) -> Tensor:
    """A cached empty tensor on `device` (one per device and grad flag); never write to it.

    Return it from an autograd function only after `.detach()`: a function that hands back
    one of its own inputs unchanged confuses autograd's view tracking.
    """
    key = (torch.device(device), requires_grad)
    with _phony_lock:
        phony = _phonies.get(key)
        if phony is None:
            phony = torch.empty(0, device=key[0], requires_grad=requires_grad)
            _phonies[key] = phony
    return phony


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor) -> tuple[Tensor, Tensor]:
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_phony: Optional[Tensor]) -> Tensor:
        return grad


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """`(input, phony)`; `input`'s producer waits in backward for the phony's gradient."""
    if torch.is_grad_enabled() and input.requires_grad:
        out, phony = Fork.apply(input)  # type: ignore[no-untyped-call]
        return out, phony
    return input, get_phony(input.device, requires_grad=False)


def join(input: Tensor, phony: Tensor) -> Tensor:
    """`input`, whose backward also sends a (zero-size) gradient to `phony`'s producer."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        out: Tensor = Join.apply(input, phony)  # type: ignore[no-untyped-call]
        return out
    return input


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Make `fork_from`'s backward wait for `join_to`'s (edges on the first tensor of each batch)."""
    a, b = fork_from.find_tensor_idx(), join_to.find_tensor_idx()
    fork_from[a], phony = fork(fork_from[a])
    join_to[b] = join(join_to[b], phony)
