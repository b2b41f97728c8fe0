"""Factories, `*_like`, fills, random ops, `_foreach_*` and fused optimizers, in one process.

Three in-process checkers:
- `check_op` (strategy_sim) for the value factories (`zeros_like`, `new_full`, ...);
- `run_local_impl`: the propagator's choice plus the registered local impl run on every
  simulated rank, for random ops and fills (their local computation is not the aten op);
- `check_foreach`: every candidate of every element of a `TupleStrategy` (strategy_sim
  skips those), simulating element k alone, plus the propagator's choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import pytest
import torch

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._layout import contiguous_strides
from shardwise._ops import (
    Layout,
    LocalCall,
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    ScalarTensor,
    TupleStrategy,
    get_op_strategy,
    propagate,
    rule_for,
)
from shardwise._spec import DTensorSpec, TensorMeta

from ..strategy_sim import SimRank, _terms, assemble_output, check_op, coordinates, default_layouts, run_in_lockstep

aten = torch.ops.aten
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
MESHES = [(4,), (2, 2)]


def schema_meta_is_fixed() -> bool:
    """Whether `OpSchema.output_meta` handles `_foreach_*` / fused-optimizer calls: lists of
    specs in top-level arguments (`_schema._to_meta` looked only one level deep) and ops that
    return nothing (`_fused_sgd_` has no meta kernel, and needs none)."""
    spec = DTensorSpec(AbstractMesh((2,)), (R,), TensorMeta(torch.Size([2]), (1,), torch.float32))
    kw = dict(weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    try:
        OpSchema(aten._foreach_add.List, ((spec,), (spec,))).output_meta()
        OpSchema(aten._fused_sgd_.default, ((spec,), (spec,), ()), tuple(kw.items())).output_meta()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_output_meta_of_foreach_and_fused_calls() -> None:
    # regression: lists of specs reached the meta run unconverted, and `-> ()` ops
    # (_fused_sgd_ has no meta kernel) failed to describe their (absent) outputs
    assert schema_meta_is_fixed()


def seeded(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- helpers ---------------------------------------------------------------------------

def _lay(x: Any) -> Layout:
    return x if isinstance(x, Layout) else Layout(tuple(x))


def _spec(mesh: AbstractMesh, t: torch.Tensor, layout: Layout) -> DTensorSpec:
    return DTensorSpec(mesh, layout.placements, TensorMeta(t.shape, contiguous_strides(t.shape), t.dtype), layout.shard_order)


def build_schema(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh: AbstractMesh,
                 layouts: Sequence[Layout]) -> tuple[OpSchema, list[torch.Tensor]]:
    """The schema dispatch would build: tensors of rank >= 1 become specs (in order), 0-dim
    tensors `ScalarTensor`s, lists tuples. Returns it with the flattened DTensor inputs."""
    flat: list[torch.Tensor] = []
    it = iter(layouts)

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.ndim == 0:
                return ScalarTensor(v.dtype, "cpu")
            flat.append(v)
            return _spec(mesh, v, next(it))
        if isinstance(v, (list, tuple)):
            return tuple(conv(x) for x in v)
        return v

    a = tuple(conv(v) for v in args)
    k = tuple((name, conv(v)) for name, v in kwargs.items())
    return OpSchema(op, a, k), flat


def _localize(values: Sequence[Any], pieces: Any) -> list[Any]:
    """Replace each rank >= 1 tensor (in order, lists included) by the next local piece."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            out.append(next(pieces))
        elif isinstance(v, (list, tuple)):
            out.append([next(pieces) if isinstance(x, torch.Tensor) and x.ndim > 0 else x.clone() if isinstance(x, torch.Tensor) else x for x in v])
        elif isinstance(v, torch.Tensor):
            out.append(v.clone())
        else:
            out.append(v)
    return out


