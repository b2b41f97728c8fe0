"""Check op strategies in one process: simulate every rank of a mesh, no process groups.

For an op call and input layouts, `check_op` asks the op's strategy function for its
candidates (on an `AbstractMesh`) and, for every candidate, cuts each input into the
pieces the candidate asks for (Partial inputs as genuinely different random terms), runs
the op on every simulated rank's pieces, reassembles each output from the candidate's
output layout and compares it with the op on the full tensors. It also checks what the
propagator would choose. So a wrong strategy fails here in milliseconds, before any
multi-rank test.

    check_op(torch.ops.aten.mm.default, (a, b), layouts=[[(Shard(0),), (Replicate(),)]], mesh_shape=(4,))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._layout import contiguous_strides
from shardwise._ops import Layout, LocalCall, OpSchema, OpStrategy, PlacementStrategy, TupleStrategy, get_op_strategy, propagate, rule_for
from shardwise._spec import DTensorSpec, TensorMeta

from .oracle import local_piece

__all__ = ["SimRank", "check_op", "simulate", "assemble_output", "default_layouts", "coordinates"]


class SimRank:
    """The runtime a local implementation gets (`shardwise._ops.Runtime`), for one simulated
    rank: its coordinate; seeds only from an explicit `generator=` (no ranks to agree with);
    no reductions (the simulator runs one rank at a time)."""

    def __init__(self, coordinate: tuple[int, ...]) -> None:
        self._coordinate = coordinate

    def coordinate(self, mesh: Any) -> Optional[tuple[int, ...]]:
        return self._coordinate

    def seed(self, mesh: Any, generator: Optional[torch.Generator]) -> int:
        if generator is None:
            raise NotImplementedError("a simulated rank draws seeds only from an explicit generator=")
        return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator).item())

    def all_reduce(self, t: torch.Tensor, mesh: Any, mesh_dim: int, op: str) -> torch.Tensor:
        raise NotImplementedError("a simulated rank cannot reduce across ranks: test this on real ranks")


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*[range(n) for n in mesh_shape]))


class _Pause(Exception):
    """A simulated rank reached an all_reduce that has no answer yet."""


class _LockstepRank(SimRank):
    """A `SimRank` whose all_reduces are answered across the simulated ranks (`run_in_lockstep`)."""

    def __init__(self, coordinate: tuple[int, ...], answers: list[torch.Tensor]) -> None:
        super().__init__(coordinate)
        self.answers = answers
        self.calls = 0
        self.asked: Optional[tuple[torch.Tensor, int, str]] = None

    def all_reduce(self, t: torch.Tensor, mesh: Any, mesh_dim: int, op: str) -> torch.Tensor:
        k, self.calls = self.calls, self.calls + 1
        if k < len(self.answers):
            return self.answers[k]
        self.asked = (t, mesh_dim, op)
        raise _Pause


_REDUCE = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0)}


def run_in_lockstep(run: Any, mesh_shape: Sequence[int]) -> dict[tuple[int, ...], Any]:
    """`run(runtime)` on every simulated rank, each all_reduce answered with the reduction over
    the ranks that differ only along its mesh dim: every rank runs up to its next unanswered
    all_reduce, those are reduced, and every rank runs again from the start (local
    implementations are pure), until all run through."""
    answers: dict[tuple[int, ...], list[torch.Tensor]] = {c: [] for c in coordinates(mesh_shape)}
    while True:
        results: dict[tuple[int, ...], Any] = {}
        asked: dict[tuple[int, ...], tuple[torch.Tensor, int, str]] = {}
        for c in coordinates(mesh_shape):
            rank = _LockstepRank(c, answers[c])
            try:
                results[c] = run(rank)
            except _Pause:
                assert rank.asked is not None
                asked[c] = rank.asked
        if not asked:
            return results
        assert len(asked) == len(answers), f"only ranks {sorted(asked)} reached an all_reduce"
        for c, (_, m, op) in asked.items():
            group = [asked[d][0] for d in coordinates(mesh_shape) if all(d[i] == c[i] for i in range(len(c)) if i != m)]
            answers[c].append(_REDUCE[op](torch.stack(group)))


def _terms(full: torch.Tensor, mesh_shape: Sequence[int], layout: Layout, seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """Each rank's local tensor for `layout`: its piece, split into random terms on Partial dims."""
    order = dict(layout.shard_order)
    out = {}
    for c in coordinates(mesh_shape):
        piece = local_piece(full, mesh_shape, layout.placements, c, order).clone()
        for i, p in enumerate(layout.placements):
            if not isinstance(p, Partial):
                continue
            n = mesh_shape[i]
            key = tuple(x for j, x in enumerate(c) if isinstance(layout.placements[j], Shard) or (j < i and isinstance(layout.placements[j], Partial)))
            noise = [torch.randn(piece.shape, generator=torch.Generator().manual_seed(hash((seed, i, k, key)) & 0xFFFFFF)).to(piece.dtype)
                     if piece.is_floating_point() else torch.zeros_like(piece) for k in range(n)]
            mean = torch.stack(noise).mean(0) if piece.is_floating_point() else 0
            if p.reduce_op == "sum":
                piece = piece / n + (noise[c[i]] - mean) if piece.is_floating_point() else (piece if c[i] == 0 else torch.zeros_like(piece))
            elif p.reduce_op == "avg":
                piece = piece + (noise[c[i]] - mean)
            elif p.reduce_op == "max":
                piece = piece if c[i] == 0 else piece - noise[c[i]].abs()
            else:
                piece = piece if c[i] == 0 else piece + noise[c[i]].abs()
        out[c] = piece
    return out


