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

The program is built one record at a time: a `_Column` per variable (a node's choice, or a
pair of choices across an edge) carrying its cost and bound, a `_Row` per constraint, both
kept by a `_Program` that also holds the seconds no choice changes. Every node's seconds,
every edge's moves and the memory row are charged to it by a short function each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
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
    start = time.perf_counter()
    program = _Program.of(problem, group)
    for n in range(len(problem.graph.nodes)):
        for j, s in enumerate(problem.seconds[n]):
            program.charge(n, j, node_weight[n] * s)
    memory = _memory_row(program, _memory(problem, state_factor), node_weight)
    pairs: dict[_Pair, float] = {}  # merged edges between two variable groups -> weight
    for p, c, matrix in _edges(problem):
        _charge_edge(program, p, c, matrix, edge_weight(p, c), pairs)
    for g, first in program.first.items():  # each node runs exactly one of its choices
        program.add_row([(first + j, 1.0) for j in range(len(problem.choices[g]))], 1.0, 1.0)
    for pair, w in pairs.items():
        program.add_pair(pair, w)
    if memory_budget is not None:
        program.add_row(memory.terms, -np.inf, memory_budget - memory.const)
    x, seconds, optimal = _run(program, memory_budget, time_limit)
    chosen = [program.chosen(n, x) for n in range(len(problem.graph.nodes))]
    used = memory.const + sum(v * x[c] for c, v in memory.terms)
    return Solution(chosen, seconds, float(used), optimal, len(program.columns), len(program.rows),
                    time.perf_counter() - start)


@dataclass
class _Column:
    """One variable: x[n, j] (node n runs its choice j: integral) or e[j, i] (the producer's
    choice j meets the consumer's choice i across an edge: its move's seconds)."""

    cost: float
    integral: bool
    upper: float = 1.0  # 0.0: a choice that needs a move no collective makes


@dataclass(frozen=True)
class _Row:
    """One constraint: low <= sum(value * column for column, value in terms) <= high."""

    terms: tuple[tuple[int, float], ...]
    low: float
    high: float


# (producer's group, consumer's group, seconds of each (producer choice, consumer choice) move)
_Pair = tuple[int, int, tuple[tuple[float, ...], ...]]


@dataclass
class _Program:
    """The MILP as it is built: its columns and rows, and the seconds no choice changes."""

    problem: Problem
    group: Sequence[int]
    first: dict[int, int]  # a group with several choices -> the column of its choice 0
    columns: list[_Column] = field(default_factory=list)
    rows: list[_Row] = field(default_factory=list)
    const: float = 0.0

    @classmethod
    def of(cls, problem: Problem, group: Sequence[int]) -> _Program:
        """The x columns: one per choice of every group that has more than one, in node order."""
        program = cls(problem, group, {})
        for n, choices in enumerate(problem.choices):
            if group[n] == n and len(choices) > 1:
                program.first[n] = len(program.columns)
                program.columns.extend(_Column(0.0, integral=True) for _ in choices)
        return program

    def column_of(self, n: int, j: int) -> Optional[int]:
        """The column of node n's choice j (its group's), None when the group has one choice."""
        first = self.first.get(self.group[n])
        return None if first is None else first + j

    def charge(self, n: int, j: int, seconds: float) -> None:
        """Add `seconds` to node n's choice j; infinite seconds forbid the choice."""
        column = self.column_of(n, j)
        if column is not None:
            if math.isinf(seconds):
                self.columns[column].upper = 0.0
            else:
                self.columns[column].cost += seconds
        elif math.isinf(seconds):
            node = self.problem.graph.nodes[n]
            raise ValueError(f"the layout solver found no allowed layout for {node.op or node.name} (op {n} of the "
                             f"traced step, in module {node.path or 'root'!r}): its only choice needs a move no "
                             f"collective makes; report it with the model")
        else:
            self.const += seconds

    def add_row(self, terms: Sequence[tuple[int, float]], low: float, high: float) -> None:
        self.rows.append(_Row(tuple(terms), low, high))

    def add_pair(self, pair: _Pair, w: float) -> None:
        """An e column per allowed move of an edge between two groups, tied to both ends:
        sum_i e[j, i] = x[a, j] and sum_j e[j, i] = x[b, i]."""
        a, b, matrix = pair
        index: dict[tuple[int, int], int] = {}
        for j, line in enumerate(matrix):
            for i, s in enumerate(line):
                if not math.isinf(s):
                    index[j, i] = len(self.columns)
                    self.columns.append(_Column(w * s, integral=False))
        n_have, n_need = len(matrix), len(matrix[0])
        for j in range(n_have):
            self.add_row([(index[j, i], 1.0) for i in range(n_need) if (j, i) in index] + [(self.first[a] + j, -1.0)],
                         0.0, 0.0)
        for i in range(n_need):
            self.add_row([(index[j, i], 1.0) for j in range(n_have) if (j, i) in index] + [(self.first[b] + i, -1.0)],
                         0.0, 0.0)

    def chosen(self, n: int, x: Any) -> int:
        """Node n's choice in the solution x."""
        first = self.column_of(n, 0)
        if first is None:
            return 0
        return int(np.argmax(x[first:first + len(self.problem.choices[self.group[n]])]))


