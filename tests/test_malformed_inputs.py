"""Malformed arguments at the public boundary raise ValueError / TypeError naming the value.

Hypothesis throws wrong kinds (str, float, bool, None, bytes, complex, nested lists and
dicts, placements and dtypes where something else belongs), near misses (negative,
zero and huge ints, NaN and infinities, empty tuples, wrong-length sequences, repeated
or unknown names) and valid values, mixed per argument, at every public constructor
and entry point that runs in one process without a process group. For each call the
property is:

- it succeeds (the drawn arguments may happen to be valid), or
- it raises `ValueError` or `TypeError` (subclasses too) whose message names one of the
  malformed values: its `repr` or `str`, or for a container the container or one of its
  elements. With only valid arguments drawn, it must not raise at all.

Anything else (AttributeError, IndexError, KeyError, ZeroDivisionError, OverflowError,
RuntimeError, AssertionError, numpy's or torch's own messages) fails the property.
Entry points that need a live mesh are called with a malformed mesh (never a valid
one), so only their argument checks run. `CASES` lists the entry points with their
example counts; `test_at_least_1000_malformed_calls` pins that they add up to 1,000 or
more, and each case checks that Hypothesis really ran that many examples. What the
property found in `src` is pinned by name in `REGRESSIONS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import shardwise as sw
from shardwise import AbstractMesh, Partial, Replicate, Shard
from shardwise import parallel as par
from shardwise import pipeline as pl
from shardwise import spmd
from shardwise._tensor import _random

# -- malformed values ------------------------------------------------------------------------


class Odd:
    """A value of a kind no entry point takes."""

    def __repr__(self) -> str:
        return "Odd()"


HUGE = st.sampled_from([2**63, -(2**63) - 1, 10**30, -(10**30), 2**64]) | st.integers(2**62, 2**70)
SMALL_INTS = st.integers(-3, 9)
FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 0.5, -1.5, 2.0, 1e300]) | st.floats()
TEXT = st.sampled_from(["", "a", "sum", "dp", "tp", "zz", "x", "cpu", "cuda:7", "F", "1", "2.5", "never!"]) | st.text(
    alphabet="abxyzpt_01 ", max_size=4
)
OTHERS = st.sampled_from(
    [None, True, False, b"\x00", 1j, (), [], {}, frozenset({1}), Odd(), Shard(0), Replicate(), Partial(), torch.float32]
)
ATOMS = st.one_of(SMALL_INTS, HUGE, FLOATS, TEXT, OTHERS)
JUNK = st.recursive(
    ATOMS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(TEXT, kids, max_size=2),
    ),
    max_leaves=6,
)
NOT_NONE = JUNK.filter(lambda v: v is not None)
# no huge sizes where a valid-looking size would be allocated (HybridMesh builds its grid,
# clock_cycles lists every cycle): those are valid, only too large for this machine
MODEST = st.recursive(
    st.one_of(SMALL_INTS, FLOATS, TEXT, OTHERS),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple)),
    max_leaves=4,
)


def int_tuples(lo: int = -2, hi: int = 5, max_size: int = 3) -> st.SearchStrategy[Any]:
    """Near misses for shapes and sizes: zero, negative and bool entries, lists, wrong lengths."""
    item = st.one_of(st.integers(lo, hi), st.booleans(), HUGE)
    return st.one_of(st.lists(item, max_size=max_size).map(tuple), st.lists(item, max_size=max_size))


PLACEMENTS = st.sampled_from([Shard(0), Shard(1), Shard(-1), Replicate(), Partial(), Partial("max")])


def placement_lists(n: int, tensor_ndim: int, partial: bool = True) -> st.SearchStrategy[list[Any]]:
    """Valid placements for an n-D mesh and a tensor of `tensor_ndim` dims."""
    options: list[Any] = [Replicate()] + [Shard(d) for d in range(-tensor_ndim, tensor_ndim)]
    if partial:
        options += [Partial(), Partial("avg")]
    return st.lists(st.sampled_from(options), min_size=n, max_size=n)


def near_placements() -> st.SearchStrategy[Any]:
    """Placements of the wrong length, out-of-range dims, or mixed with other kinds."""
    wrong = st.sampled_from([Shard(5), Shard(-7), Replicate(), "S(0)", 0, None])
    return st.lists(st.one_of(PLACEMENTS, wrong), max_size=4)


# -- the property ----------------------------------------------------------------------------


def _tokens(value: Any) -> set[str]:
    """The spellings of `value` a message may name it by (a shardwise value also by its kind:
    `ColwiseParallel` for a style, `<root>` for the root module's name `''` in a plan)."""
    found = {repr(value)}
    if type(value).__module__.startswith("shardwise"):
        found.add(type(value).__name__)
    if isinstance(value, str):
        found.add(value if len(value) >= 2 else "<root>" if not value else repr(value))
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        found |= {repr(tuple(value)), repr(list(value))}
        for item in (list(value) + list(value.values())) if isinstance(value, dict) else value:
            found |= _tokens(item)
    else:
        found.add(str(value))
    return found


def names(message: str, value: Any) -> bool:
    return any(token in message for token in _tokens(value))


class Args:
    """Draws each argument valid, a near miss or junk, remembering the malformed ones."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.bad: list[Any] = []
        self.good = True  # whether the last `ok` drew a valid value

    def ok(
        self,
        valid: st.SearchStrategy[Any],
        near: Optional[st.SearchStrategy[Any]] = None,
        junk: st.SearchStrategy[Any] = JUNK,
        is_valid: Optional[Callable[[Any], bool]] = None,
    ) -> Any:
        """A valid value half of the time, else a near miss or junk. `is_valid` recognises a
        malformed draw that happens to be valid, so later arguments can depend on it."""
        pick = self.data.draw(st.integers(0, 3))
        if pick < 2:
            self.good = True
            return self.data.draw(valid)
        value = self.data.draw(near if near is not None and pick == 3 else junk)
        self.good = is_valid is not None and _safely(is_valid, value)
        if not self.good:
            self.bad.append(value)
        return value

    def bad_one(self, junk: st.SearchStrategy[Any] = JUNK) -> Any:
        """Always malformed (an argument no valid value of which can run in one process)."""
        value = self.data.draw(junk)
        self.bad.append(value)
        return value

    def valid(self, valid: st.SearchStrategy[Any]) -> Any:
        return self.data.draw(valid)


def _safely(check: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(check(value))
    except Exception:
        return False


def expect_clean_failure(call: Callable[[], Any], bad: list[Any], what: str) -> None:
    """The property: `call()` succeeds, or raises ValueError/TypeError naming a malformed value."""
    try:
        call()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if not bad:
            raise AssertionError(f"{what}: valid arguments raised {type(exc).__name__}: {message}") from exc
        if not any(names(message, v) for v in bad):
            raise AssertionError(
                f"{what}: the {type(exc).__name__} names none of the malformed values {bad!r}:\n{message}"
            ) from exc
    except Exception as exc:
        raise AssertionError(
            f"{what}: malformed values {bad!r} raised {type(exc).__name__}, not ValueError/TypeError: {exc}"
        ) from exc


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: Any, lo: int = 1) -> bool:
    """A non-empty tuple or list of ints >= lo (a valid shape)."""
    return isinstance(v, (tuple, list)) and len(v) > 0 and all(_is_int(s) and s >= lo for s in v)


# -- the entry points ------------------------------------------------------------------------

Call = Callable[[], Any]


def seq3() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)


MESH_2D = AbstractMesh((2, 2), ("dp", "tp"))
SPMD_MESH = spmd.Mesh(list(range(8)), (4, 2), ("x", "y"))
BALANCES = st.sampled_from([[3], [2, 1], [1, 2], [1, 1, 1]])
MODES = st.sampled_from(["always", "except_last", "never"])


# placements ----------------------------------------------------------------------------------


def shard(a: Args) -> Call:
    dim = a.ok(st.integers(), near=HUGE)
    return lambda: Shard(dim)


def partial(a: Args) -> Call:
    op = a.ok(st.sampled_from(["sum", "avg", "max", "min", "prod", "product"]), near=TEXT)
    return lambda: Partial(op)


# meshes --------------------------------------------------------------------------------------


def abstract_mesh(a: Args) -> Call:
    shape = a.ok(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), near=int_tuples(), is_valid=_ints)
    names_ok = st.just(None) | st.permutations(["dp", "tp", "pp"][: len(shape)]).map(tuple) if a.good else st.none()
    mesh_dim_names = a.ok(names_ok, near=st.lists(st.sampled_from(["dp", "tp", ""]), max_size=3).map(tuple))
    return lambda: AbstractMesh(shape, mesh_dim_names)


def mesh_dim_lookup(a: Args) -> Call:
    mesh_dim = a.ok(st.sampled_from(["dp", "tp", 0, 1, -1, -2]), near=st.sampled_from(["pp", 2, -3, 10**30]))
    method = a.valid(st.sampled_from(["size", "mesh_dim_index"]))
    return lambda: getattr(MESH_2D, method)(mesh_dim)


def init_device_mesh(a: Args) -> Call:
    # only shapes that are not positive ints: a valid one would start a process group
    shape = a.bad_one(st.one_of(JUNK, int_tuples()))
    assume(not (_is_int(shape) and shape >= 1) and not (isinstance(shape, (tuple, list)) and shape and
                                                        all(isinstance(s, int) and s >= 1 for s in shape)))
    names = a.ok(st.none())
    return lambda: sw.init_device_mesh("cpu", shape, mesh_dim_names=names)


# redistribute planning -------------------------------------------------------------------------

MESHES = st.sampled_from([AbstractMesh((2,)), AbstractMesh((2, 2)), AbstractMesh((2, 4), ("dp", "tp"))])
SHAPES = st.lists(st.integers(0, 8), min_size=1, max_size=3).map(tuple)


def _planning_args(a: Args, mesh: Any, mesh_ndim: Optional[int]) -> tuple[Any, Any, Any]:
    shape = a.ok(SHAPES, near=int_tuples(lo=-3), is_valid=lambda s: _ints(s, lo=0))
    ndim = len(shape) if a.good else None
    if mesh_ndim is None or ndim is None:  # a malformed mesh or shape: the other arguments stay neutral
        n = mesh_ndim or 1
        src = a.ok(st.just([Replicate()] * n), near=near_placements())
        dst = a.ok(st.just([Replicate()] * n), near=near_placements())
    else:
        src = a.ok(placement_lists(mesh_ndim, ndim), near=near_placements())
        dst = a.ok(placement_lists(mesh_ndim, ndim, partial=False), near=near_placements())
    return shape, src, dst


def explain_redistribute(a: Args) -> Call:
    mesh = a.ok(MESHES | st.sampled_from([(2, 2), [4]]), near=int_tuples(),
                is_valid=lambda m: isinstance(m, AbstractMesh) or _ints(m))
    mesh_ndim = (mesh.ndim if isinstance(mesh, AbstractMesh) else len(mesh)) if a.good else None
    shape, src, dst = _planning_args(a, mesh, mesh_ndim)
    return lambda: sw.explain_redistribute(mesh, shape, src, dst)


def plan_for(a: Args) -> Call:
    mesh = a.ok(MESHES)
    mesh_ndim = mesh.ndim if a.good else None
    shape, src, dst = _planning_args(a, mesh, mesh_ndim)
    dtype = a.ok(st.sampled_from([torch.float32, torch.float16, torch.int64]))
    n = mesh_ndim or 1
    bandwidth = a.ok(st.none() | st.lists(st.floats(0.1, 100), min_size=n, max_size=n),
                     near=st.lists(st.one_of(FLOATS, st.integers(-1, 0)), max_size=3))
    src_order = a.ok(st.none() | st.just({}), near=st.dictionaries(SMALL_INTS, st.lists(SMALL_INTS, max_size=2), max_size=2))
    return lambda: sw.plan_for(mesh, shape, src, dst, dtype=dtype, src_shard_order=src_order, bandwidth=bandwidth)


# spmd -----------------------------------------------------------------------------------------

MESH_ARGS = st.sampled_from([
    (list(range(4)), (2, 2), ("x", "y")),
    (list(range(8)), (4, 2), None),
    ([1, 0], (2,), ("data",)),
])


def spmd_mesh(a: Args) -> Call:
    ids, shape, axis_names = a.valid(MESH_ARGS)
    ids = a.ok(st.just(ids), near=st.lists(st.integers(-2, 9), max_size=5))
    shape = a.ok(st.just(shape), near=int_tuples())
    axis_names = a.ok(st.just(axis_names), near=st.lists(st.sampled_from(["x", "y", "x"]), max_size=3).map(tuple))
    return lambda: spmd.Mesh(ids, shape, axis_names)


def hybrid_mesh(a: Args) -> Call:
    shapes = int_tuples(lo=-1, hi=3).filter(lambda s: all(abs(v) < 100 for v in s))
    ici = a.ok(st.just((1, 2)), near=shapes, junk=MODEST)
    dcn = a.ok(st.just((2, 1)), near=shapes, junk=MODEST)
    axis_names = a.ok(st.just(("dp", "tp")) | st.none(), near=st.lists(TEXT, max_size=3).map(tuple))
    hosts = a.ok(st.just(2), near=st.integers(-1, 3) | HUGE)
    local = a.ok(st.just(2), near=st.integers(-1, 3) | HUGE)
    return lambda: spmd.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=axis_names, hosts=hosts,
                                   local_world_size=local)


def get_1d_mesh(a: Args) -> Call:
    name = a.ok(st.none() | st.just("data"))
    return lambda: spmd.get_1d_mesh(name)


def set_global_mesh(a: Args) -> Call:
    mesh = a.ok(st.just(SPMD_MESH) | st.none())

    def call() -> None:
        before = spmd.get_global_mesh()
        try:
            spmd.set_global_mesh(mesh)
        finally:
            spmd.set_global_mesh(before)

    return call


SPECS = st.sampled_from([("x", None), (None, "y"), (("x", "y"),), ("y", "x", None), (0, 1), (), (None,)])
NEAR_SPECS = st.one_of(
    st.lists(st.sampled_from([None, "x", "y", "z", 0, 1, 2, -1, ("x", "x"), ("x", ("y",)), 1.5, True]), max_size=3)
    .map(tuple),
    st.sampled_from(["x", 0, None]),
)


def sharding_spec(a: Args) -> Call:
    mesh = a.ok(st.just(SPMD_MESH))
    spec = a.ok(SPECS, near=NEAR_SPECS)
    minibatch = a.ok(st.booleans())
    return lambda: spmd.ShardingSpec(mesh, spec, minibatch)


def shard_indices(a: Args) -> Call:
    spec = spmd.ShardingSpec(SPMD_MESH, ("x", None))
    shape = a.ok(st.tuples(st.integers(0, 9), st.integers(0, 9)), near=int_tuples(lo=-3))
    return lambda: spec.shard_indices(shape)


def mark_sharding(a: Args) -> Call:
    t = a.ok(st.just(torch.zeros(4, 2)))
    mesh = a.bad_one()  # a valid mesh would start processes
    spec = a.ok(SPECS, near=NEAR_SPECS)
    fn = a.valid(st.sampled_from([spmd.mark_sharding, spmd.mark_sharding_with_gradients]))
    return lambda: fn(t, mesh, spec)


def clear_sharding(a: Args) -> Call:
    t = a.ok(st.just(torch.zeros(3)))
    return lambda: spmd.clear_sharding(t)


def manual_sharding(a: Args) -> Call:
    t = a.ok(st.just(torch.zeros(4, 2)))
    spec = a.ok(SPECS, near=NEAR_SPECS)
    mesh = a.bad_one(NOT_NONE)  # None reads the global mesh
    which = a.valid(st.sampled_from(["enable", "disable", "psum"]))
    if which == "enable":
        return lambda: spmd.enable_manual_sharding(t, spec, mesh=mesh)
    if which == "disable":
        shape = a.ok(st.just((8, 2)), near=int_tuples())
        return lambda: spmd.disable_manual_sharding(t, spec, shape, mesh=mesh)
    return lambda: spmd.psum(t, "x", mesh=mesh)


def shard_map(a: Args) -> Call:
    fn = a.ok(st.just(lambda x: x))
    in_specs = a.ok(st.just((("x", None),)), junk=NOT_NONE)
    out_specs = a.ok(st.just(("x", None)), junk=NOT_NONE)
    return lambda: spmd.shard_map(fn, SPMD_MESH, in_specs, out_specs)


def mark_sharding_module(a: Args) -> Call:
    module = a.ok(st.just(Block()))
    mesh = a.bad_one()
    specs = a.ok(st.just({"up.weight": ("x", None)}), near=st.dictionaries(TEXT, NEAR_SPECS, max_size=2))
    return lambda: spmd.mark_sharding_module(module, mesh, specs)


# tensor-parallel styles -------------------------------------------------------------------------

ONE_LAYOUT = st.none() | PLACEMENTS | PLACEMENTS.map(lambda p: (p,))
LAYOUTS = st.one_of(PLACEMENTS, st.lists(st.none() | PLACEMENTS, min_size=1, max_size=2).map(tuple))


def linear_styles(a: Args) -> Call:
    style = a.valid(st.sampled_from([par.ColwiseParallel, par.RowwiseParallel, par.FusedColwiseParallel]))
    kwargs = {
        "input_layouts": a.ok(ONE_LAYOUT, near=st.lists(PLACEMENTS, max_size=3)),
        "output_layouts": a.ok(ONE_LAYOUT, near=st.lists(PLACEMENTS, max_size=3)),
        "use_local_output": a.ok(st.booleans()),
        "src_data_rank": a.ok(st.none() | st.integers(0, 3)),
    }
    if style is par.FusedColwiseParallel:
        kwargs["parts"] = a.ok(st.integers(2, 4), near=st.integers(-1, 1) | HUGE)
    return lambda: style(**kwargs)


def sequence_parallel(a: Args) -> Call:
    dim = a.ok(st.integers(-3, 3), near=HUGE)
    local = a.ok(st.booleans())
    return lambda: par.SequenceParallel(sequence_dim=dim, use_local_output=local)


def prepare_module_input(a: Args) -> Call:
    n = a.valid(st.integers(1, 2))
    layouts = st.lists(st.none() | PLACEMENTS, min_size=n, max_size=n).map(tuple)
    kw = st.dictionaries(st.sampled_from(["x", "mask"]), PLACEMENTS, min_size=1, max_size=1)
    kwargs = {
        "input_layouts": a.ok(layouts, near=st.lists(st.none() | PLACEMENTS, max_size=3)),
        "desired_input_layouts": a.ok(layouts, near=st.lists(st.none() | PLACEMENTS, max_size=3)),
        "use_local_output": a.ok(st.booleans()),
    }
    keyword = a.ok(st.just({"x": Replicate()}), near=kw)
    desired = a.ok(st.just({"x": Shard(0)}), near=kw)
    if a.valid(st.booleans()):
        kwargs.update(input_kwarg_layouts=keyword, desired_input_kwarg_layouts=desired)
    return lambda: par.PrepareModuleInput(**kwargs)


def prepare_module_output(a: Args) -> Call:
    out = a.ok(LAYOUTS.map(lambda v: v if isinstance(v, tuple) and len(v) == 1 else (Replicate(),)),
               near=st.lists(st.none() | PLACEMENTS, max_size=3))
    want = a.ok(st.just((Shard(0),)), near=st.lists(st.none() | PLACEMENTS, max_size=3))
    local = a.ok(st.booleans())
    both = a.valid(st.booleans())
    if both:
        return lambda: par.PrepareModuleInputOutput(output_layouts=out, desired_output_layouts=want,
                                                    use_local_output=local)
    return lambda: par.PrepareModuleOutput(output_layouts=out, desired_output_layouts=want, use_local_output=local)


# plans ------------------------------------------------------------------------------------------

PLAN_VALUES = st.sampled_from([
    (None, "tp"), ("tp",), (("dp", "tp"), None), (Shard(0), Replicate()), Shard(0), "tp", [None, ("tp",)],
    par.ColwiseParallel(), par.RowwiseParallel(),
])


def sharding_plan(a: Args) -> Call:
    plan = a.ok(st.dictionaries(st.sampled_from(["up", "down", "up.weight", "down.bias"]), PLAN_VALUES, max_size=2),
                near=st.dictionaries(st.one_of(TEXT, SMALL_INTS, st.none()), JUNK, min_size=1, max_size=2))
    output_plan = a.ok(st.none() | st.just({"up": (Shard(0), Replicate())}),
                       near=st.dictionaries(TEXT, JUNK, min_size=1, max_size=2))
    local = a.ok(st.none() | st.just(["down"]) | st.just(("up", "down")),
                 near=st.lists(st.one_of(TEXT, SMALL_INTS), min_size=1, max_size=2))
    return lambda: par.ShardingPlan(plan, output_plan=output_plan, return_local_tensor=local)


NEAR_PLANS = st.dictionaries(
    st.sampled_from(["up", "down", "up.weight", "down.bias", "up.*", "nope", "up.weigth", ""]),
    st.sampled_from([("zz",), (None, None, None, "tp"), ("tp", "tp"), (Shard(2),), (Shard(0),) * 3, ("dp",),
                     par.SequenceParallel(), par.ColwiseParallel()]),
    min_size=1, max_size=2,
)


def plan_validate(a: Args) -> Call:
    module = a.ok(st.just(Block()), junk=NOT_NONE)
    entries = a.ok(st.just({"up": par.ColwiseParallel(), "down": par.RowwiseParallel()}) |
                   st.just({"up.weight": ("tp", None)}), near=NEAR_PLANS, junk=NEAR_PLANS)
    plan = par.ShardingPlan(entries)
    mesh = a.ok(st.sampled_from([AbstractMesh((2,), ("tp",)), AbstractMesh((4,), ("tp",))]), junk=NOT_NONE)
    if a.valid(st.booleans()):
        return lambda: plan.validate(module, mesh)
    return lambda: par.coverage(module, plan, mesh)


def shard_module(a: Args) -> Call:
    module = a.ok(st.just(Block()))
    plan = par.ShardingPlan({"up": par.ColwiseParallel()})
    mesh = a.bad_one(NOT_NONE)  # None reads the current mesh
    which = a.valid(st.sampled_from(["shard", "parallelize", "distribute"]))
    if which == "shard":
        return lambda: par.shard_module(module, plan, mesh)
    if which == "parallelize":
        return lambda: par.parallelize_module(module, mesh, {"up": par.ColwiseParallel()})
    return lambda: par.distribute_module(module, mesh)


def data_parallel(a: Args) -> Call:
    module = a.ok(st.just(Block()))
    mesh = a.bad_one()
    bucket = a.ok(st.floats(0.5, 100), near=FLOATS | st.integers(-1, 0))
    return lambda: par.data_parallel(module, mesh, bucket_cap_mb=bucket)


def module_helpers(a: Args) -> Call:
    module = a.bad_one()
    which = a.valid(st.sampled_from(["megatron", "no_sync", "memory_report", "hf_sequential", "hf_loss"]))
    if which == "megatron":
        return lambda: par.MegatronPlanner().build_plan(module)
    if which == "no_sync":
        def enter() -> None:
            with par.no_sync(module):
                pass
        return enter
    if which == "memory_report":
        return lambda: par.memory_report(module)
    return lambda: getattr(pl, which)(module)


def global_mean(a: Args) -> Call:
    value = a.ok(st.just(torch.ones(())))
    mesh = a.bad_one()
    return lambda: par.global_mean(value, mesh)


# pipeline ---------------------------------------------------------------------------------------


def pipe(a: Args) -> Call:
    module = a.ok(st.builds(seq3))
    balance = a.ok(BALANCES, near=st.lists(st.one_of(st.integers(-1, 4), st.booleans(), FLOATS), max_size=4))
    n = len(balance) if a.good else 3
    devices = a.ok(st.none() | st.just(["cpu"] * n) | st.just([torch.device("cpu")] * (n + 1)),
                   near=st.lists(st.sampled_from(["cpu", "meta!", "gpu", 0.5, None]), max_size=3))
    chunks = a.ok(st.integers(1, 4), near=st.integers(-2, 0) | HUGE | FLOATS)
    checkpoint = a.ok(MODES, near=TEXT)
    which = a.valid(st.sampled_from(["Pipe", "GPipe", "split_module"]))
    if which == "split_module":
        return lambda: pl.split_module(module, balance, chunks=chunks, checkpoint=checkpoint)
    return lambda: getattr(pl, which)(module, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)


def balance_cost(a: Args) -> Call:
    cost = a.ok(st.lists(st.floats(0, 10), min_size=3, max_size=5),
                near=st.lists(st.one_of(FLOATS, SMALL_INTS, TEXT), max_size=4))
    partitions = a.ok(st.integers(1, 3), near=st.integers(-1, 0) | HUGE)
    return lambda: pl.balance_cost(cost, partitions)


def balance_by(a: Args) -> Call:
    partitions = a.ok(st.integers(1, 3), near=st.integers(-1, 0) | HUGE)
    module = a.ok(st.builds(seq3))
    sample = a.ok(st.just(torch.ones(4, 4)))
    device = a.ok(st.just("cpu"))
    if a.valid(st.booleans()):
        # a valid timeout profiles that long: only 0 is drawn valid, and no large number as junk
        timeout = a.ok(st.just(0.0), near=st.sampled_from([math.nan, math.inf, -math.inf, -1.0]),
                       junk=JUNK.filter(lambda v: not (isinstance(v, (int, float)) and v > 0.001)))
        return lambda: pl.balance_by_time(partitions, module, sample, timeout=timeout, device=device)
    chunks = a.ok(st.integers(1, 4), near=st.integers(-1, 0))
    scale = a.ok(st.floats(0, 4), near=FLOATS)
    return lambda: pl.balance_by_size(partitions, module, sample, chunks=chunks, param_scale=scale, device=device)


def microbatches(a: Args) -> Call:
    which = a.valid(st.sampled_from(["scatter", "gather", "check", "Batch"]))
    value = a.ok(st.just(torch.ones(4, 2)) | st.just((torch.ones(4), "flag")))
    if which == "scatter":
        chunks = a.ok(st.integers(1, 5), near=st.integers(-1, 0) | HUGE)
        return lambda: pl.scatter(value, chunks)
    if which == "gather":
        outputs = a.ok(st.just([pl.Batch(torch.ones(2))] * 2), near=st.just([]))
        return lambda: pl.gather(outputs)
    return lambda: getattr(pl, which)(value)


def schedules(a: Args) -> Call:
    which = a.valid(st.sampled_from(["gpipe", "1f1b", "interleaved", "clock_cycles", "action"]))
    size = st.integers(1, 6)
    near = st.integers(-2, 0) | HUGE
    if which == "action":
        kind = a.ok(st.sampled_from(["F", "B"]), near=TEXT)
        return lambda: pl.Action(kind, 0, 0)
    if which == "clock_cycles":
        m = a.ok(size, near=st.integers(-2, 0), junk=MODEST)
        n = a.ok(size, near=st.integers(-2, 0), junk=MODEST)
        return lambda: pl.clock_cycles(m, n)
    if which == "interleaved":
        ranks = a.ok(st.just(2), near=near)
        virtual = a.ok(size, near=near)
        m = a.ok(st.sampled_from([2, 4]), near=near)
        return lambda: pl.ScheduleInterleaved1F1B(ranks, virtual, m)
    stages = a.ok(size, near=near)
    m = a.ok(size, near=near)
    cls = pl.ScheduleGPipe if which == "gpipe" else pl.Schedule1F1B
    return lambda: cls(stages, m)


def schedule_queries(a: Args) -> Call:
    schedule = a.valid(st.sampled_from([pl.ScheduleGPipe(3, 2), pl.Schedule1F1B(2, 4),
                                        pl.ScheduleInterleaved1F1B(2, 2, 2)]))
    method = a.valid(st.sampled_from(["stage_rank", "rank_stages", "rank_order"]))
    index = a.ok(st.integers(0, 1), near=st.integers(-2, 9) | HUGE)
    return lambda: getattr(schedule, method)(index)


def timeline(a: Args) -> Call:
    tl = pl.Timeline.from_schedule(pl.ScheduleGPipe(2, 2))
    which = a.valid(st.sampled_from(["record", "render_text", "png_size"]))
    if which == "record":
        kind = a.ok(st.sampled_from(["F", "B"]), near=TEXT)
        start = a.ok(st.floats(0, 1))
        end = a.ok(st.floats(1, 2))
        return lambda: tl.record(0, 0, 0, kind, start, end)
    width = a.ok(st.integers(1, 100), near=st.integers(-5, 0))
    return lambda: getattr(tl, which)(width)


def deferred_batch_norm(a: Args) -> Call:
    chunks = a.ok(st.integers(1, 4), near=st.integers(-2, 0) | HUGE)
    if a.valid(st.booleans()):
        return lambda: pl.DeferredBatchNorm(4, chunks=chunks)
    return lambda: pl.DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(4)), chunks)


def pipeline_stage(a: Args) -> Call:
    partition = a.ok(st.builds(seq3))
    index = a.ok(st.integers(0, 1), near=st.integers(-2, 4) | HUGE)
    stages = a.ok(st.just(2), near=st.integers(-1, 1) | HUGE)
    rank = a.ok(st.integers(0, 3), near=st.integers(-2, -1))
    return lambda: pl.PipelineStage(partition, index, stages, rank)


def distributed_pipe(a: Args) -> Call:
    module = a.ok(st.builds(seq3))
    balance = a.ok(BALANCES, near=st.lists(st.one_of(st.integers(-1, 4), FLOATS), max_size=3))
    mesh = a.bad_one()  # a valid mesh would start processes
    schedule = a.ok(st.sampled_from(["gpipe", "1f1b", "interleaved"]), near=TEXT)
    chunks = a.ok(st.integers(1, 4), near=st.integers(-1, 0) | HUGE)
    return lambda: pl.DistributedPipe(module, balance, mesh, schedule=schedule, chunks=chunks)


def skippable(a: Args) -> Call:
    stash = a.ok(st.lists(st.sampled_from(["x", "y"]), max_size=2), near=st.lists(st.one_of(TEXT, SMALL_INTS), max_size=2))
    pop = a.ok(st.lists(st.sampled_from(["z"]), max_size=1), near=TEXT)
    return lambda: pl.skippable(stash=stash, pop=pop)(nn.Identity)


@pl.skippable(stash=["x"])
class Stash(nn.Module):
    def forward(self, t: torch.Tensor) -> Any:
        yield pl.stash("x", t)
        return t


def isolate(a: Args) -> Call:
    ns = a.ok(st.builds(pl.Namespace))
    only = a.ok(st.none() | st.just(["x"]), near=st.lists(TEXT, max_size=2))
    return lambda: Stash().isolate(ns, only=only)


def verify_skippables(a: Args) -> Call:
    module = a.ok(st.builds(seq3))
    which = a.valid(st.sampled_from(["verify_skippables", "inspect_skip_layout"]))
    if which == "inspect_skip_layout":
        partitions = a.ok(st.just([seq3(), seq3()]), near=st.lists(st.one_of(st.builds(seq3), SMALL_INTS), max_size=2))
        return lambda: pl.inspect_skip_layout(partitions)
    return lambda: pl.verify_skippables(module)


# tensors ----------------------------------------------------------------------------------------


def tensors(a: Args) -> Call:
    t = a.ok(st.just(torch.ones(4, 2)))
    mesh = a.bad_one(NOT_NONE)  # None reads the current mesh; a valid mesh would start processes
    placements = a.ok(st.none() | st.just([Replicate()]), near=near_placements())
    if a.valid(st.booleans()):
        return lambda: sw.distribute_tensor(t, mesh, placements)
    return lambda: sw.from_local(t, mesh, placements)


def factories(a: Args) -> Call:
    size = a.ok(st.tuples(st.integers(0, 4), st.integers(0, 4)), near=int_tuples(lo=-3))
    mesh = a.bad_one(NOT_NONE)
    which = a.valid(st.sampled_from(["zeros", "ones", "empty", "rand", "randn", "full"]))
    if which == "full":
        return lambda: sw.full(size, 1.0, device_mesh=mesh)
    return lambda: getattr(sw, which)(size, device_mesh=mesh)


def manual_seed(a: Args) -> Call:
    seed = a.ok(st.integers(0, 2**32), near=HUGE | st.integers(-5, -1))

    def call() -> None:
        before = _random._STATE.generator
        try:
            sw.manual_seed(seed)
        finally:
            _random._STATE.generator = before

    return call


# -- regressions: what the property found, pinned (each id says what was raised before) --------------

REGRESSIONS = [
    ("abstract_mesh_names_5_raised_int_not_iterable", lambda: AbstractMesh((2,), 5), TypeError, "got 5"),
    ("plan_for_bandwidth_0_raised_zero_division", lambda: sw.plan_for(AbstractMesh((2,)), (4,), [Shard(0)],
     [Replicate()], bandwidth=[0.0]), ValueError, "bandwidth (0.0,)"),
    ("plan_for_dtype_2_raised_attribute_error", lambda: sw.plan_for(AbstractMesh((2,)), (4,), [Shard(0)],
     [Replicate()], dtype=2), TypeError, "got 2"),
    ("explain_redistribute_shape_a_raised_bad_operand", lambda: sw.explain_redistribute((2,), ("a",), [Shard(0)],
     [Replicate()]), TypeError, "('a',)"),
    ("shard_order_5_raised_cannot_unpack", lambda: sw.plan_for(AbstractMesh((2,)), (4,), [Shard(0)], [Replicate()],
     src_shard_order=5), TypeError, "got 5"),
    ("mesh_ragged_device_ids_raised_numpys_message", lambda: spmd.Mesh([0, [1]], (2,)), TypeError, "[0, [1]]"),
    ("plan_validate_mesh_0_raised_attribute_error", lambda: par.ShardingPlan({}).validate(Block(), 0), TypeError,
     "got 0 (int)"),
    ("megatron_module_0_raised_attribute_error", lambda: par.MegatronPlanner().build_plan(0), TypeError, "got 0 (int)"),
    ("pipe_chunks_inf_raised_overflow", lambda: pl.Pipe(seq3(), [3], chunks=math.inf), ValueError, "chunks: inf"),
    ("pipe_device_gpu_raised_runtime_error", lambda: pl.Pipe(seq3(), [3], devices=["gpu"]), ValueError, "'gpu'"),
    ("pipe_too_few_devices_raised_index_error", lambda: pl.Pipe(seq3(), [2, 1], devices=[]), ValueError, "[]"),
    ("balance_cost_1e300_raised_overflow", lambda: pl.balance_cost([1e300, 1.0, 1.0], 2), None, ""),
    ("balance_by_time_nan_timeout_profiled_forever", lambda: pl.balance_by_time(1, seq3(), torch.ones(2, 4),
     timeout=math.nan), ValueError, "timeout=nan"),
    ("scatter_2_63_chunks_raised_overflow", lambda: pl.scatter(torch.ones(3), 2**63), None, ""),
    ("render_text_width_2_64_raised_overflow", lambda: pl.Timeline.from_schedule(pl.ScheduleGPipe(2, 2)).render_text(2**64), ValueError, str(2**64)),
    ("stage_rank_a_raised_unorderable", lambda: pl.ScheduleGPipe(2, 2).stage_rank("a"), ValueError, "'a'"),
    ("verify_skippables_0_raised_attribute_error", lambda: pl.verify_skippables(0), TypeError, "got 0 (int)"),
    ("skippable_unhashable_names_raised_unhashable", lambda: pl.skippable(stash=[[]]), TypeError, "[]"),
    ("manual_seed_2_64_raised_overflow_unpacking", lambda: sw.manual_seed(2**64), ValueError, str(2**64)),
]


@pytest.mark.parametrize("call, error, named", [r[1:] for r in REGRESSIONS], ids=[r[0] for r in REGRESSIONS])
def test_found_by_the_property(call: Call, error: Optional[type[Exception]], named: str) -> None:
    before = _random._STATE.generator
    try:
        if error is None:
            call()  # valid, and used to raise
        else:
            with pytest.raises(error) as info:
                call()
            assert named in str(info.value)
    finally:
        _random._STATE.generator = before


# -- the test ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    build: Callable[[Args], Call]
    examples: int

    @property
    def name(self) -> str:
        return self.build.__name__


CASES = [
    Case(shard, 60), Case(partial, 40),
    Case(abstract_mesh, 100), Case(mesh_dim_lookup, 30), Case(init_device_mesh, 40),
    Case(explain_redistribute, 80), Case(plan_for, 80),
    Case(spmd_mesh, 60), Case(hybrid_mesh, 60), Case(get_1d_mesh, 20), Case(set_global_mesh, 20),
    Case(sharding_spec, 60), Case(shard_indices, 30), Case(mark_sharding, 30), Case(clear_sharding, 15),
    Case(manual_sharding, 40), Case(shard_map, 20), Case(mark_sharding_module, 25),
    Case(linear_styles, 60), Case(sequence_parallel, 30), Case(prepare_module_input, 50), Case(prepare_module_output, 40),
    Case(sharding_plan, 60), Case(plan_validate, 60), Case(shard_module, 30), Case(data_parallel, 20),
    Case(module_helpers, 40), Case(global_mean, 15),
    Case(pipe, 80), Case(balance_cost, 40), Case(balance_by, 30), Case(microbatches, 50), Case(schedules, 60),
    Case(schedule_queries, 40), Case(timeline, 30), Case(deferred_batch_norm, 20), Case(pipeline_stage, 30),
    Case(distributed_pipe, 30), Case(skippable, 30), Case(isolate, 20), Case(verify_skippables, 30),
    Case(tensors, 40), Case(factories, 40), Case(manual_seed, 30),
]


def test_at_least_1000_malformed_calls() -> None:
    assert sum(c.examples for c in CASES) >= 1000  # 1,815; each case checks that it ran its share
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_arguments_raise_value_or_type_errors_naming_them(case: Case) -> None:
    ran = 0

    @settings(max_examples=case.examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        nonlocal ran
        args = Args(data)
        call = case.build(args)
        ran += 1
        expect_clean_failure(call, args.bad, case.name)

    prop()
    assert ran >= case.examples, f"{case.name}: Hypothesis ran {ran} examples, fewer than {case.examples}"