def assemble_output(pieces: dict[tuple[int, ...], torch.Tensor], mesh_shape: Sequence[int], layout: Layout) -> torch.Tensor:
    """The global tensor from every rank's output piece (default split order), checking replicas agree."""
    if layout.shard_order:
        raise NotImplementedError("assemble_output handles default split orders only")
    current = dict(pieces)
    for i in reversed(range(len(mesh_shape))):
        p = layout.placements[i]
        grouped: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for c in sorted(current):
            grouped.setdefault(c[:i], []).append(current[c])
        merged = {}
        for rest, group in grouped.items():
            if isinstance(p, Shard):
                merged[rest] = torch.cat(group, dim=p.dim)
            elif isinstance(p, Replicate):
                for g in group[1:]:
                    assert torch.equal(g, group[0]) or torch.allclose(g, group[0], equal_nan=True), (
                        f"replicas along mesh dim {i} disagree for output layout {layout}")
                merged[rest] = group[0]
            elif isinstance(p, Partial):
                stacked = torch.stack(group)
                merged[rest] = {"sum": stacked.sum(0), "avg": stacked.float().mean(0).to(stacked.dtype) if not stacked.is_floating_point() else stacked.mean(0),
                                "max": stacked.amax(0), "min": stacked.amin(0)}[p.reduce_op]
        current = merged
    return current[()]


def _spec(mesh: AbstractMesh, t: torch.Tensor, layout: Layout) -> DTensorSpec:
    return DTensorSpec(mesh, layout.placements, TensorMeta(t.shape, contiguous_strides(t.shape), t.dtype), layout.shard_order)


def _flat_tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor) and x.ndim > 0)
    return out


def _replace(values: Sequence[Any], it: Any) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            out.append(next(it))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) and x.ndim > 0 for x in v):
            out.append([next(it) if isinstance(x, torch.Tensor) and x.ndim > 0 else x for x in v])
        else:
            out.append(v)
    return out


def schema_for(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh: AbstractMesh, layouts: Sequence[Layout]) -> OpSchema:
    it = iter(_spec(mesh, t, lay) for t, lay in zip(_flat_tensors(list(args) + list(kwargs.values())), layouts))

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            return next(it)
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) and x.ndim > 0 for x in v):
            return tuple(next(it) if isinstance(x, torch.Tensor) and x.ndim > 0 else x for x in v)
        if isinstance(v, list):
            return tuple(v)
        return v

    a = tuple(conv(v) for v in args)
    k = tuple((name, conv(v)) for name, v in kwargs.items())
    return OpSchema(op, a, k)


def simulate(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh_shape: Sequence[int],
             strategy: PlacementStrategy, in_layouts: Sequence[Layout], seed: int = 0) -> Any:
    """Run `strategy` on every simulated rank; return the assembled output(s)."""
    tensors = _flat_tensors(list(args) + list(kwargs.values()))
    wanted = [lay if lay is not None else cur for lay, cur in zip(strategy.input_specs, in_layouts)]
    locals_per_input = [_terms(t, mesh_shape, lay, seed + k) for k, (t, lay) in enumerate(zip(tensors, wanted))]
    outs = strategy.output_specs
    out_layouts = outs if isinstance(outs, tuple) else (outs,)
    mesh = AbstractMesh(tuple(mesh_shape))
    impl = rule_for(op).local if isinstance(op, torch._ops.OpOverload) else None
    per_rank: dict[tuple[int, ...], Any] = {}
    local_calls: dict[tuple[int, ...], tuple[list[Any], dict[str, Any]]] = {}
    for c in coordinates(mesh_shape):
        it = iter([li[c] for li in locals_per_input])
        n_args = len(args)
        flat = _replace(list(args) + list(kwargs.values()), it)
        largs, lkw = flat[:n_args], dict(zip(kwargs.keys(), flat[n_args:]))
        if strategy.shape_arg is not None:
            full_out = op(*args, **kwargs)
            lay = out_layouts[0]
            spec = _spec(mesh, full_out, lay)
            largs[strategy.shape_arg] = list(spec.local_shape_and_offset(c)[0])
        if impl is not None:  # run below, every rank at once
            local_calls[c] = (largs, lkw)
            continue
        result = op(*largs, **lkw)
        if schema_is_inplace(op):
            result = largs[0]
        per_rank[c] = result
    if impl is not None:  # the rule's local implementation, its all_reduces answered across the ranks
        in_specs = tuple(_spec(mesh, t, lay) for t, lay in zip(tensors, wanted))
        out_specs = _out_specs(op, args, kwargs, mesh, outs)

        def run(rt: SimRank) -> Any:
            a, k = local_calls[rt._coordinate]
            return impl(LocalCall(op, _clones(a), _clones(k), in_specs, out_specs, rt))

        per_rank = run_in_lockstep(run, mesh_shape)
    if isinstance(outs, tuple):
        return tuple(
            None if lay is None else assemble_output({c: r[k] for c, r in per_rank.items()}, mesh_shape, lay)
            for k, lay in enumerate(out_layouts)
        )
    return assemble_output(per_rank, mesh_shape, outs)


