"""The choices of the layout solver: for every node of a traced step, the strategies it may
run with, each with its compute seconds and memory, and the cost of every edge between a
producer's choice and a consumer's.

An op's choices are its registered strategy function's candidates (the same function the
dispatcher asks at run time), asked once with every input replicated and once more for each
layout an input's producer may give it (the other inputs replicated), since a strategy such as
a pointwise op's offers the layouts its inputs already have. A parameter or an input may take
any layout that shards one tensor dim per mesh dim, or none; a constant, a value made from
constants only, and an op without a strategy (or one run replicated by design) have the one
replicated choice, as at run time.

Compute is FLOPs (torch's formulas, on the global shapes) divided over the ranks the choice
splits the work between (the most split tensor of the op, since an op splits no finer than
its most split operand) at `flops_per_second`, plus the bytes its outputs write per rank at
`memory_bandwidth`. An edge costs what the redistribute planner says the move costs (bytes
received per rank, `plan_between`) at the mesh dims' bandwidth, plus one latency when
anything moves; a move within each rank (a replicated value chunked) copies its piece at
`memory_bandwidth`; a move that would invent a Partial is forbidden.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._layout import Layout
from .._mesh import AbstractMesh
from .._placement import Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from .._ops import OpKind, OpSchema, OpStrategy, PlacementStrategy, ScalarTensor, TupleStrategy, redistribute_cost, rule_for
from ..debug._memory import _FLOPS
from ._cost import CostModel
from ._trace import Graph, Node, Ref

__all__ = ["VIEWS", "Choice", "Problem", "enumerate_choices"]


@dataclass(frozen=True)
class Choice:
    """One way to run a node: its outputs' layouts, the layout each DTensor input must have
    (None: as it comes), the inputs that may turn Replicate into the Partial asked for."""

    outs: tuple[Layout, ...]
    ins: tuple[Optional[Layout], ...]
    partialize: tuple[int, ...] = ()


@dataclass
class Problem:
    """Every node's choices and their compute seconds, the inputs each node reads as
    DTensors, and the mesh and cost they are priced on."""

    graph: Graph
    mesh: AbstractMesh
    cost: CostModel
    choices: list[list[Choice]]
    seconds: list[list[float]]
    reads: list[list[Ref]]  # per node: the values read as DTensors, in the strategy's input order

    def edge_seconds(self, value: Ref, have: Layout, need: Optional[Layout], partialize: bool) -> float:
        """Seconds to move `value` from `have` to `need` (inf: not allowed)."""
        if need is None or (have.placements == need.placements and have.shard_order == need.shard_order):
            return 0.0
        key = (value, have, need, partialize)
        hit = self._moves.get(key)
        if hit is None:
            spec = DTensorSpec(self.mesh, have.placements, self.graph.meta(value), have.shard_order)
            nbytes = redistribute_cost(spec, need, partialize)
            dims = [self.names[d] for d, (a, b) in enumerate(zip(have.placements, need.placements)) if a != b]
            if nbytes == 0:  # a local move (a replicated value chunked, ...): a copy of the piece
                hit = self.local_bytes(self.graph.meta(value), need) / self.cost.memory_bandwidth + 1e-9
            else:
                hit = nbytes / self.cost.bandwidth_of(dims) + self.cost.latency
            self._moves[key] = hit
        return hit

    def local_bytes(self, meta: TensorMeta, layout: Layout) -> int:
        return math.ceil(math.prod(meta.shape) * _fraction(layout, self.mesh)) * meta.dtype.itemsize

    def __post_init__(self) -> None:
        self._moves: dict[Any, float] = {}
        self.names: list[Any] = list(self.mesh.mesh_dim_names or range(self.mesh.ndim))


def _fraction(layout: Optional[Layout], mesh: AbstractMesh) -> float:
    if layout is None:
        return 1.0
    f = 1.0
    for d, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            f /= mesh.shape[d]
    return f


def _source_layouts(meta: TensorMeta, mesh: AbstractMesh, even: bool) -> list[Layout]:
    """Replicated, or one tensor dim split per mesh dim (each tensor dim by at most one mesh
    dim, at least as long as the mesh dim is wide; `even`: only dims that split evenly, as a
    model input's rows must, each rank loading its own share)."""
    per_dim: list[list[Placement]] = []
    for d in range(mesh.ndim):
        n = mesh.shape[d]
        per_dim.append([Replicate()] + [Shard(t) for t, size in enumerate(meta.shape)
                                        if size >= n and not (even and size % n)])
    out = []
    for combo in itertools.product(*per_dim):
        dims = [p.dim for p in combo if isinstance(p, Shard)]
        if len(dims) == len(set(dims)):
            out.append(Layout(tuple(combo)))
    return out


def _replicated(node: Node, reads: Sequence[Ref], mesh: AbstractMesh) -> Choice:
    r = Layout((Replicate(),) * mesh.ndim)
    return Choice(tuple(r for _ in node.outs), tuple(r for _ in reads))


def _is_scalar(graph: Graph, ref: Ref) -> bool:
    """A 0-dim plain tensor: an op reads it as a scalar, not as a DTensor."""
    n = graph.nodes[ref.node]
    meta = n.outs[ref.out]
    return n.plain and meta is not None and len(meta.shape) == 0


def _as_choice(s: PlacementStrategy, n_outs: int, n_ins: int, mesh: AbstractMesh) -> Optional[Choice]:
    outs = s.output_specs if isinstance(s.output_specs, tuple) else (s.output_specs,)
    r = Layout((Replicate(),) * mesh.ndim)
    lays = tuple(o if isinstance(o, Layout) else r for o in outs)
    lays = (lays + (r,) * n_outs)[:n_outs]
    if len(s.input_specs) != n_ins:
        return None
    return Choice(lays, tuple(s.input_specs), tuple(s.partialize))


def _candidates(strategy: Any) -> list[PlacementStrategy]:
    if isinstance(strategy, OpStrategy):
        return list(strategy.strategies)
    if isinstance(strategy, TupleStrategy):  # independent per output: the children side by side
        combined = []
        for parts in zip(*(c.strategies for c in strategy.childs)):
            ins: list[Optional[Layout]] = [None] * len(parts[0].input_specs)
            for p in parts:
                for k, lay in enumerate(p.input_specs):
                    if lay is not None:
                        ins[k] = lay
            combined.append(PlacementStrategy(tuple(p.output_specs for p in parts), tuple(ins)))
        return combined
    return []


def _op_choices(problem: Problem, node: Node, reads: list[Ref]) -> list[Choice]:
    graph, mesh = problem.graph, problem.mesh
    rule = rule_for(node.op)
    if node.plain or rule.strategy is None or rule.kind in (OpKind.REPLICATED, OpKind.FALLBACK, OpKind.DECOMPOSED):
        return [_replicated(node, reads, mesh)]
    r = Layout((Replicate(),) * mesh.ndim)
    seeds: list[dict[Ref, Layout]] = [{}]
    for ref in dict.fromkeys(reads):
        for c in problem.choices[ref.node]:
            lay = c.outs[ref.out]
            if lay != r:
                seeds.append({ref: lay})
    found: dict[tuple[Any, Any], Choice] = {}
    for seed in seeds:
        def spec(a: Any) -> Any:
            if isinstance(a, Ref):
                if _is_scalar(graph, a):
                    meta = graph.meta(a)
                    return ScalarTensor(meta.dtype, "meta")
                lay = seed.get(a, r)
                return DTensorSpec(mesh, lay.placements, graph.meta(a), lay.shard_order)
            if isinstance(a, (list, tuple)):
                return tuple(spec(x) for x in a)
            return a
        schema = OpSchema(node.op, tuple(spec(a) for a in node.args), tuple((k, spec(v)) for k, v in node.kwargs.items()))
        try:
            strategies = _candidates(rule.strategy(schema))
        except Exception:  # a combination the rule does not take: the other seeds still count
            continue
        for s in strategies:
            choice = _as_choice(s, len(node.outs), len(reads), mesh)
            if choice is not None:
                found.setdefault((choice.outs, choice.ins), choice)
    return list(found.values()) or [_replicated(node, reads, mesh)]


def _flops(graph: Graph, node: Node) -> float:
    count = _FLOPS.get(getattr(node.op, "overloadpacket", None))
    if count is None:
        return 0.0

    def shape(a: Any) -> Any:
        if isinstance(a, Ref):
            return tuple(graph.meta(a).shape)
        if isinstance(a, (list, tuple)):
            return type(a)(shape(x) for x in a)
        return a
    outs = tuple(tuple(m.shape) for m in node.outs if m is not None)
    try:
        return float(count(*shape(node.args), **{k: shape(v) for k, v in node.kwargs.items()},
                           out_val=outs[0] if len(outs) == 1 else outs))
    except Exception:  # a formula that does not take this overload's arguments
        return 0.0


def _seconds(problem: Problem, node: Node, reads: list[Ref], c: Choice, flops: float) -> float:
    mesh, cost = problem.mesh, problem.cost
    frac = min([_fraction(lay, mesh) for lay in c.outs] + [_fraction(lay, mesh) for lay in c.ins] or [1.0])
    written = sum(problem.local_bytes(m, lay) for m, lay in zip(node.outs, c.outs) if m is not None)
    if node.kind != "op" or node.op in VIEWS:
        written = 0
    return flops * frac / cost.flops_per_second + written / cost.memory_bandwidth


VIEWS = {torch.ops.aten.view.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
          torch.ops.aten.expand.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default,
          torch.ops.aten.detach.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
          torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.split.Tensor,
          torch.ops.aten.alias.default}


def enumerate_choices(graph: Graph, mesh: AbstractMesh, cost: CostModel, same: Optional[dict[int, int]] = None) -> Problem:
    """Every node's choices and compute seconds. `same` maps a node to the node it must choose
    like (its place in the other copy of a repeated block, both ways): the later of the two
    makes both take the union of their choices."""
    problem = Problem(graph, mesh, cost, [], [], [])
    for node in graph.nodes:
        if node.kind == "op":
            reads = [r for r in node.refs() if not _is_scalar(graph, r)]
            problem.reads.append(reads)
            problem.choices.append(_op_choices(problem, node, reads))
        else:
            problem.reads.append([])
            meta = node.outs[0]
            assert meta is not None
            lays = _source_layouts(meta, mesh, node.kind == "input") if node.kind in ("param", "input") \
                else [Layout((Replicate(),) * mesh.ndim)]
            problem.choices.append([Choice((lay,), ()) for lay in lays])
        twin = (same or {}).get(node.index)
        if twin is not None and twin < node.index:
            merged = {(c.outs, c.ins): c for c in problem.choices[twin]}
            for c in problem.choices[-1]:
                merged.setdefault((c.outs, c.ins), c)
            problem.choices[twin] = problem.choices[-1] = list(merged.values())
    for node in graph.nodes:
        flops = _flops(graph, node) if node.kind == "op" else 0.0
        problem.seconds.append([_seconds(problem, node, problem.reads[node.index], c, flops)
                                for c in problem.choices[node.index]])
    return problem
