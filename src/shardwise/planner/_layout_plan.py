"""From a model to the solver's plan: trace a step, cluster repeated blocks, solve, and write
the chosen layouts as a `ShardingPlan`.

A model whose largest list of identical blocks has L > 2 of them is traced with two: the
second block's nodes are bound to the first's (the same op at the same place, forward and
backward), every node and edge inside a block stands for L / 2 of its kind, an edge between
the two blocks for the L - 1 between neighbours, and an edge from outside to one block for
as many blocks as it reaches. So the program has the size of a 2-block model whatever L is.

The plan names a layout for every parameter (blocks' parameters by pattern, `blocks.*.fc.weight`)
and lays out the model's tensor inputs with a `PrepareModuleInput` on the root: an input
split along dim 0 is each rank's share of the batch, as in data parallel. Activations take
the layouts the runtime's propagation picks from there; `AutoPlanner` measures the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._layout import Layout
from .._mesh import AbstractMesh
from .._placement import Placement, Replicate
from ..parallel import PrepareModuleInput, ShardingPlan
from ._choices import Problem, enumerate_choices
from ._cost import CostModel
from ._model import meta_copy, repeated
from ._solve import Solution, solve
from ._trace import Graph, trace_step

__all__ = ["LayoutPlan", "plan_layouts"]


@dataclass(frozen=True)
class LayoutPlan:
    """The solver's plan: layouts per parameter name (patterns for repeated blocks) and per
    model input, the plan, the modelled step, and the size of the program."""

    plan: ShardingPlan
    parameters: dict[str, Layout]
    inputs: tuple[Optional[Layout], ...]
    solution: Solution
    nodes: int
    choices: int
    seconds: float  # planning: trace, choices and solve

    def describe(self) -> str:
        rows = [f"layout solver: {self.nodes} ops, {self.choices} choices, {self.solution.variables} variables, "
                f"{self.solution.constraints} constraints, solved in {self.solution.solve_seconds:.2f} s "
                f"({'optimal' if self.solution.optimal else 'time limit: best found'}), modelled step "
                f"{self.solution.seconds:.4g} s, {self.solution.memory / 2**20:.1f} MiB per rank"]
        rows += [f"  input {k}: {lay}" for k, lay in enumerate(self.inputs) if lay is not None]
        rows += [f"  {name}: {lay}" for name, lay in self.parameters.items()]
        return "\n".join(rows)


def _copies(graph: Graph, prefix: str) -> tuple[dict[int, int], dict[int, int]]:
    """(node -> the block copy it belongs to, node -> its twin in the other copy, both ways: the
    same op at the same place with the same shapes). The first block may lack ops the others
    have (the gradient of a model input nobody asks for): those stay without a twin."""
    copy_of: dict[int, int] = {}
    keys: list[dict[tuple[Any, ...], int]] = [{}, {}]
    counts: list[dict[tuple[Any, ...], int]] = [{}, {}]
    for node in graph.nodes:
        for b in (0, 1):
            head = f"{prefix}.{b}"
            where = node.name if node.kind == "param" else node.path
            if where == head or where.startswith(head + "."):
                copy_of[node.index] = b
                shapes = tuple(tuple(m.shape) for m in node.outs if m is not None)
                reads = tuple(tuple(graph.meta(r).shape) for r in node.refs()) if node.kind == "op" else ()
                rel = (node.kind, node.backward, str(node.op), where[len(head):], shapes, reads)
                ordinal = counts[b].get(rel, 0)
                counts[b][rel] = ordinal + 1
                keys[b][rel + (ordinal,)] = node.index
    twins = {keys[1][k]: keys[0][k] for k in keys[0].keys() & keys[1].keys()}
    return copy_of, {**twins, **{b: a for a, b in twins.items()}}


def plan_layouts(module: nn.Module, mesh: AbstractMesh, example_inputs: Sequence[Any],
                 loss_fn: Callable[[Any], torch.Tensor], cost: CostModel, *, memory_budget: Optional[float] = None,
                 state_factor: float = 2.0, time_limit: float = 10.0) -> LayoutPlan:
    """Solve the layouts of one training step of `module` on `example_inputs` (the global batch)
    over `mesh` (see the module docstring)."""
    start = time.perf_counter()
    blocks = repeated(module)
    layers = len(blocks[1]) if blocks is not None else 0
    keep = 2 if layers > 2 else None
    model = meta_copy(module, keep)
    inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    graph = trace_step(model, inputs, loss_fn)
    copy_of: dict[int, int] = {}
    twins: dict[int, int] = {}
    if keep is not None and blocks is not None:  # (copy_of stays empty otherwise: every weight 1)
        copy_of, twins = _copies(graph, blocks[0])
    problem = enumerate_choices(graph, mesh, cost, twins)
    group = [min(n, twins.get(n, n)) for n in range(len(graph.nodes))]
    half = layers / 2

    def times(n: int) -> float:
        """How many of node n the whole model has: a bound pair stands for every block; a node
        of the second copy alone for every block but the first."""
        if n not in copy_of:
            return 1.0
        if n in twins:
            return half
        return layers - 1.0 if copy_of[n] == 1 else 1.0

    node_weight = [times(n) for n in range(len(graph.nodes))]
    reach: dict[tuple[int, int], set[int]] = {}  # (outside node, twin group) -> copies it reaches
    for c in range(len(graph.nodes)):
        for ref in problem.reads[c]:
            for a, b in ((ref.node, c), (c, ref.node)):
                if a not in copy_of and b in copy_of:
                    reach.setdefault((a, group[b]), set()).add(copy_of[b])

    def edge_weight(p: int, c: int) -> float:
        if p not in copy_of and c not in copy_of:
            return 1.0
        if p in copy_of and c in copy_of:
            if copy_of[p] != copy_of[c]:
                return layers - 1.0
            return half if p in twins and c in twins else times(p if p not in twins else c)
        outside, inside = (p, c) if c in copy_of else (c, p)
        if inside not in twins:
            return times(inside)
        return half if len(reach.get((outside, group[inside]), ())) == 2 else 1.0

    solution = solve(problem, group=group, node_weight=node_weight, edge_weight=edge_weight,
                     memory_budget=memory_budget, state_factor=state_factor, time_limit=time_limit)
    return _as_plan(problem, solution, blocks[0] if twins and blocks is not None else None, copy_of, inputs,
                    time.perf_counter() - start)


def _as_plan(problem: Problem, solution: Solution, prefix: Optional[str], copy_of: dict[int, int],
             inputs: Sequence[Any], seconds: float) -> LayoutPlan:
    graph = problem.graph
    parameters: dict[str, Layout] = {}
    for name, n in graph.params.items():
        if copy_of.get(n) == 1:
            continue
        lay = problem.choices[n][solution.chosen[n]].outs[0]
        if prefix is not None and copy_of.get(n) == 0:
            name = f"{prefix}.*" + name[len(prefix) + 2:]
        parameters[name] = lay
    layouts: list[Optional[Layout]] = []
    it = iter(graph.inputs)
    for x in inputs:
        if isinstance(x, torch.Tensor):
            n = next(it)
            layouts.append(problem.choices[n][solution.chosen[n]].outs[0])
        else:
            layouts.append(None)
    entries: dict[str, Any] = {name: lay.placements for name, lay in parameters.items()}
    if any(lay is not None for lay in layouts):
        ins = tuple(None if lay is None else _single(lay) for lay in layouts)
        entries[""] = PrepareModuleInput(input_layouts=ins, desired_input_layouts=ins)
    plan = ShardingPlan(plan=entries)
    n_choices = sum(len(c) for c in problem.choices)
    return LayoutPlan(plan, parameters, tuple(layouts), solution, len(graph.nodes), n_choices, seconds)


def _single(layout: Layout) -> Placement:
    """A 1-D mesh's placement (PrepareModuleInput takes one per input)."""
    if len(layout.placements) != 1:
        raise ValueError(f"input layouts are planned on 1-D meshes, got {layout}")
    p = layout.placements[0]
    return p if p is not None else Replicate()