def _clones(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _clones(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_clones(x) for x in v)
    return v


def _out_specs(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh: AbstractMesh, outs: Any) -> Any:
    full = op(*_clones(list(args)), **_clones(kwargs))
    if isinstance(outs, tuple):
        return tuple(None if lay is None else _spec(mesh, f, lay) for f, lay in zip(full, outs))
    return _spec(mesh, full, outs)


def schema_is_inplace(op: Any) -> bool:
    a = op._schema.arguments
    return bool(a) and a[0].alias_info is not None and a[0].alias_info.is_write


def default_layouts(tensors: Sequence[torch.Tensor], mesh_ndim: int) -> list[list[Layout]]:
    """Each input Shard on each dim / Replicate / Partial(sum), per mesh dim, all combinations
    (capped: at most 64 combinations, sampled deterministically)."""
    per_tensor = []
    for t in tensors:
        choices: list[Placement] = [Shard(d) for d in range(t.ndim)] + [Replicate(), Partial()]
        per_tensor.append([Layout(c) for c in itertools.product(choices, repeat=mesh_ndim)])
    combos = list(itertools.product(*per_tensor))
    if len(combos) > 64:
        step = len(combos) / 64
        combos = [combos[int(k * step)] for k in range(64)]
    return [list(c) for c in combos]


def _close(got: Any, want: Any, atol: float, rtol: float, what: str) -> None:
    if isinstance(want, (tuple, list)):
        for g, w in zip(got, want):
            if g is not None:
                _close(g, w, atol, rtol, what)
        return
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}\n{m}")


def first_time(seen: set[tuple[Any, ...]], cand: PlacementStrategy, combo: Sequence[Layout]) -> bool:
    """Whether the candidate, with the inputs it takes as they are taken from `combo`, has not been
    simulated yet: a candidate that names every input layout runs the same whatever the combination
    (the inputs are redistributed to it), so simulating it once per combination only repeats it."""
    key = (tuple(str(lay if lay is not None else cur) for lay, cur in zip(cand.input_specs, combo)),
           str(cand.output_specs))
    if key in seen:
        return False
    seen.add(key)
    return True


def check_op(
    op: Any,
    args: Sequence[Any],
    kwargs: Optional[dict[str, Any]] = None,
    *,
    mesh_shape: Sequence[int] = (2, 2),
    layouts: Optional[Sequence[Sequence[Layout | tuple[Placement, ...]]]] = None,
    atol: float = 1e-5,
    rtol: float = 1.3e-6,
    check_all_candidates: bool = True,
) -> int:
    """Check the op's strategies for each input layout combination; returns how many
    (layout combination, candidate) pairs were checked (a pair that resolves to inputs and
    outputs already simulated is counted, not simulated again)."""
    kwargs = kwargs or {}
    fn = get_op_strategy(op)
    assert fn is not None, f"no strategy registered for {op}"
    tensors = _flat_tensors(list(args) + list(kwargs.values()))
    want = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    if schema_is_inplace(op):
        want = args[0].clone()
        op(want, *args[1:], **kwargs)
    mesh = AbstractMesh(tuple(mesh_shape))
    combos = [[lay if isinstance(lay, Layout) else Layout(tuple(lay)) for lay in combo] for combo in layouts] if layouts \
        else default_layouts(tensors, len(mesh_shape))
    count = 0
    seen: set[tuple[Any, ...]] = set()
    for combo in combos:
        schema = schema_for(op, args, kwargs, mesh, combo)
        strategy = fn(schema)
        children = strategy.childs if isinstance(strategy, TupleStrategy) else (strategy,)
        for child in children:
            assert isinstance(child, OpStrategy)
            candidates = child.strategies if check_all_candidates else []
            for cand in candidates:
                if isinstance(strategy, TupleStrategy):
                    continue  # simulated through the propagator's choice below
                if not first_time(seen, cand, combo):
                    count += 1  # the same simulation as one already checked
                    continue
                got = simulate(op, [a.clone() if isinstance(a, torch.Tensor) else a for a in args], kwargs, mesh_shape, cand, combo)
                _close(got, want, atol, rtol, f"{op} inputs {[str(c) for c in combo]} candidate {cand}")
                count += 1
        chosen = propagate(schema)  # the propagator's pick must be one of the candidates and valid
        assert chosen is not None
    return count