@dataclass(frozen=True)
class _MemoryRow:
    """Bytes per rank: `const` plus value * x over `terms` (the choices' columns)."""

    terms: tuple[tuple[int, float], ...]
    const: float


def _memory_row(program: _Program, memory: list[list[float]], node_weight: Sequence[float]) -> _MemoryRow:
    terms: list[tuple[int, float]] = []
    const = 0.0
    for n, per in enumerate(memory):
        first = program.column_of(n, 0)
        if first is not None:
            terms.extend((first + j, node_weight[n] * b) for j, b in enumerate(per))
        else:
            const += node_weight[n] * per[0]
    return _MemoryRow(tuple(terms), const)


def _edges(problem: Problem) -> Iterator[tuple[int, int, tuple[tuple[float, ...], ...]]]:
    """Every edge (producer, consumer, seconds of each (producer choice, consumer choice)
    move): each value a node reads, then each gradient reduced into its parameter's layout."""
    choices = problem.choices
    for c, reads in enumerate(problem.reads):
        for k, ref in enumerate(reads):
            have = [ch.outs[ref.out] for ch in choices[ref.node]]
            needs = [(ch.ins[k], k in ch.partialize) for ch in choices[c]]
            yield ref.node, c, tuple(tuple(problem.edge_seconds(ref, h, need, part) for need, part in needs)
                                     for h in have)
    for name, gref in problem.graph.grads.items():
        p = problem.graph.params[name]
        have = [ch.outs[gref.out] for ch in choices[gref.node]]
        yield gref.node, p, tuple(tuple(problem.edge_seconds(gref, h, ch.outs[0], False) for ch in choices[p])
                                  for h in have)


def _charge_edge(program: _Program, p: int, c: int, matrix: tuple[tuple[float, ...], ...], w: float,
                 pairs: dict[_Pair, float]) -> None:
    """The edge p -> c's seconds, weighted by `w`: on the one end with choices (or the
    constant when neither has), on the choice itself when both ends share a group, else
    merged into `pairs` to become e columns."""
    a, b = program.group[p], program.group[c]
    if a not in program.first and b not in program.first:
        program.charge(p, 0, w * matrix[0][0])
    elif a not in program.first:
        for i, s in enumerate(matrix[0]):
            program.charge(c, i, w * s)
    elif b not in program.first:
        for j, line in enumerate(matrix):
            program.charge(p, j, w * line[0])
    elif a == b:
        for j in range(len(matrix)):
            program.charge(p, j, w * matrix[j][j])
    else:
        key = (a, b, matrix)
        pairs[key] = pairs.get(key, 0.0) + w


def _run(program: _Program, memory_budget: Optional[float], time_limit: float) -> tuple[Any, float, bool]:
    """Solve the program with HiGHS: (x, modelled seconds, whether proven optimal)."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
    from scipy.sparse import coo_matrix  # type: ignore[import-untyped]

    columns, rows = program.columns, program.rows
    entries = [(r, c, v) for r, row in enumerate(rows) for c, v in row.terms]
    a = coo_matrix(([v for _, _, v in entries], ([r for r, _, _ in entries], [c for _, c, _ in entries])),
                   shape=(len(rows), len(columns))).tocsr()
    result = milp(np.array([col.cost for col in columns]),
                  integrality=np.array([1.0 if col.integral else 0.0 for col in columns]),
                  bounds=Bounds(np.zeros(len(columns)), np.array([col.upper for col in columns])),
                  constraints=[LinearConstraint(a, np.array([row.low for row in rows]),
                                                np.array([row.high for row in rows]))],
                  options={"time_limit": time_limit, "disp": False})
    if result.x is None:
        if result.status == 2 and memory_budget is not None:  # infeasible: only the budget can make it so
            raise MemoryBudgetError(f"no layout fits memory_budget={memory_budget:.0f} B per rank (the solver: "
                                    f"{result.message}): raise the budget or use a bigger mesh")
        if result.status == 1:
            raise ValueError(f"the layout solver found no plan within time_limit={time_limit} s "
                             f"({len(columns)} variables): give a larger time_limit")
        raise ValueError(f"the layout solver found no plan: {result.message}")
    return result.x, float(result.fun) + program.const, result.status == 0