def run_local_impl(op: Any, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, *, mesh_shape: Sequence[int],
                   layouts: Sequence[Any], seed: int = 0, local_kwargs: Optional[dict[str, Any]] = None) -> Any:
    """Propagate, move each input to its chosen layout, run the registered local impl on
    every simulated rank (`local_kwargs` added there: a generator stands in for the shared
    seed) and reassemble the output(s) from the chosen output layout(s).

    Returns (assembled output(s), OutputSharding)."""
    kwargs = kwargs or {}
    mesh = AbstractMesh(tuple(mesh_shape))
    schema, flat = build_schema(op, args, kwargs, mesh, [_lay(x) for x in layouts])
    chosen = propagate(schema)
    impl = rule_for(op).local
    assert impl is not None, f"{op} has no local implementation"
    current = schema.input_specs()
    wanted = [t if t is not None else c for t, c in zip(chosen.input_specs, current)]
    terms = [_terms(full, mesh_shape, Layout(s.placements, s.shard_order), seed + k) for k, (full, s) in enumerate(zip(flat, wanted))]
    outs = chosen.output_spec
    per_rank: dict[tuple[int, ...], Any] = {}
    for c in coordinates(mesh_shape):
        pieces = iter([t[c] for t in terms])
        local = _localize(list(args) + list(kwargs.values()), pieces)
        largs, lkw = local[: len(args)], dict(zip(kwargs, local[len(args):]))
        lkw.update({k: (v() if callable(v) else v) for k, v in (local_kwargs or {}).items()})
        per_rank[c] = impl(LocalCall(op, largs, lkw, tuple(wanted), outs, SimRank(c)))
    if isinstance(outs, tuple):
        return tuple(assemble_output({c: r[i] for c, r in per_rank.items()}, mesh_shape, Layout(s.placements))
                     for i, s in enumerate(outs)), chosen
    assert isinstance(outs, DTensorSpec)
    return assemble_output(per_rank, mesh_shape, Layout(outs.placements)), chosen


def check_foreach(op: Any, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, *, mesh_shape: Sequence[int],
                  layouts: Sequence[Any], written: Sequence[int] = (), atol: float = 1e-5) -> int:
    """Simulate every candidate of every element of a `_foreach_*` / fused op's TupleStrategy.

    Element k runs alone (every list cut to its k-th entry). Out-of-place ops are compared
    on their outputs; in-place ops on the lists at positions `written` (default: self).
    Returns the number of (element, candidate) pairs simulated."""
    kwargs = kwargs or {}
    mesh = AbstractMesh(tuple(mesh_shape))
    lays = [_lay(x) for x in layouts]
    schema, flat = build_schema(op, args, kwargs, mesh, lays)
    inplace = schema.is_inplace()
    written = tuple(written) or ((0,) if inplace else ())

    def copy(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else v

    def fresh(vals: Sequence[Any]) -> list[Any]:
        return [[copy(x) for x in v] if isinstance(v, (list, tuple)) else copy(v) for v in vals]

    ref_args = fresh(args)
    ref_out = op(*ref_args, **kwargs)
    strategy = get_op_strategy(op)(schema)  # type: ignore[misc]
    assert isinstance(strategy, TupleStrategy)
    # flat index of (argument position, list index)
    where: dict[tuple[int, Optional[int]], int] = {}
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            where[(i, None)] = len(where)
        elif isinstance(v, (list, tuple)):
            for j, x in enumerate(v):
                if isinstance(x, torch.Tensor) and x.ndim > 0:
                    where[(i, j)] = len(where)
    count = 0
    for k, child in enumerate(strategy.childs):
        assert isinstance(child, OpStrategy) and child.strategies, f"element {k} has no candidate"
        for cand in child.strategies:
            elem_args = [([v[k]] if isinstance(v, (list, tuple)) and len(v) == len(strategy.childs) else v) for v in fresh(args)]
            keys = [(i, k if isinstance(v, (list, tuple)) and len(v) == len(strategy.childs) else None) for i, v in enumerate(args)]
            # layouts of element k's tensors, in flat order of elem_args
            elem_tensors: list[torch.Tensor] = []
            elem_layouts: list[Layout] = []
            arg_layout: dict[int, Layout] = {}
            for (i, j), v in zip(keys, elem_args):
                for x in (v if isinstance(v, list) else [v]):
                    if isinstance(x, torch.Tensor) and x.ndim > 0:
                        idx = where[(i, j)]
                        lay = cand.input_specs[idx] or lays[idx]
                        elem_tensors.append(x)
                        elem_layouts.append(lay)
                        arg_layout[i] = lay
            terms = [_terms(t, mesh_shape, lay, 17 * n) for n, (t, lay) in enumerate(zip(elem_tensors, elem_layouts))]
            per_rank: dict[tuple[int, ...], Any] = {}
            impl = rule_for(op).local
            in_specs = tuple(_spec(mesh, t, lay) for t, lay in zip(elem_tensors, elem_layouts))
            pieces = {c: _localize(elem_args, iter([t[c] for t in terms])) for c in coordinates(mesh_shape)}
            outs = run_in_lockstep(lambda rt: impl(LocalCall(op, pieces[rt._coordinate], dict(kwargs), in_specs, None, rt)),
                                   mesh_shape) if impl is not None else {}  # its all_reduces answered across the ranks
            for c in coordinates(mesh_shape):
                local = pieces[c]
                out = outs[c] if impl is not None else op(*local, **kwargs)
                per_rank[c] = [local[i][0] for i in written] if inplace else [out[0]]
            if inplace:
                for n, i in enumerate(written):
                    got = assemble_output({c: r[n] for c, r in per_rank.items()}, mesh_shape, arg_layout[i])
                    want = ref_args[i][k]
                    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5, msg=lambda m: f"{op} element {k} arg {i} {cand}: {m}")
            else:
                assert isinstance(cand.output_specs, Layout)
                got = assemble_output({c: r[0] for c, r in per_rank.items()}, mesh_shape, cand.output_specs)
                torch.testing.assert_close(got, ref_out[k], atol=atol, rtol=1e-5, msg=lambda m: f"{op} element {k} {cand}: {m}")
            count += 1
    assert propagate(schema) is not None
    return count


