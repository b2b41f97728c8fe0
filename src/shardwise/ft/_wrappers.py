"""torchft's wrappers: a model whose gradients are reduced across replica groups, an optimizer that steps only on a commit.

`DistributedDataParallel(manager, module)` registers one reducer at the end-of-backward
registry's `across` level for the module's parameters: after the group's own reduction
(`fully_shard`'s reduce-scatter, `data_parallel`, a layout's) has settled each gradient,
the gradients (this rank's pieces) are averaged over the quorum's members, weighted by
the samples each contributed (`manager.samples`). A parameter another reducer already
reduces across groups is refused, naming both.

`Optimizer(manager, optimizer)`: `zero_grad()` starts the step's quorum (healing this group
if it is behind), `step()` applies the update only if `should_commit()`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._tensor import GradientReducer, Step, arm, caller_place, is_armed, register
from ._manager import Manager

__all__ = ["DistributedDataParallel", "Optimizer"]


class _AcrossGroups(Step):
    """The `across` reducer of one wrapped module (see the module docstring). It arms when the
    backward pass reaches the module's outputs: under `fully_shard` the parameters themselves
    are not in the graph (their unsharded copies are), and their gradients are set at the end
    of the pass, before this step reads them."""

    phase = "across"

    def __init__(self, manager: Manager, params: list[tuple[str, torch.Tensor]], where: str) -> None:
        self.manager, self.params, self.where = manager, params, where

    def gradient_reducer(self) -> GradientReducer:
        return GradientReducer(f"shardwise.ft replica group {self.manager.replica_id}", "across",
                               "avg weighted by samples", (), "the quorum's replica groups", self.where)

    def reduced_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.params)

    def watch(self, out: Any) -> Any:
        """Arm at the end of the backward pass that reaches `out` (the module's outputs)."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._arrived)  # type: ignore[no-untyped-call]
        return out

    def _arrived(self, grad: torch.Tensor) -> torch.Tensor:
        if not is_armed(self):
            arm(self)
        return grad

    def finish(self) -> None:
        grads = [_local(p.grad) for _, p in self.params if p.grad is not None]
        with torch.no_grad():
            self.manager.reduce_gradients(grads)


def _local(t: Optional[torch.Tensor]) -> torch.Tensor:
    assert t is not None
    return t.to_local() if hasattr(t, "to_local") else t


class DistributedDataParallel(nn.Module):
    """`module`, its gradients averaged over the manager's replica groups after each backward."""

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        params: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._reducer = _AcrossGroups(manager, params, caller_place())
        register(self._reducer, "wrap a module in shardwise.ft.DistributedDataParallel once")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._reducer.watch(self.module(*args, **kwargs))


class Optimizer:
    """`optimizer`, stepping only on steps every replica group commits (torchft's `Optimizer`)."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer) -> None:
        self.manager, self.optim = manager, optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> bool:
        """Apply the update if the step commits; returns whether it did."""
        if not self.manager.should_commit():
            return False
        self.optim.step(closure)
        return True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)
