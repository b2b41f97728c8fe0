"""`AutoPlanner`: the cheapest way to shard a training step on a mesh, found by dry runs.

Each candidate gives every mesh dim a role: data parallel ("dp"), data parallel with
parameters, gradients and optimizer state sharded ZeRO-3 style ("zero"), tensor parallel
("tp": the Megatron cuts of `MegatronPlanner`, or the `tp_planner` given), or, for a model
with experts modules (a mixture of experts), expert parallel ("ep": whole experts spread
over the dim by `ExpertParallel(tokens="split")`, each rank's routes sent to their experts'
owners by all_to_all, the dense parameters data parallel over it, the batch split as for
"dp"). A candidate is
measured, not guessed: the model is copied onto the meta device, sharded for it on an
`AbstractMesh` of the real shape, and one training step (forward, loss, backward, optimizer
step; the optimizer's state made beforehand, as in every step but the first) dry-runs as
rank 0, every op through its real strategy. `CostModel.step` turns the
rank's FLOPs, collectives and peak memory into modelled seconds; the fastest candidate
within `memory_budget` wins.

The step's loss matters: a plan whose output is pending a sum over ranks (`Partial`, a
row-parallel last layer) costs nothing more under a linear loss such as the output's mean,
since the mean of a pending sum is a pending sum of means. Real losses (cross-entropy,
squared error) need every element of the output, so the default loss is the output's
squared error against a zero target, `output.square().mean()`: a `Partial` output is
reduced before it, as it would be for training, while a split (`Shard`) output stays split.

Repeated layers are clustered: a model whose largest list of identical blocks has L of them
dry-runs with 1 block and with 2, and each cost grows by their difference L - 2 more times,
so a 32-layer model plans about as fast as a 2-layer one.

An "ep" candidate's dry run routes uniformly (every expert the same share of the routes,
`dry_run`'s default): its all_to_all bytes are those of a balanced router, its memory the
experts divided over the dim. It is offered on 1-D meshes.

For an `nn.Sequential` with a layer for every stage, a mesh dim may be a pipeline ("pp": its
ranks hold consecutive stages, `DistributedPipe`): ("pp",) on a 1-D mesh, pp on either dim of
a 2-D mesh with "dp" or "zero" on the other (pp beside "tp" is not planned). Its cost is not a
dry run but `plan_pipeline`'s model on the pipeline's share of the batch (stage boundaries
balanced by modelled time and memory, micro-batches, schedule), plus the data dim's gradient
reduction and the activations crossing stages (`_auto_pipeline`); the report shows its stages.

On a 1-D mesh one more candidate, "auto", is the layout solver's plan (`_layout_plan`: a
layout per parameter and input chosen from every op's strategies by an integer program),
measured by the same dry run; `planner.layouts` holds it.

The plan is an ordinary `ShardingPlan` (the tp styles, empty when no dim is tp; the solver's
layouts for "auto"); the roles are in `planner.report`; `planner.apply(model, mesh)` does
both on a real mesh (for "pp", it builds the planned `DistributedPipe`), and
`planner.local_inputs(batch, mesh)` gives each rank its share. `planner.compare(model, {...})`
measures candidates of one's own the same way: roles, or `ShardingPlan`s (another planner's,
a hand-written one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Placement, Replicate, Shard
from ..debug import dry_run
from ..parallel import (ExpertParallel, MegatronPlanner, PrepareModuleInput, ShardingPlan, ShardingPlanner,
                        data_parallel, parallelize_module, shard_module)
from ._auto_pipeline import build_pipe, check_pipeline, measure_pipeline, pipeline_roles
from ._cost import CostModel, StepCost
from ._layout_plan import LayoutPlan, plan_layouts
from ._model import cut_plan, default_loss, experts_modules, meta_copy, repeated, steady
from ._report import AutoPlanReport, Candidate, Comparison
from ._solve import MemoryBudgetError

__all__ = ["AutoPlanner", "CandidateLike"]

Roles = tuple[str, ...]
ROLES = ("dp", "zero", "tp", "ep", "auto", "pp")
DATA = ("dp", "zero", "ep")  # the roles that split the batch
PLANNED = ("tp", "auto")  # the roles whose mesh dim a ShardingPlan shards
# what `compare` measures: roles, a plan (1-D meshes), or a plan and the roles saying where it goes
CandidateLike = Union[Sequence[str], ShardingPlan, tuple[ShardingPlan, Sequence[str]]]


class AutoPlanner(ShardingPlanner):
    """Chooses a role for every mesh dim of `mesh` (data parallel, ZeRO-3, tensor parallel,
    expert parallel, pipeline) by the modelled time of one training step on `example_inputs`
    (the global batch: data-parallel and expert-parallel dims split its dim 0), under `memory_budget` bytes
    per rank (see the module docstring). The dry runs run a mixture of experts' experts
    modules on meta tensors: transformers' eager expert loop reads the routes on the host,
    which they cannot; plan such a model with `experts_implementation="batched_mm"` (or
    "grouped_mm" in bfloat16).

    `loss_fn(output)` makes the loss. The default is `output.loss` when the model returns one,
    else the squared error of the output (its `.logits`, or its first element) against a zero
    target, `output.float().square().mean()`: a loss that needs the whole output, as training
    losses do. (A linear loss such as the output's mean would make a row-parallel output's
    pending reduction look free, and tensor parallel win where data parallel is what training
    needs.) Pass the real loss when it is at hand. `optimizer` is the optimizer class whose
    state counts in memory."""

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
        experts = self.abstract.ndim == 1 and bool(experts_modules(module, self.abstract.shape[0]))
        piped = pipeline_roles(module, self.abstract.shape)
        options = [r for r in self._options(bool(tp_plan.plan), experts, bool(piped)) + piped
                   if self._splits(r) and self._valid(module, tp_plan, r)]
        self.layouts = None
        if self.abstract.ndim == 1 and not experts:  # (the solver knows no token dispatch: "ep" stands for it)
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

    def compare(self, module: nn.Module, candidates: Mapping[str, CandidateLike]) -> Comparison:
        """The modelled step of each named candidate, measured as `build_plan` measures its own
        (the same dry run, loss and clustering of repeated blocks), so a candidate's numbers
        are the report's for the same roles. A candidate is
        - roles, one per mesh dim: `("tp",)`, `("dp", "tp")`, `("auto",)` (after `build_plan`);
        - a `ShardingPlan` (1-D meshes): applied with `shard_module` over the mesh, e.g.
          `MegatronPlanner().build_plan(model)` or another planner's `report.plan`; a model
          input its root `PrepareModuleInput` lays out as `Shard(0)` is split by rows (each
          rank its share, as `local_inputs` gives it), the others stay whole;
        - `(plan, roles)`: the plan over the mesh dim whose role is "tp", data parallel ("dp")
          or ZeRO-3 ("zero") over the other: how a plan is placed on a 2-D mesh.

        A pipeline is roles too: `("pp",)`, `("pp", "dp")`, `("zero", "pp")` (pp beside "tp"
        is not planned); its `PipelinePlan` is the report's for the same roles.

        The answer maps each name to its `StepCost`; printed, it is a table like the report's:

            planner.compare(model, {"megatron": MegatronPlanner().build_plan(model), "data parallel": ("dp",)})
        """
        if not isinstance(candidates, Mapping):
            raise TypeError(f"compare takes a dict of named candidates, got {type(candidates).__name__}: e.g. "
                            "{'megatron': MegatronPlanner().build_plan(model), 'data parallel': ('dp',)}")
        costs = {}
        for name, given in candidates.items():
            roles, plan = self._form(name, given)
            costs[name] = self._candidate(module, roles, plan).cost
        return Comparison(self.mesh.shape, self.names, costs, self.memory_budget)

    def apply(self, module: nn.Module, mesh: DeviceMesh, **pipe_kwargs: Any) -> nn.Module:
        """Shard `module` on the real `mesh` (the planned shape) as the report chose: the plan
        over the tp dim, then data parallel (ZeRO-3 for "zero") over the other. A pp choice is
        `DistributedPipe(module, balance, mesh, pp_dim=, dp_dim=, shard_parameters=, schedule=,
        chunks=, **pipe_kwargs)` as planned (`loss_fn=`, `checkpoint=`, ... in `pipe_kwargs`);
        each rank passes `pipe.step` its `local_inputs`."""
        if self.report is None:
            self.build_plan(module)
        assert self.report is not None
        if tuple(mesh.shape) != tuple(self.mesh.shape):
            raise ValueError(f"the plan is for a mesh of shape {self.mesh.shape}, got {mesh.shape}")
        chosen = self.report.chosen
        if chosen.pipeline is not None:
            check_pipeline(module, chosen.roles, self.abstract.shape, self.names)
            assert isinstance(module, nn.Sequential)
            return build_pipe(module, mesh, tuple(mesh.mesh_dim_names or self.names), chosen.roles, chosen.pipeline,
                              **pipe_kwargs)
        if pipe_kwargs:
            raise TypeError(f"apply({', '.join(f'{k}=' for k in pipe_kwargs)}): keywords go to the DistributedPipe "
                            f"of a pp choice, and the plan chose {chosen.roles}")
        return _shard(module, mesh, self.names, chosen.roles, self.report.plan)

    def local_inputs(self, inputs: Sequence[Any], mesh: DeviceMesh) -> tuple[Any, ...]:
        """This rank's share of the global batch `inputs` under the chosen plan: the rows of
        its data-parallel coordinate for a data-parallel dim (a pipeline's: pass the targets
        too, `local_inputs((x, y), mesh)`) or an input the solver splits (`Shard(0)`), the
        whole input otherwise."""
        if self.report is None:
            raise ValueError("local_inputs follows the chosen plan: call build_plan first")
        dims = _row_dims(self.report.chosen.roles, self.report.plan, inputs)
        return tuple(x if d is None else x.chunk(mesh.size(d))[mesh.get_local_rank(d)] for x, d in zip(inputs, dims))

    def _options(self, can_tp: bool, experts: bool, can_pp: bool) -> list[Roles]:
        """The candidates without a pipeline (`pipeline_roles` gives those)."""
        if self.abstract.ndim == 1:
            one: list[Roles] = [("dp",), ("zero",)]
            return one + ([("tp",)] if can_tp else []) + ([("ep",)] if experts else [])
        if not can_tp and can_pp:
            return []
        if not can_tp:
            raise ValueError(f"a 2-D mesh needs a tensor-parallel or pipeline dim, but "
                             f"{type(self.tp_planner).__name__} found no layer to cut and the model is no "
                             "nn.Sequential with a layer per pp rank: plan a 1-D mesh, pass tp_planner=, or give the "
                             "layers as an nn.Sequential")
        out: list[Roles] = []
        for tp in range(2):
            for data in ("dp", "zero"):
                out.append(tuple("tp" if d == tp else data for d in range(2)))
        return out

    def _valid(self, module: nn.Module, tp_plan: ShardingPlan, roles: Roles) -> bool:
        """Whether the tp planner's plan is valid on the tp dim of `roles` (one that would leave a
        rank an empty piece, a 3-way head over 4 ranks, is no candidate: it could not be applied)."""
        if "tp" not in roles:
            return True
        try:
            tp_plan.validate(module, AbstractMesh((self.abstract.shape[roles.index("tp")],), ("tp",)))
        except ValueError:
            return False
        return True

    def _splits(self, roles: Roles) -> bool:
        """Whether the batch splits evenly over the roles' data-parallel dim (a candidate that
        would need uneven batches is left out)."""
        data = [d for d, r in enumerate(roles) if r in DATA]
        n = self.abstract.shape[data[0]] if data else 1
        rows = [x.shape[0] for x in self.example_inputs if isinstance(x, torch.Tensor) and x.ndim > 0]
        return all(r % n == 0 for r in rows)

    def _form(self, name: str, given: Any) -> tuple[Roles, Optional[ShardingPlan]]:
        """(roles, plan) of a `compare` candidate; the plan is None where the roles make it."""
        n, shape, names = self.abstract.ndim, self.mesh.shape, self.names
        tp = names.index("tp") if "tp" in names else n - 1
        example = tuple("tp" if d == tp else "dp" for d in range(n))
        if isinstance(given, ShardingPlan):
            if n == 1:
                return ("tp",), given
            raise ValueError(f"compare[{name!r}] is a ShardingPlan, which shards over one mesh dim, and mesh {shape} "
                             f"{names} has {n}: say which and what the other does with roles, e.g. (plan, {example}) "
                             f"puts the plan on {names[tp]!r} and data parallel on the other")
        if isinstance(given, (tuple, list)) and len(given) == 2 and isinstance(given[0], ShardingPlan):
            plan, roles = given[0], given[1]
            if (isinstance(roles, str) or not isinstance(roles, (tuple, list)) or len(roles) != n
                    or list(roles).count("tp") != 1 or any(r not in ("tp", "dp", "zero") for r in roles)):
                raise ValueError(f"compare[{name!r}] = (plan, {roles!r}): give one role per mesh dim of {names}, "
                                 f"'tp' where the plan goes and 'dp' or 'zero' elsewhere, e.g. (plan, {example})")
            return tuple(roles), plan
        if isinstance(given, str) or not isinstance(given, (tuple, list)) or not all(isinstance(r, str) for r in given):
            raise TypeError(f"compare[{name!r}] = {given!r}: a candidate is roles (one per mesh dim, e.g. {example}), "
                            f"a ShardingPlan, or (plan, roles)")
        return tuple(given), None

    def _candidate(self, module: nn.Module, roles: Roles, plan: Optional[ShardingPlan] = None) -> Candidate:
        """`roles` measured, with `plan` on the "tp" dim when given (else the roles' own plan)."""
        bad = [r for r in roles if r not in ROLES]
        if bad or len(roles) != self.abstract.ndim or roles.count("tp") > 1 or any(
                r in roles and roles != (r,) for r in ("auto", "ep")):
            raise ValueError(f"roles {roles} must give each of the {self.abstract.ndim} mesh dims one of {ROLES}, at "
                             f"most one 'tp' ('auto', the layout solver's plan, and 'ep', expert parallel, on 1-D "
                             f"meshes only)")
        if "auto" in roles and self.layouts is None:
            raise ValueError("roles ('auto',) is the layout solver's plan: call build_plan first")
        if "ep" in roles and not experts_modules(module, self.abstract.shape[0]):
            raise ValueError(f"roles ('ep',) spread experts modules over the mesh, and {type(module).__name__} has no "
                             f"experts module that ExpertParallel(tokens=\"split\") takes on {self.abstract.shape[0]} "
                             f"ranks (stacked experts called as experts(hidden_states, top_k_index, top_k_weights), "
                             f"at least one per rank): use 'dp' or 'zero'")
        if "pp" in roles:
            check_pipeline(module, roles, self.abstract.shape, self.names)
            assert isinstance(module, nn.Sequential)
            data = [d for d, r in enumerate(roles) if r in DATA]
            share = tuple(_share(x, self.abstract.shape[data[0]]) if data else x for x in self.example_inputs)
            cost, pipeline = measure_pipeline(module, roles, self.abstract.shape, self.names, share, self.cost,
                                              self.memory_budget, _state_factor(self.optimizer))
            return Candidate(roles, cost, self.memory_budget is None or cost.peak_bytes <= self.memory_budget,
                             pipeline)
        blocks = repeated(module)
        if blocks is None or len(blocks[1]) <= 2:
            cost = self._measure(module, roles, None, plan)
        else:
            prefix, layers = blocks[0], len(blocks[1])
            cuts = [None if plan is None else cut_plan(plan, prefix, layers, keep) for keep in (1, 2)]
            if plan is not None and None in cuts:  # the plan treats blocks differently: the whole model runs
                cost = self._measure(module, roles, None, plan)
            else:
                one, two = self._measure(module, roles, 1, cuts[0]), self._measure(module, roles, 2, cuts[1])
                cost = two.scaled(one, layers)
        fits = self.memory_budget is None or cost.peak_bytes <= self.memory_budget
        return Candidate(roles, cost, fits)

    def _measure(self, module: nn.Module, roles: Roles, keep: Optional[int],
                 plan: Optional[ShardingPlan] = None) -> StepCost:
        """One dry-run step of `module` (its first `keep` repeated blocks) under `roles`, with
        `plan` (made for that model) or the roles' own plan."""
        model = meta_copy(module, keep)
        if plan is None:
            plan = self._role_plan(model, roles)
        model = _shard(model, self.abstract, self.names, roles, plan)
        opt = self.optimizer(model.parameters())
        steady(model, opt)
        dims = _row_dims(roles, plan, self.example_inputs)
        inputs = tuple(x if d is None else _share(x, self.abstract.shape[d]) for x, d in zip(self.example_inputs, dims))
        loss_fn = self.loss_fn

        def step(model: nn.Module, opt: torch.optim.Optimizer, *inputs: Any) -> None:
            opt.zero_grad()
            loss_fn(model(*inputs)).backward()  # type: ignore[no-untyped-call]
            opt.step()

        report = dry_run(step, model, opt, *inputs, mesh=self.abstract)
        return self.cost.step(report.ranks[0])

    def _role_plan(self, model: nn.Module, roles: Roles) -> ShardingPlan:
        if roles == ("auto",):
            assert self.layouts is not None
            return self.layouts.plan
        return self.tp_planner.build_plan(model) if "tp" in roles else ShardingPlan(plan={})


def _shard(module: nn.Module, mesh: Any, names: tuple[str, ...], roles: Roles, plan: ShardingPlan) -> nn.Module:
    """`plan` over the "tp" (or "auto") dim, or the experts over the "ep" dim, then data
    parallel (ZeRO-3 for "zero") over the other (for "ep", the same)."""
    planned = [d for d, r in enumerate(roles) if r in PLANNED]
    if planned:
        module = shard_module(module, plan, mesh[names[planned[0]]] if len(roles) > 1 else mesh)
    if "ep" in roles:  # whole experts over the dim, each rank's routes sent to their owners
        ep = mesh[names[roles.index("ep")]] if len(roles) > 1 else mesh
        style = ExpertParallel(tokens="split")
        parallelize_module(module, ep, {path: style for path in experts_modules(module, ep.size())})
    data = [d for d, r in enumerate(roles) if r in DATA]
    if data:
        data_parallel(module, mesh, dp_dim=names[data[0]], shard_parameters=roles[data[0]] == "zero")
    return module


def _row_dims(roles: Roles, plan: ShardingPlan, inputs: Sequence[Any]) -> tuple[Optional[int], ...]:
    """For each model input, the mesh dim over whose ranks its rows are split (None: every rank
    takes it whole): the data-parallel dim, or on a 1-D mesh the plan's own where its root
    `PrepareModuleInput` lays the input out as `Shard(0)` (the layout solver's data parallel)."""
    data = [d for d, r in enumerate(roles) if r in DATA]
    planned = [d for d, r in enumerate(roles) if r in PLANNED]
    root = plan.plan.get("")
    laid: tuple[Optional[Placement], ...] = ()
    if isinstance(root, PrepareModuleInput) and isinstance(root.input_layouts, tuple):
        laid = root.input_layouts
    out: list[Optional[int]] = []
    for k, x in enumerate(inputs):
        p = laid[k] if k < len(laid) else None
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            out.append(None)
        elif p is None or p == Replicate():
            out.append(data[0] if data else None)
        elif p == Shard(0) and not data and planned:
            out.append(planned[0])
        else:
            beside = " beside data parallel" if data else ""
            raise ValueError(f"the plan's root PrepareModuleInput lays input {k} out as {p}{beside}: "
                             f"the planner splits a model input by rows (Shard(0)) on a 1-D mesh only, and keeps it "
                             f"whole (Replicate()) otherwise; lay out that input inside the model instead")
    return tuple(out)


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