# -- *_like and new_* --------------------------------------------------------------------

SHAPES = [(8, 6), (5, 3), (3, 1)]  # even, uneven, a dim smaller than the mesh


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
def test_value_like_factories_follow_the_input_layout(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    x = seeded(*shape)
    n = 0
    n += check_op(aten.zeros_like.default, (x,), mesh_shape=mesh_shape)
    n += check_op(aten.ones_like.default, (x,), mesh_shape=mesh_shape)
    n += check_op(aten.full_like.default, (x, 2.5), mesh_shape=mesh_shape)
    n += check_op(aten.full_like.default, (x, 3), {"dtype": torch.int64}, mesh_shape=mesh_shape)
    n += check_op(aten.fill.Scalar, (x, -1.5), mesh_shape=mesh_shape)
    assert n == 5 * len(default_layouts([x], len(mesh_shape)))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_like_factories_need_no_communication_and_keep_partial_only_where_nothing_is_written(mesh_shape: tuple[int, ...]) -> None:
    x = seeded(5, 3)
    mesh = AbstractMesh(mesh_shape)
    for combo in default_layouts([x], len(mesh_shape)):
        lay = combo[0]
        spec = _spec(mesh, x, lay)
        no_partial = tuple(R if isinstance(p, Partial) else p for p in lay.placements)
        for op, args, keeps in [
            (aten.zeros_like.default, (), False), (aten.ones_like.default, (), False), (aten.empty_like.default, (), True),
            (aten.full_like.default, (1.0,), False), (aten.rand_like.default, (), False), (aten.randn_like.default, (), False),
            (aten.randint_like.default, (7,), False), (aten.bernoulli.p, (0.3,), False), (aten.new_zeros.default, ((5, 3),), False),
            (aten.new_empty.default, ((5, 3),), True), (aten.new_ones.default, ((5, 3),), False),
        ]:
            out = propagate(OpSchema(op, (spec,) + args))
            assert out.input_specs == (None,), f"{op} moved its input"
            assert isinstance(out.output_spec, DTensorSpec)
            assert out.output_spec.placements == (lay.placements if keeps else no_partial), (op, lay)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
def test_new_factories_shard_like_self_for_its_shape_and_replicate_other_shapes(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    x = seeded(*shape)
    for size in [list(shape), [2, 7]]:
        check_op(aten.new_zeros.default, (x, size), mesh_shape=mesh_shape)
        check_op(aten.new_ones.default, (x, size), mesh_shape=mesh_shape)
        check_op(aten.new_full.default, (x, size, 4.0), mesh_shape=mesh_shape)
    mesh = AbstractMesh(mesh_shape)
    spec = _spec(mesh, x, Layout((S0,) * len(mesh_shape)))
    assert propagate(OpSchema(aten.new_empty.default, (spec, (2, 7)))).output_spec.placements == (R,) * len(mesh_shape)  # type: ignore[union-attr]
    same = propagate(OpSchema(aten.new_empty.default, (spec, tuple(shape))))
    assert same.output_spec.placements == (S0,) * len(mesh_shape) and same.shape_arg == 1  # type: ignore[union-attr]
    strided = propagate(OpSchema(aten.new_empty_strided.default, (spec, tuple(shape), contiguous_strides(shape))))
    # each rank allocates only its piece, as for new_empty
    assert strided.output_spec.placements == (S0,) * len(mesh_shape) and strided.input_specs == (None,)  # type: ignore[union-attr]
    assert strided.shape_arg == 1  # type: ignore[union-attr]
    other = propagate(OpSchema(aten.new_empty_strided.default, (spec, (2, 7), (7, 1))))
    assert other.output_spec.placements == (R,) * len(mesh_shape)  # type: ignore[union-attr]


# -- fills and random ops: local impls on every simulated rank --------------------------------

def _layouts_2d(mesh_shape: tuple[int, ...]) -> list[tuple[Placement, ...]]:
    if len(mesh_shape) == 1:
        return [(R,), (S0,), (S1,), (P,)]
    return [(R, R), (S0, R), (R, S1), (S0, S1), (S1, S0), (S0, S0), (P, S0), (S1, P), (P, P)]


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_fill_writes_the_value_into_any_layout_partial_included(mesh_shape: tuple[int, ...]) -> None:
    x = seeded(5, 3)
    for lay in _layouts_2d(mesh_shape) + [(Partial("max"),) * len(mesh_shape), (Partial("avg"),) * len(mesh_shape)]:
        got, chosen = run_local_impl(aten.fill_.Scalar, (x.clone(), 2.5), mesh_shape=mesh_shape, layouts=[lay])
        assert chosen.input_specs == (None,) and chosen.output_spec.placements == lay  # no movement
        torch.testing.assert_close(got, torch.full((5, 3), 2.5))
        got, _ = run_local_impl(aten.fill_.Tensor, (x.clone(), torch.tensor(-1.0)), mesh_shape=mesh_shape, layouts=[lay])
        torch.testing.assert_close(got, torch.full((5, 3), -1.0))


def _gen(seed: int) -> Any:
    return lambda: torch.Generator().manual_seed(seed)


RANDOM_CASES: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = [
    ("rand_like", aten.rand_like.default, (), {}),
    ("randn_like", aten.randn_like.default, (), {}),
    ("randint_like", aten.randint_like.low_dtype, (-3, 9), {}),
    ("uniform_", aten.uniform_.default, (-2.0, 3.0), {}),
    ("normal_", aten.normal_.default, (1.0, 2.0), {}),
    ("exponential_", aten.exponential_.default, (2.0,), {}),
    ("bernoulli_", aten.bernoulli_.float, (0.3,), {}),
    ("bernoulli_p", aten.bernoulli.p, (0.7,), {}),
    ("random_from", getattr(aten.random_, "from"), (-5, 5), {}),
    ("random_to", aten.random_.to, (10,), {}),
]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", [(9, 6), (3, 1)])
@pytest.mark.parametrize("name,op,extra,kw", RANDOM_CASES, ids=[c[0] for c in RANDOM_CASES])
def test_random_ops_give_the_same_global_tensor_under_every_layout(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], name: str, op: Any, extra: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    x = seeded(*shape).abs()
    reference = None
    for lay in _layouts_2d(mesh_shape):
        got, chosen = run_local_impl(op, (x.clone(),) + extra, kw, mesh_shape=mesh_shape, layouts=[lay], local_kwargs={"generator": _gen(5)})
        assert chosen.input_specs == (None,), f"{name} moved its input from {lay}"
        if reference is None:
            reference = got
        assert torch.equal(got, reference), (name, lay)
    other, _ = run_local_impl(op, (x.clone(),) + extra, kw, mesh_shape=mesh_shape, layouts=[_layouts_2d(mesh_shape)[1]],
                              local_kwargs={"generator": _gen(6)})
    assert not torch.equal(other, reference) or x.numel() < 4, f"{name}: another seed gave the same values"


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_bernoulli_of_probabilities_reduces_partials_and_follows_shards(mesh_shape: tuple[int, ...]) -> None:
    probs = torch.rand(7, 5, generator=torch.Generator().manual_seed(3))
    reference = None
    for lay in _layouts_2d(mesh_shape):
        got, chosen = run_local_impl(aten.bernoulli.default, (probs,), mesh_shape=mesh_shape, layouts=[lay], local_kwargs={"generator": _gen(9)})
        assert not chosen.output_spec.has_partial()
        if not any(isinstance(p, Partial) for p in lay):
            assert chosen.input_specs == (None,)
        if reference is None:
            reference = got
        assert torch.equal(got, reference), lay
    # bernoulli_(p tensor): p broadcast against self follows self's shards
    self_ = torch.zeros(6, 5)
    row = torch.rand(5, generator=torch.Generator().manual_seed(1))
    ref2 = None
    for lay in _layouts_2d(mesh_shape):
        got, chosen = run_local_impl(aten.bernoulli_.Tensor, (self_.clone(), row), mesh_shape=mesh_shape, layouts=[lay, (R,) * len(mesh_shape)],
                                     local_kwargs={"generator": _gen(2)})
        assert chosen.input_specs[0] is None
        if ref2 is None:
            ref2 = got
        assert torch.equal(got, ref2), lay


def test_random_distributions_have_the_right_statistics() -> None:
    x = torch.zeros(200, 150)
    mesh_shape = (2, 2)
    lay = (S0, S1)

    def draw(op: Any, *extra: Any) -> torch.Tensor:
        got, _ = run_local_impl(op, (x.clone(),) + extra, mesh_shape=mesh_shape, layouts=[lay], local_kwargs={"generator": _gen(11)})
        return got  # type: ignore[no-any-return]

    u = draw(aten.uniform_.default, -1.0, 3.0)
    assert -1 <= u.min() and u.max() < 3 and abs(u.mean() - 1) < 0.03 and abs(u.var() - 16 / 12) < 0.05
    z = draw(aten.normal_.default, 0.5, 2.0)
    assert abs(z.mean() - 0.5) < 0.03 and abs(z.std() - 2) < 0.03
    e = draw(aten.exponential_.default, 4.0)
    assert e.min() >= 0 and abs(e.mean() - 0.25) < 0.01
    b = draw(aten.bernoulli_.float, 0.3)
    assert set(b.unique().tolist()) <= {0.0, 1.0} and abs(b.mean() - 0.3) < 0.01
    ints = draw(getattr(aten.random_, "from"), -3, 4)
    assert set(ints.unique().tolist()) == set(range(-3, 4)) and abs(ints.mean() - 0) < 0.05
    # neighbouring elements and pieces are not correlated
    flat = z.flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]) < 0.02


