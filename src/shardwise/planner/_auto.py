"""`AutoPlanner`: the cheapest way to shard a training step on a mesh, found by dry runs.

Each candidate gives every mesh dim a role: data parallel ("dp"), data parallel with
parameters, gradients and optimizer state sharded ZeRO-3 style ("zero"), or tensor parallel
("tp": the Megatron cuts of `MegatronPlanner`, or the `tp_planner` given). A candidate is
measured, not guessed: the model is copied onto the meta device, sharded for it on an
`AbstractMesh` of the real shape, and one training step (forward, loss, backward, optimizer
step; the optimizer's state made beforehand, as in every step but the first) dry-runs as
rank 0, every op through its real strategy. `CostModel.step` turns the
rank's FLOPs, collectives and peak memory into modelled seconds; the fastest candidate
within `memory_budget` wins.

Repeated layers are clustered: a model whose largest list of identical blocks has L of them
dry-runs with 1 block and with 2, and each cost grows by their difference L - 2 more times,
so a 32-layer model plans about as fast as a 2-layer one.

On a 1-D mesh one more candidate, "auto", is the layout solver's plan (`_layout_plan`: a
layout per parameter and input chosen from every op's strategies by an integer program),
measured by the same dry run; `planner.layouts` holds it.

The plan is an ordinary `ShardingPlan` (the tp styles, empty when no dim is tp; the solver's
layouts for "auto"); the roles are in `planner.report`; `planner.apply(model, mesh)` does
both on a real mesh, and `planner.local_inputs(batch, mesh)` gives each rank its share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Replicate
from ..debug import dry_run
from ..parallel import MegatronPlanner, ShardingPlan, ShardingPlanner, data_parallel, shard_module
from ._cost import CostModel, StepCost
from ._layout_plan import LayoutPlan, plan_layouts
from ._solve import MemoryBudgetError
from ._model import default_loss, meta_copy, repeated, steady

__all__ = ["AutoPlanReport", "AutoPlanner", "Candidate"]

Roles = tuple[str, ...]
ROLES = ("dp", "zero", "tp", "auto")


@dataclass(frozen=True)
class Candidate:
    """One way to use the mesh: a role per mesh dim, its modelled cost, and whether it fits."""

    roles: Roles
    cost: StepCost
    fits: bool


@dataclass(frozen=True)
class AutoPlanReport:
    """What `AutoPlanner.build_plan` found: every candidate, the chosen one, its plan, and
    the seconds planning took."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    candidates: list[Candidate]
    chosen: Candidate
    plan: ShardingPlan
    seconds: float
    memory_budget: Optional[int]

    def __str__(self) -> str:
        lines = [f"AutoPlanner on mesh {self.mesh_shape} {self.mesh_dim_names}: {len(self.candidates)} candidates in "
                 f"{self.seconds:.2f} s" + (f", memory budget {_gib(self.memory_budget)}" if self.memory_budget else ""),
                 f"  {'roles':<22}{'step s':>10}{'compute s':>11}{'comm s':>10}{'comm':>11}{'peak/rank':>12}  fits"]
        for c in sorted(self.candidates, key=lambda c: c.cost.seconds):
            roles = ", ".join(f"{n}={r}" for n, r in zip(self.mesh_dim_names, c.roles))
            mark = " <- chosen" if c is self.chosen else ""
            lines.append(f"  {roles:<22}{c.cost.seconds:>10.4f}{c.cost.compute_seconds:>11.4f}{c.cost.comm_seconds:>10.4f}"
                         f"{_gib(c.cost.comm_bytes):>11}{_gib(c.cost.peak_bytes):>12}  {'yes' if c.fits else 'no'}{mark}")
        return "\n".join(lines)


