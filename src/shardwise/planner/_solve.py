"""The layout solver: one choice per node of a traced step, minimising modelled seconds
under a memory budget, as a mixed-integer program solved by HiGHS (scipy's `milp`).

Variables: x[n, j] = 1 when node n runs its choice j (one per node; nodes bound to a twin in
another copy of a repeated block share the twin's variables; a node with one choice has
none). Each edge from a producer's output to a consumer's input has variables e[j, i] for
the (producer choice, consumer choice) pairs the move allows, tied to both ends by
sum_i e[j, i] = x[p, j] and sum_j e[j, i] = x[c, i], so e is 1 exactly on the chosen pair
(e need not be integral: it is once x is). Minimised: compute seconds of every choice plus the
seconds of every move, each weighted by how many times it happens in the whole model (a
repeated block traced twice stands for all of them). Memory per rank: parameters with their
gradients and optimizer state, plus every forward output the backward reads, at the chosen
layouts, at most the budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._choices import VIEWS, Problem
from ._trace import Ref

__all__ = ["MemoryBudgetError", "Solution", "solve"]


class MemoryBudgetError(ValueError):
    """No choice of layouts fits the memory budget."""


@dataclass(frozen=True)
class Solution:
    chosen: list[int]  # per node: the index of its choice
    seconds: float  # the modelled seconds of the whole step
    memory: float  # the modelled bytes per rank
    optimal: bool
    variables: int
    constraints: int
    solve_seconds: float


def _memory(problem: Problem, state_factor: float) -> list[list[float]]:
    """Bytes per rank each choice keeps: a parameter's piece with its gradient and optimizer
    state, a forward output the backward reads."""
    graph = problem.graph
    saved: set[Ref] = set()
    for node in graph.nodes:
        if node.backward:
            for ref in problem.reads[node.index]:
                while graph.nodes[ref.node].op in VIEWS and problem.reads[ref.node]:
                    ref = problem.reads[ref.node][0]  # a view keeps its base alive, nothing more
                if not graph.nodes[ref.node].backward and graph.nodes[ref.node].kind != "param":
                    saved.add(ref)
    out: list[list[float]] = []
    for node in graph.nodes:
        per = []
        for c in problem.choices[node.index]:
            if node.kind == "param":
                per.append(problem.local_bytes(graph.meta(Ref(node.index)), c.outs[0]) * (2 + state_factor))
            else:
                per.append(float(sum(problem.local_bytes(graph.meta(Ref(node.index, k)), lay)
                                     for k, lay in enumerate(c.outs) if Ref(node.index, k) in saved)))
        out.append(per)
    return out


def solve(problem: Problem, *, group: Sequence[int], node_weight: Sequence[float],
          edge_weight: Callable[[int, int], float], memory_budget: Optional[float] = None,
          state_factor: float = 2.0, time_limit: float = 10.0) -> Solution:
    """The cheapest choice per node (see the module docstring). `group[n]`: the node whose
    variables n uses (itself, or its twin); `edge_weight(p, c)`: how often the edge p -> c
    happens in the whole model."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
    from scipy.sparse import coo_matrix  # type: ignore[import-untyped]

    start = time.perf_counter()
    graph, choices = problem.graph, problem.choices
    col: dict[int, int] = {}  # group -> its first variable
    cost: list[float] = []
    upper: list[float] = []
    for n in range(len(graph.nodes)):
        g = group[n]
        if g == n and len(choices[n]) > 1:
            col[n] = len(cost)
            cost.extend([0.0] * len(choices[n]))
            upper.extend([1.0] * len(choices[n]))
    n_x = len(cost)
    const = 0.0
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: Sequence[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for c_, v in entries:
            rows.append(r)
            cols.append(c_)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    def add(n: int, j: int, seconds: float) -> None:
        nonlocal const
        g = group[n]
        if g in col:
            if math.isinf(seconds):
                upper[col[g] + j] = 0.0
            else:
                cost[col[g] + j] += seconds
        elif math.isinf(seconds):
            node = graph.nodes[n]
            raise ValueError(f"the layout solver found no allowed layout for {node.op or node.name} (op {n} of the "
                             f"traced step, in module {node.path or 'root'!r}): its only choice needs a move no "
                             f"collective makes; report it with the model")
        else:
            const += seconds

    for n, node in enumerate(graph.nodes):
        for j, s in enumerate(problem.seconds[n]):
            add(n, j, node_weight[n] * s)
    memory = _memory(problem, state_factor)
    mem_entries: list[tuple[int, float]] = []
    mem_const = 0.0
    for n in range(len(graph.nodes)):
        g = group[n]
        if g in col:
            mem_entries.extend((col[g] + j, node_weight[n] * b) for j, b in enumerate(memory[n]))
        else:
            mem_const += node_weight[n] * memory[n][0]

    edges = [(ref, c, k) for c in range(len(graph.nodes)) for k, ref in enumerate(problem.reads[c])]
    pairs: dict[Any, float] = {}  # merged edges between two variable groups, same matrix -> weight
    for ref, c, k in edges:
        w = edge_weight(ref.node, c)
        have = [ch.outs[ref.out] for ch in choices[ref.node]]
        needs = [(ch.ins[k], k in ch.partialize) for ch in choices[c]]
        matrix = tuple(tuple(problem.edge_seconds(ref, h, need, part) for need, part in needs) for h in have)
        _edge(group[ref.node], group[c], ref.node, c, matrix, w, col, add, pairs)
    for name, gref in graph.grads.items():  # the gradient reduced into its parameter's layout
        p = graph.params[name]
        have = [ch.outs[gref.out] for ch in choices[gref.node]]
        matrix = tuple(tuple(problem.edge_seconds(gref, h, ch.outs[0], False) for ch in choices[p]) for h in have)
        _edge(group[gref.node], group[p], gref.node, p, matrix, edge_weight(gref.node, p), col, add, pairs)

    for g, first in col.items():
        row([(first + j, 1.0) for j in range(len(choices[g]))], 1.0, 1.0)
    for (a, b, matrix), w in pairs.items():
        index = {}
        for j, line in enumerate(matrix):
            for i, s in enumerate(line):
                if not math.isinf(s):
                    index[j, i] = len(cost)
                    cost.append(w * s)
                    upper.append(1.0)
        for j in range(len(matrix)):
            row([(index[j, i], 1.0) for i in range(len(matrix[0])) if (j, i) in index] + [(col[a] + j, -1.0)], 0.0, 0.0)
        for i in range(len(matrix[0])):
            row([(index[j, i], 1.0) for j in range(len(matrix)) if (j, i) in index] + [(col[b] + i, -1.0)], 0.0, 0.0)
    if memory_budget is not None:
        row(mem_entries, -np.inf, memory_budget - mem_const)
    n_var = len(cost)
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), n_var)).tocsr()
    integral = np.zeros(n_var)
    integral[:n_x] = 1
    result = milp(np.array(cost), integrality=integral, bounds=Bounds(np.zeros(n_var), np.array(upper)),
                  constraints=[LinearConstraint(a, np.array(lo), np.array(hi))],
                  options={"time_limit": time_limit, "disp": False})
    if result.x is None:
        if result.status == 2 and memory_budget is not None:  # infeasible: only the budget can make it so
            raise MemoryBudgetError(f"no layout fits memory_budget={memory_budget:.0f} B per rank (the solver: "
                                    f"{result.message}): raise the budget or use a bigger mesh")
        if result.status == 1:
            raise ValueError(f"the layout solver found no plan within time_limit={time_limit} s ({n_var} variables): "
                             f"give a larger time_limit")
        raise ValueError(f"the layout solver found no plan: {result.message}")
    x = result.x
    chosen = []
    for n in range(len(graph.nodes)):
        g = group[n]
        chosen.append(int(np.argmax(x[col[g]:col[g] + len(choices[g])])) if g in col else 0)
    used = mem_const + sum(v * x[c_] for c_, v in mem_entries)
    return Solution(chosen, float(result.fun) + const, float(used), result.status == 0, n_var, len(lo),
                    time.perf_counter() - start)


def _edge(a: int, b: int, p: int, c: int, matrix: tuple[tuple[float, ...], ...], w: float,
          col: dict[int, int], add: Callable[[int, int, float], None], pairs: dict[Any, float]) -> None:
    if a not in col and b not in col:
        add(p, 0, w * matrix[0][0])
    elif a not in col:
        for i, s in enumerate(matrix[0]):
            add(c, i, w * s)
    elif b not in col:
        for j, line in enumerate(matrix):
            add(p, j, w * line[0])
    elif a == b:
        for j in range(len(matrix)):
            add(p, j, w * matrix[j][j])
    else:
        key = (a, b, matrix)
        pairs[key] = pairs.get(key, 0.0) + w