def test_random_ops_on_a_partial_self_write_each_value_once() -> None:
    x = torch.zeros(6, 4)
    for lay in [(P, R), (P, S1), (Partial("max"), S0), (Partial("avg"), P)]:
        got, chosen = run_local_impl(aten.uniform_.default, (x.clone(),), mesh_shape=(2, 2), layouts=[lay], local_kwargs={"generator": _gen(4)})
        ref, _ = run_local_impl(aten.uniform_.default, (x.clone(),), mesh_shape=(2, 2), layouts=[(R, R)], local_kwargs={"generator": _gen(4)})
        assert chosen.output_spec.placements == lay
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("p", [0.0, 0.4, 1.0])
def test_native_dropout_is_placement_invariant_and_keeps_partial_inputs(mesh_shape: tuple[int, ...], p: float) -> None:
    x = seeded(9, 5)
    reference = None
    layouts = _layouts_2d(mesh_shape) + [(Partial("max"),) * len(mesh_shape)]
    for lay in layouts:
        (out, mask), chosen = run_local_impl(aten.native_dropout.default, (x, p, True), mesh_shape=mesh_shape, layouts=[lay],
                                             local_kwargs={"generator": _gen(8)})
        assert chosen.input_specs == (None,), f"dropout moved its input from {lay}"
        assert chosen.output_spec[0].placements == lay  # Partial stays Partial
        assert not chosen.output_spec[1].has_partial()
        assert mask.dtype == torch.bool
        scale = 0.0 if p == 1 else 1 / (1 - p)
        torch.testing.assert_close(out, x * mask * scale)
        if reference is None:
            reference = mask
        assert torch.equal(mask, reference), lay
    if p == 0.4:
        assert 0.3 < reference.float().mean() < 0.8  # type: ignore[union-attr]
    (out, mask), _ = run_local_impl(aten.native_dropout.default, (x, 0.5, False), mesh_shape=mesh_shape, layouts=[(S0,) + (R,) * (len(mesh_shape) - 1)])
    assert torch.equal(out, x) and bool(mask.all())