def _gib(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class AutoPlanner(ShardingPlanner):
    """Chooses a role for every mesh dim of `mesh` (data parallel, ZeRO-3, tensor parallel) by
    the modelled time of one training step on `example_inputs` (the global batch: data-parallel
    dims split its dim 0), under `memory_budget` bytes per rank (see the module docstring).

    `loss_fn(output)` makes the loss (default: `output.loss` when the model returns one, else
    the output's mean); `optimizer` is the optimizer class whose state counts in memory."""

    def __init__(self, mesh: AbstractMesh, *, example_inputs: Sequence[Any],
                 memory_budget: Optional[int] = None, cost: Optional[CostModel] = None,
                 loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                 optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
                 tp_planner: Optional[ShardingPlanner] = None, time_limit: float = 10.0) -> None:
        if not isinstance(mesh, AbstractMesh):
            raise TypeError(f"AutoPlanner plans for a mesh (a DeviceMesh or an AbstractMesh), got {type(mesh).__name__}")
        if mesh.ndim > 2:
            raise ValueError(f"AutoPlanner plans 1-D and 2-D meshes (one tp dim and one data dim), got shape {mesh.shape}: "
                             f"plan a 2-D slice and add the pipeline by hand")
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, Sequence):
            raise TypeError("example_inputs is the tuple of the model's forward arguments (the global batch), "
                            f"got {type(example_inputs).__name__}: e.g. example_inputs=(tokens,)")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                          or memory_budget <= 0):
            raise ValueError(f"memory_budget is bytes per rank, a positive int, got {memory_budget!r}")
        self.mesh = mesh
        self.names = tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim)))
        self.abstract = AbstractMesh(mesh.shape, self.names)
        self.example_inputs = tuple(example_inputs)
        self.memory_budget = memory_budget
        self.cost = cost if cost is not None else CostModel.gloo_cpu()
        self.loss_fn = loss_fn if loss_fn is not None else default_loss
        self.optimizer = optimizer
        self.tp_planner = tp_planner if tp_planner is not None else MegatronPlanner()
        if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
            raise ValueError(f"time_limit is the layout solver's seconds, a positive number, got {time_limit!r}")
        self.time_limit = float(time_limit)
        self.layouts: Optional[LayoutPlan] = None
        self.report: Optional[AutoPlanReport] = None

    # -- planning -----------------------------------------------------------------------

    def build_plan(self, module: nn.Module) -> ShardingPlan:
        """The tp styles of the cheapest candidate that fits (an empty plan when no dim is tp);
        the whole comparison is in `self.report`."""
        start = time.perf_counter()
        tp_plan = self.tp_planner.build_plan(module)
        options = [r for r in self._options(bool(tp_plan.plan)) if self._splits(r)]
        self.layouts = None
        if self.abstract.ndim == 1:
            try:
                self.layouts = plan_layouts(module, self.abstract, self.example_inputs, self.loss_fn, self.cost,
                                            memory_budget=self.memory_budget,
                                            state_factor=_state_factor(self.optimizer), time_limit=self.time_limit)
                options.append(("auto",))
            except MemoryBudgetError:  # the role candidates below say how close they come
                self.layouts = None
        if not options:
            raise ValueError(f"the batch of example_inputs splits evenly over no data-parallel dim of mesh "
                             f"{self.mesh.shape}, and no dim can be tensor parallel: give a batch divisible by them")
        candidates = [self._candidate(module, roles) for roles in options]
        fitting = [c for c in candidates if c.fits]
        if not fitting:
            least = min(candidates, key=lambda c: c.cost.peak_bytes)
            raise ValueError(f"no way to shard {type(module).__name__} on mesh {self.mesh.shape} fits memory_budget="
                             f"{self.memory_budget} B per rank: the smallest peak is {least.cost.peak_bytes} B "
                             f"({', '.join(least.roles)}); raise the budget, use a bigger mesh, or shrink the batch")
        chosen = min(fitting, key=lambda c: (c.cost.seconds, c.cost.comm_bytes))
        plan = tp_plan if "tp" in chosen.roles else ShardingPlan(plan={})
        if chosen.roles == ("auto",) and self.layouts is not None:
            plan = self.layouts.plan
        self.report = AutoPlanReport(self.mesh.shape, self.names, candidates, chosen, plan,
                                     time.perf_counter() - start, self.memory_budget)
        return plan

    def compare(self, module: nn.Module, options: Mapping[str, Sequence[str]]) -> dict[str, StepCost]:
        """The modelled cost of named role choices, e.g. {"megatron": ("tp",), "data parallel": ("dp",)}."""
        return {name: self._candidate(module, tuple(roles)).cost for name, roles in options.items()}

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Shard `module` on the real `mesh` (the planned shape) as the report chose: the plan
        over the tp dim, then data parallel (ZeRO-3 for "zero") over the other."""
        if self.report is None:
            self.build_plan(module)
        assert self.report is not None
        if tuple(mesh.shape) != tuple(self.mesh.shape):
            raise ValueError(f"the plan is for a mesh of shape {self.mesh.shape}, got {mesh.shape}")
        return _shard(module, mesh, self.names, self.report.chosen.roles, self.report.plan)

    def local_inputs(self, inputs: Sequence[Any], mesh: DeviceMesh) -> tuple[Any, ...]:
        """This rank's share of the global batch `inputs` under the chosen plan: the rows of
        its data-parallel coordinate for a data-parallel dim or an input the solver splits
        (`Shard(0)`), the whole input otherwise."""
        if self.report is None:
            raise ValueError("local_inputs follows the chosen plan: call build_plan first")
        roles = self.report.chosen.roles
        if roles == ("auto",):
            assert self.layouts is not None
            parts = mesh.size(0)
            return tuple(x if lay is None or lay.placements[0] == Replicate() else x.chunk(parts)[mesh.get_local_rank(0)]
                         for x, lay in zip(inputs, self.layouts.inputs))
        data = [d for d, r in enumerate(roles) if r in ("dp", "zero")]
        if not data:
            return tuple(inputs)
        parts, me = mesh.size(data[0]), mesh.get_local_rank(data[0])
        return tuple(x.chunk(parts)[me] if isinstance(x, torch.Tensor) and x.ndim > 0 else x for x in inputs)

    def _options(self, can_tp: bool) -> list[Roles]:
        if self.abstract.ndim == 1:
            one: list[Roles] = [("dp",), ("zero",)]
            return one + ([("tp",)] if can_tp else [])
        if not can_tp:
            raise ValueError(f"a 2-D mesh needs a tensor-parallel dim, but {type(self.tp_planner).__name__} found no "
                             "layer to cut: plan a 1-D mesh, or pass tp_planner=")
        out: list[Roles] = []
        for tp in range(2):
            for data in ("dp", "zero"):
                out.append(tuple("tp" if d == tp else data for d in range(2)))
        return out

    def _splits(self, roles: Roles) -> bool:
        """Whether the batch splits evenly over the roles' data-parallel dim (a candidate that
        would need uneven batches is left out)."""
        data = [d for d, r in enumerate(roles) if r != "tp"]
        n = self.abstract.shape[data[0]] if data else 1
        rows = [x.shape[0] for x in self.example_inputs if isinstance(x, torch.Tensor) and x.ndim > 0]
        return all(r % n == 0 for r in rows)

    def _candidate(self, module: nn.Module, roles: Roles) -> Candidate:
        bad = [r for r in roles if r not in ROLES]
        if bad or len(roles) != self.abstract.ndim or roles.count("tp") > 1 or ("auto" in roles and roles != ("auto",)):
            raise ValueError(f"roles {roles} must give each of the {self.abstract.ndim} mesh dims one of {ROLES}, at most "
                             f"one 'tp' ('auto', the layout solver's plan, on 1-D meshes only)")
        if "auto" in roles and self.layouts is None:
            raise ValueError("roles ('auto',) is the layout solver's plan: call build_plan first")
        blocks = repeated(module)
        if blocks is None or len(blocks[1]) <= 2:
            cost = self._measure(module, roles, None)
        else:
            one, two = self._measure(module, roles, 1), self._measure(module, roles, 2)
            cost = two.scaled(one, len(blocks[1]))
        fits = self.memory_budget is None or cost.peak_bytes <= self.memory_budget
        return Candidate(roles, cost, fits)

    def _measure(self, module: nn.Module, roles: Roles, keep: Optional[int]) -> StepCost:
        model = meta_copy(module, keep)
        plan = self.tp_planner.build_plan(model) if "tp" in roles else ShardingPlan(plan={})
        if roles == ("auto",):
            assert self.layouts is not None
            plan = self.layouts.plan
        _shard(model, self.abstract, self.names, roles, plan)
        opt = self.optimizer(model.parameters())
        steady(model, opt)
        if roles == ("auto",):
            assert self.layouts is not None
            inputs = tuple(x if lay is None or lay.placements[0] == Replicate() else _share(x, self.abstract.shape[0])
                           for x, lay in zip(self.example_inputs, self.layouts.inputs))
        else:
            data = [d for d, r in enumerate(roles) if r not in ("tp", "auto")]
            split = self.abstract.shape[data[0]] if data else 1
            inputs = tuple(_share(x, split) for x in self.example_inputs)
        loss_fn = self.loss_fn

        def step(model: nn.Module, opt: torch.optim.Optimizer, *inputs: Any) -> None:
            opt.zero_grad()
            loss_fn(model(*inputs)).backward()  # type: ignore[no-untyped-call]
            opt.step()

        report = dry_run(step, model, opt, *inputs, mesh=self.abstract)
        return self.cost.step(report.ranks[0])


def _shard(module: nn.Module, mesh: Any, names: tuple[str, ...], roles: Roles, plan: ShardingPlan) -> nn.Module:
    if roles == ("auto",):
        return shard_module(module, plan, mesh)
    if "tp" in roles:
        shard_module(module, plan, mesh[names[roles.index("tp")]] if len(roles) > 1 else mesh)
    data = [d for d, r in enumerate(roles) if r != "tp"]
    if data:
        data_parallel(module, mesh, dp_dim=names[data[0]], shard_parameters=roles[data[0]] == "zero")
    return module


def _state_factor(optimizer: Any) -> float:
    """Optimizer state per parameter element, in parameters: two moments for the Adam family,
    one momentum buffer otherwise."""
    return 2.0 if "adam" in getattr(optimizer, "__name__", "").lower() else 1.0


def _share(x: Any, parts: int) -> Any:
    """One data-parallel rank's share of a global batch tensor (its first rows)."""
    if not isinstance(x, torch.Tensor) or parts == 1 or x.ndim == 0:
        return x
    if x.shape[0] % parts:
        raise ValueError(f"a batch of {x.shape[0]} rows does not split evenly over {parts} data-parallel ranks: give "
                         f"example_inputs a batch dim divisible by {parts}")
    return x[: x.shape[0] // parts]
