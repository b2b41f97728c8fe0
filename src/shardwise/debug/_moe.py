"""The MoE section of a report: per experts module that dispatches tokens, what it sends and what it holds.

Under `ExpertParallel(tokens="split")` a MoE layer's communication is its all_to_alls (the
route counts, the routes out, the results back; backward the last two transposed) and its
memory is the rank's share of the experts. Both scale with the ep group and the routing, and
both hide in a whole-model table among the dense layers' numbers, so the section lists them
per layer: the all_to_alls filed under the experts module's path, per pass, and the bytes
of this rank's pieces of the expert stacks, their gradients and their optimizer state.

A dry run fills it (`RankReport.moe`), with the routing it assumed; a real run makes the
same section with `moe_report(model, counter, optimizer)` from its `CommCounter` and the
routes the last forward took (`route_counts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._tensor import DTENSOR_CLASSES
from ..parallel import route_counts
from ._counter import CommCounter, _size

__all__ = ["MoeLayer", "MoeReport", "dispatching_experts", "moe_report", "moe_section"]


@dataclass(frozen=True)
class MoeLayer:
    """One experts module that dispatches tokens, on one rank: its path, experts in all and
    here, routes this rank's tokens took in the last forward (its own experts' included),
    `(count, bytes received)` of its all_to_alls per pass, and the bytes of this rank's
    pieces of its expert stacks, their gradients and their optimizer state."""

    path: str
    experts: int
    local_experts: int
    routes: int
    forward: tuple[int, int]
    backward: tuple[int, int]
    parameters: int
    gradients: int
    optimizer: int


@dataclass(frozen=True)
class MoeReport:
    """The MoE section: the routing the numbers follow and one `MoeLayer` per experts module."""

    routing: str
    layers: list[MoeLayer]

    def totals(self) -> dict[str, int]:
        """Bytes over every layer: all_to_all received per pass, and expert memory per category."""
        return {"forward": sum(m.forward[1] for m in self.layers), "backward": sum(m.backward[1] for m in self.layers),
                "parameters": sum(m.parameters for m in self.layers),
                "gradients": sum(m.gradients for m in self.layers),
                "optimizer": sum(m.optimizer for m in self.layers)}

    def lines(self, indent: str = "  ") -> list[str]:
        out = [f"{indent}MoE layers dispatching tokens: {len(self.layers)} (routing: {self.routing})",
               f"{indent}  {'experts module':<36}{'experts':>9}{'routes':>9}{'forward all_to_all':>20}"
               f"{'backward all_to_all':>21}{'params':>10}{'grads':>10}{'optim':>10}"]
        for m in self.layers:
            out.append(f"{indent}  {m.path[-36:]:<36}{f'{m.local_experts}/{m.experts}':>9}{m.routes:>9}"
                       f"{_cell(m.forward):>20}{_cell(m.backward):>21}{_size(m.parameters):>10}"
                       f"{_size(m.gradients):>10}{_size(m.optimizer):>10}")
        t = self.totals()
        out.append(f"{indent}  {'total':<54}{_size(t['forward']):>20}{_size(t['backward']):>21}"
                   f"{_size(t['parameters']):>10}{_size(t['gradients']):>10}{_size(t['optimizer']):>10}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines(""))


def _cell(tally: tuple[int, int]) -> str:
    return f"x{tally[0]} {_size(tally[1])}"


def dispatching_experts(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(path, module) of every experts module under `modules` that dispatches its tokens
    (`ExpertParallel(tokens="split")`), each once."""
    found, seen = [], set()
    for root in modules:
        for path, m in root.named_modules():
            if id(m) in seen:
                continue
            try:
                route_counts(m)
            except ValueError:
                continue
            seen.add(id(m))
            found.append((path, m))
    return found


def moe_section(modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                collectives: Iterable[tuple[str, str, str, int]], routing: str) -> Optional[MoeReport]:
    """The section for `modules` (None where none dispatches), with `collectives` as
    (kind, module path, pass, bytes received) in issue order."""
    layers = dispatching_experts(modules)
    if not layers:
        return None
    tallies: dict[tuple[str, str], list[int]] = {}
    for kind, path, which, nbytes in collectives:
        if kind == "all_to_all":
            row = tallies.setdefault((path, which), [0, 0])
            row[0] += 1
            row[1] += nbytes
    return MoeReport(routing, [_layer(path, m, optimizers, {w: tuple(tallies.get((path, w), (0, 0)))
                                                           for w in ("forward", "backward")})
                               for path, m in layers])


def moe_report(model: nn.Module, counter: Optional[CommCounter] = None,
               optimizer: Optional[torch.optim.Optimizer] = None) -> MoeReport:
    """The MoE section of a real run on this rank: the all_to_alls `counter` (a
    `CommCounter(model)` around the step) filed under each experts module, the routes the last
    forward took, and the expert memory (`optimizer`'s state included when given).

        with CommCounter(model) as counter:
            step(model, opt, batch)
        print(moe_report(model, counter, opt))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"moe_report reads an nn.Module's experts modules, got {type(model).__name__}")
    if counter is not None and counter.model is not model:
        raise ValueError("moe_report(model, counter): the counter follows another module; count the step with "
                         "CommCounter(model) for this model")
    counts = {} if counter is None else {(path, which): kinds.get("all_to_all", [0, 0])
                                         for path, passes in counter.counts.items() for which, kinds in passes.items()}
    layers = [_layer(path, m, [optimizer] if optimizer is not None else [],
                     {w: tuple(counts.get((path, w), (0, 0))) for w in ("forward", "backward")})
              for path, m in dispatching_experts([model])]
    return MoeReport("as routed (the last forward's routes)", layers)


def _layer(path: str, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
           comm: dict[str, Any]) -> MoeLayer:
    total = int(getattr(module, "num_experts"))
    stacks = [p for p in module.parameters(recurse=False) if p.ndim >= 2 and p.shape[0] == total]
    local = _local(stacks[0]).shape[0] if stacks else 0
    states = [v for opt in optimizers for p in stacks for v in opt.state.get(p, {}).values()
              if isinstance(v, torch.Tensor)]
    return MoeLayer(path, total, local, route_counts(module).routes, comm["forward"], comm["backward"],
                    _bytes(stacks), _bytes([p.grad for p in stacks if p.grad is not None]), _bytes(states))


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if type(t) in DTENSOR_CLASSES else t  # type: ignore[no-any-return]


def _bytes(tensors: Iterable[Any]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)