# -- _foreach_* ----------------------------------------------------------------------------

def _lists(n_lists: int, seed: int = 0, shapes: Sequence[tuple[int, ...]] = ((8, 6), (5, 3), (3,), (2, 1))) -> list[list[torch.Tensor]]:
    return [[seeded(*s, seed=seed + 10 * i + j).abs() + 0.5 for j, s in enumerate(shapes)] for i in range(n_lists)]


def _element_layouts(mesh_shape: tuple[int, ...], shapes: Sequence[tuple[int, ...]], rotate: int) -> list[Layout]:
    """A different layout for each list element (rotating through Shard/Replicate/Partial)."""
    out = []
    for j, s in enumerate(shapes):
        choices = [Shard(d) for d in range(len(s))] + [R, P]
        out.append(Layout(tuple(choices[(j + rotate + m) % len(choices)] for m in range(len(mesh_shape)))))
    return out


SHAPES_F = ((8, 6), (5, 3), (3,), (2, 1))
FOREACH_CASES: list[tuple[str, Any, int, tuple[Any, ...], dict[str, Any]]] = [
    # (name, op, number of tensor lists, extra args, kwargs)
    ("add_List", aten._foreach_add.List, 2, (), {"alpha": 2.0}),
    ("add__List", aten._foreach_add_.List, 2, (), {"alpha": -0.5}),
    ("add__Scalar", aten._foreach_add_.Scalar, 1, (1.5,), {}),
    ("sub_ScalarList", aten._foreach_sub.ScalarList, 1, ([1.0, 2.0, 3.0, 4.0],), {}),
    ("mul__Scalar", aten._foreach_mul_.Scalar, 1, (0.9,), {}),
    ("mul_List", aten._foreach_mul.List, 2, (), {}),
    ("mul__Tensor", aten._foreach_mul_.Tensor, 1, (torch.tensor(3.0),), {}),
    ("div__ScalarList", aten._foreach_div_.ScalarList, 1, ([2.0, 4.0, 0.5, 1.0],), {}),
    ("div_List", aten._foreach_div.List, 2, (), {}),
    ("sqrt", aten._foreach_sqrt.default, 1, (), {}),
    ("neg_", aten._foreach_neg_.default, 1, (), {}),
    ("zero_", aten._foreach_zero_.default, 1, (), {}),
    ("lerp__Scalar", aten._foreach_lerp_.Scalar, 2, (0.1,), {}),
    ("lerp_List", aten._foreach_lerp.List, 3, (), {}),
    ("addcmul__Scalar", aten._foreach_addcmul_.Scalar, 3, (0.01,), {}),
    ("addcdiv__ScalarList", aten._foreach_addcdiv_.ScalarList, 3, ([-0.1, 0.2, 0.3, -0.4],), {}),
    ("maximum__List", aten._foreach_maximum_.List, 2, (), {}),
    ("clamp_min_Scalar", aten._foreach_clamp_min.Scalar, 1, (1.0,), {}),
    ("pow_Scalar", aten._foreach_pow.Scalar, 1, (2.0,), {}),
    ("pow_ScalarAndTensor", aten._foreach_pow.ScalarAndTensor, 0, (), {}),
    ("copy_", aten._foreach_copy_.default, 2, (), {}),
    ("clone", aten._foreach_clone.default, 1, (), {}),
]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("name,op,n_lists,extra,kw", FOREACH_CASES, ids=[c[0] for c in FOREACH_CASES])
def test_foreach_elements_are_each_sharded_like_their_pointwise_op(
    mesh_shape: tuple[int, ...], name: str, op: Any, n_lists: int, extra: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    for rotate in range(3):
        if n_lists == 0:  # pow(scalar, tensors)
            lists: list[Any] = [2.0, _lists(1)[0]]
            layouts = _element_layouts(mesh_shape, SHAPES_F, rotate)
        else:
            lists = list(_lists(n_lists, seed=rotate))
            layouts = [lay for i in range(n_lists) for lay in _element_layouts(mesh_shape, SHAPES_F, rotate + i)]
        args = tuple(lists) + extra
        assert check_foreach(op, args, kw, mesh_shape=mesh_shape, layouts=layouts) >= len(SHAPES_F)


def test_every_pointwise_foreach_overload_has_a_strategy() -> None:
    from shardwise._ops._foreach import FOREACH_POINTWISE_OPS

    names = {str(op) for op in FOREACH_POINTWISE_OPS}
    for family in ["add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "maximum", "sqrt", "neg", "zero", "copy"]:
        assert any(n.startswith(f"aten._foreach_{family}") for n in names), family
    for op in [aten._foreach_add_.List, aten._foreach_add_.Tensor, aten._foreach_mul_.Scalar, aten._foreach_lerp_.Scalar,
               aten._foreach_addcmul_.Scalar, aten._foreach_sqrt.default, aten._foreach_div_.ScalarList,
               aten._foreach_add_.Scalar, aten._foreach_addcdiv_.ScalarList, aten._foreach_maximum_.List, aten._foreach_add.List]:
        assert get_op_strategy(op) is not None, op


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_inplace_foreach_keeps_each_self_layout_when_it_can(mesh_shape: tuple[int, ...]) -> None:
    mesh = AbstractMesh(mesh_shape)
    n = len(mesh_shape)
    selfs = [seeded(8, 6), seeded(8, 6), seeded(5, 3)]
    others = [seeded(8, 6), seeded(8, 6), seeded(5, 3)]
    self_lays = [Layout((S0,) * n), Layout((S1,) + (R,) * (n - 1)), Layout((R,) * n)]
    other_lays = [Layout((S1,) * n), Layout((R,) * n), Layout((S0,) * n)]
    schema, _ = build_schema(aten._foreach_add_.List, (selfs, others), {}, mesh, self_lays + other_lays)
    chosen = propagate(schema)
    assert chosen.input_specs[:3] == (None, None, None), chosen  # selves stay: no write-back
    assert chosen.input_specs[3] is not None and chosen.input_specs[3].placements == (S0,) * n
    assert chosen.input_specs[4] is not None and chosen.input_specs[4].placements == self_lays[1].placements
    # P(sum) grads scaled in place stay partial; P(sum) + P(sum) too
    p_lays = [Layout((P,) * n)] * 3
    schema, _ = build_schema(aten._foreach_mul_.Scalar, (selfs, 0.5), {}, mesh, p_lays)
    assert propagate(schema).input_specs == (None, None, None)
    schema, _ = build_schema(aten._foreach_add_.List, (selfs, others), {}, mesh, p_lays + p_lays)
    assert propagate(schema).input_specs == (None,) * 6


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_foreach_reductions(mesh_shape: tuple[int, ...]) -> None:
    shapes = ((8, 6), (5, 3), (3,), (2, 1))
    for rotate in range(3):
        xs = [seeded(*s, seed=j) for j, s in enumerate(shapes)]
        lays = _element_layouts(mesh_shape, shapes, rotate)
        for ord_ in [1, 2, 0, math.inf, -math.inf]:
            check_foreach(aten._foreach_norm.Scalar, (xs, ord_), mesh_shape=mesh_shape, layouts=lays)
        check_foreach(aten._foreach_powsum.Scalar, (xs, 3), mesh_shape=mesh_shape, layouts=lays)
        check_foreach(aten._foreach_max.default, (xs,), mesh_shape=mesh_shape, layouts=lays)
    # a shard becomes a Partial of the matching reduction, without moving the input
    mesh = AbstractMesh(mesh_shape)
    n = len(mesh_shape)
    xs = [seeded(8, 6)]
    for op, args, reduce_op in [(aten._foreach_norm.Scalar, (1,), "sum"), (aten._foreach_max.default, (), "max"),
                                (aten._foreach_norm.Scalar, (math.inf,), "max"), (aten._foreach_powsum.Scalar, (2,), "sum")]:
        schema, _ = build_schema(op, (xs,) + args, {}, mesh, [Layout((S0,) * n)])
        out = propagate(schema)
        assert out.input_specs == (None,) and out.output_spec[0].placements == (Partial(reduce_op),) * n  # type: ignore[index]
    # an empty piece has no max: gathered instead (3 rows over 4 ranks)
    schema, _ = build_schema(aten._foreach_max.default, ([seeded(3, 2)],), {}, mesh, [Layout((S0,) * n)])
    assert propagate(schema).output_spec[0].placements == (R,) * n  # type: ignore[index]


def _adam_inputs(shapes: Sequence[tuple[int, ...]], amsgrad: bool) -> tuple[list[Any], dict[str, Any]]:
    params = [seeded(*s, seed=j) for j, s in enumerate(shapes)]
    grads = [seeded(*s, seed=100 + j) for j, s in enumerate(shapes)]
    m = [seeded(*s, seed=200 + j) * 0.1 for j, s in enumerate(shapes)]
    v = [seeded(*s, seed=300 + j).abs() * 0.1 for j, s in enumerate(shapes)]
    vmax = [x * 1.5 for x in v] if amsgrad else []
    steps = [torch.tensor(3.0) for _ in shapes]
    kw = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=amsgrad, maximize=False)
    return [params, grads, m, v, vmax, steps], kw


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("op", [aten._fused_adam_.default, aten._fused_adamw_.default])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adam_steps_every_element_in_one_common_layout(mesh_shape: tuple[int, ...], op: Any, amsgrad: bool) -> None:
    shapes = ((8, 6), (5, 3), (3,))
    n_lists = 5 if amsgrad else 4
    for rotate in range(3):
        args, kw = _adam_inputs(shapes, amsgrad)
        lays = [lay for i in range(n_lists) for lay in _element_layouts(mesh_shape, shapes, rotate + (i % 2))]
        check_foreach(op, args, kw, mesh_shape=mesh_shape, layouts=lays, written=tuple(range(n_lists)), atol=1e-6)
    # params, grads and states agreeing: nothing moves
    mesh = AbstractMesh(mesh_shape)
    args, kw = _adam_inputs(shapes[:2], amsgrad)
    lays = [Layout((S0,) * len(mesh_shape)), Layout((S1,) + (R,) * (len(mesh_shape) - 1))] * n_lists
    schema, _ = build_schema(op, args, kw, mesh, lays)
    assert propagate(schema).input_specs == (None,) * len(lays)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_fused_sgd_with_and_without_momentum(mesh_shape: tuple[int, ...]) -> None:
    shapes = ((8, 6), (5, 3), (3,))
    for momentum in [0.0, 0.9]:
        params = [seeded(*s, seed=j) for j, s in enumerate(shapes)]
        grads = [seeded(*s, seed=50 + j) for j, s in enumerate(shapes)]
        bufs = [seeded(*s, seed=80 + j) for j, s in enumerate(shapes)] if momentum else []
        kw = dict(weight_decay=0.01, momentum=momentum, lr=0.1, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
        n_lists = 3 if momentum else 2
        lays = [lay for i in range(n_lists) for lay in _element_layouts(mesh_shape, shapes, i)]
        check_foreach(aten._fused_sgd_.default, (params, grads, bufs), kw, mesh_shape=mesh_shape, layouts=lays,
                      written=tuple(range(n_lists)), atol=1e-6)
