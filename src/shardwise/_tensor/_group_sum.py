"""`GroupSum`: a reducer that sums (or averages) over one process group the gradients its parameters got in a backward pass.

Context parallelism needs it (each cp rank computes its own tokens' share of every
gradient), and so will expert-parallel averaging, fault-tolerant reduction across replica
groups and a pipeline's data-parallel average: the parameters are plain or DTensors whose
layout does not mention the group, so nothing else reduces over it. One class serves them
all, registered with the end-of-backward registry (`_end_of_backward`) like every other
reducer, so the question "who reduces this parameter?" has one answer and a second reducer
over the same parameter is refused.

Per pass: a parameter's first gradient puts its `.grad` from earlier passes aside (gradient
accumulation: that part is reduced already), so only this pass's share is summed; at the end
of the pass the shares are summed over the group, one all_reduce per bucket of the one
bucketer (`_comm.plan_buckets`), one bucket alive at a time, and added back to what was put
aside. Steps of a reentrant backward inside the pass wait for the outermost pass's end.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import _comm
from ._dtensor import DTensor
from ._end_of_backward import GradientReducer, Step, arm, disarm, is_armed, register, unregister

__all__ = ["GroupSum"]


class GroupSum(Step):
    """Sum over `group` (`size` ranks: `ranks`) the gradients of the parameters it `take`s, once
    per backward pass, then divide by `scale` (or average: `op="avg"`)."""

    def __init__(self, registrant: str, group: Any, size: int, ranks: Sequence[int], *, over: str, where: str,
                 op: str = "sum", scale: float = 1.0, mesh_dims: tuple[int, ...] = (), level: str = "replicas",
                 phase: str = "replicas") -> None:
        self.registrant, self.group, self.size, self.ranks = registrant, group, size, tuple(ranks)
        self.over, self.where, self.op, self.scale, self.mesh_dims = over, where, op, scale, mesh_dims
        self.level, self.phase = level, phase
        self.params: list[tuple[str, torch.Tensor]] = []
        self.order: dict[int, int] = {}  # id(param) -> its place (the same on every rank)
        self.touched: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}  # id -> (param, earlier .grad)
        self.handles: list[Any] = []

    # -- the registry's view ----------------------------------------------------------------
    def gradient_reducer(self) -> GradientReducer:
        op = self.op if self.scale == 1 else f"{self.op} / {self.scale:g}"
        return GradientReducer(self.registrant, self.level, op, self.ranks, self.over, self.where)

    def reduced_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.params)

    # -- taking and releasing parameters -----------------------------------------------------
    def take(self, params: Sequence[tuple[str, torch.Tensor]], hint: str = "") -> None:
        """Reduce `params` (name, parameter) from the next backward on; ValueError (nothing
        hooked) when another reducer at this level has one of them."""
        unique: dict[int, tuple[str, torch.Tensor]] = {}
        for name, p in params:
            unique.setdefault(id(p), (name, p))
        self.params = list(unique.values())
        if not self.params:
            return
        register(self, hint)
        for name, p in self.params:
            self.order[id(p)] = len(self.order)
            self.handles.append(p.register_hook(functools.partial(self.arrived, p)))  # type: ignore[no-untyped-call]

    def release(self) -> None:
        """Stop: hooks removed, registration dropped, gradients put aside given back."""
        for h in self.handles:
            h.remove()
        self.handles, self.params, self.order = [], [], {}
        unregister(self)
        self.recover()

    # -- backward -------------------------------------------------------------------------
    def arrived(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if id(param) not in self.touched:
            self.touched[id(param)] = (param, param.grad)
            param.grad = None
        if not is_armed(self):  # once per outermost pass
            arm(self)
        return grad

    def finish(self) -> None:
        items = sorted(self.touched.values(), key=lambda item: self.order[id(item[0])])
        self.touched = {}
        with torch.no_grad():
            held = [(p, earlier) for p, earlier in items if p.grad is not None]
            pieces = [_local(p.grad) for p, _ in held]
            sizes = [(t.numel() * t.element_size(), (t.dtype, t.device)) for t in pieces]
            for bucket in _comm.plan_buckets(sizes):
                group = [pieces[k] for k in bucket]
                # one bucket alive at a time: the sums land in the gradients before the next is packed
                summed = _comm.all_reduce_coalesced(group, self.group, self.size, self.op, mesh_dims=self.mesh_dims)
                for piece, total in zip(group, summed):
                    assert total is not None
                    piece.copy_(total / self.scale if self.scale != 1 else total)
                del summed
            for p, earlier in held:
                if earlier is not None:
                    _local(earlier).add_(_local(p.grad))  # (one layout: the pieces add as the wholes do)
                    p.grad = earlier
            for p, earlier in items:
                if p.grad is None and earlier is not None:
                    p.grad = earlier

    def recover(self) -> None:
        """After a backward that failed before its end: the gradients put aside go back."""
        for p, earlier in self.touched.values():
            if earlier is not None:
                p.grad = earlier
        self.touched = {}
        disarm(self)


def _local(t: Optional[torch.Tensor]) -> torch.Tensor:
    assert t is not None
    return t.to_local() if isinstance(t, DTensor) else t
