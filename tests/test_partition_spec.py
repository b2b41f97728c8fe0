"""Partition specs <-> placements (`shardwise._partition_spec`): every validation rule raises
ValueError/TypeError naming the values, and both round trips are the identity (hypothesis over
mesh ranks 1-3, tensor ranks 0-4, names or indices, tuple entries in either order, unused mesh
dims), with the parallel plan's layouts going through the same conversion."""

from __future__ import annotations

from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._layout import normalize_shard_order
from shardwise._partition_spec import from_placements, normalize_partition_spec, to_placements
from shardwise.parallel import _plan

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPE, NAMES = (2, 4), ("x", "y")


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["x", 3, None, {0}])
def test_a_spec_that_is_not_a_sequence_is_a_type_error(spec: Any) -> None:
    with pytest.raises(TypeError, match=rf"a partition spec is a tuple with one entry per tensor dim .*got {spec!r}"):
        normalize_partition_spec(spec, SHAPE, NAMES, 1)


def test_the_spec_length_must_match_the_tensor_rank() -> None:
    with pytest.raises(ValueError, match=r"partition spec \(0, None, None\) has 3 entries for a 2-D tensor: give exactly one"):
        to_placements((0, None, None), SHAPE, NAMES, 2)
    with pytest.raises(ValueError, match=r"partition spec \('x',\) has 1 entries for a 2-D tensor: give exactly one"):
        to_placements(("x",), SHAPE, NAMES, 2)
    with pytest.raises(ValueError, match=r"has 3 entries for a 2-D tensor: give at most one entry per tensor dim"):
        to_placements((0, None, None), SHAPE, NAMES, 2, exact_length=False)
    # without exact_length, missing trailing entries are None
    assert to_placements(("y",), SHAPE, NAMES, 3, exact_length=False) == ((Replicate(), Shard(0)), ())
    assert normalize_partition_spec((), SHAPE, NAMES, 2, exact_length=False) == ((), ())


@pytest.mark.parametrize(
    "spec, message",
    [
        ((((0,), 1),), r"has a nested tuple inside an entry"),
        ((1.5,), r"has 1.5 \(float\) inside an entry"),
        ((True, None), r"has True \(bool\) inside an entry"),
        (([0], None), r"has \[0\] \(list\) inside an entry"),
        ((("x", 2.0),), r"has 2.0 \(float\) inside an entry"),
    ],
)
def test_entries_of_the_wrong_kind_are_type_errors(spec: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message + ": an entry is None, a mesh dim index or name, or a flat tuple"):
        normalize_partition_spec(spec, SHAPE, NAMES, len(spec))


@pytest.mark.parametrize(
    "spec, names, message",
    [
        (("z", None), NAMES, r"partition spec \('z', None\) names mesh dim 'z', which does not exist: the mesh's dims are \('x', 'y'\)"),
        (("x", None), None, r"names mesh dim 'x', which does not exist: the mesh has no dim names"),
        ((2, None), NAMES, r"names mesh dim 2, out of range for a 2-D mesh: use an index in \[0, 1\] or a dim name"),
        ((None, -1), NAMES, r"names mesh dim -1, out of range for a 2-D mesh"),
        (("x", "x"), NAMES, r"partition spec \('x', 'x'\) uses mesh dim 'x' for tensor dims 0 and 1: a mesh dim splits at most one"),
        ((0, "x"), NAMES, r"uses mesh dim 'x' for tensor dims 0 and 1"),
        (((1, 1),), None, r"uses mesh dim 1 for tensor dims 0 and 0"),
        ((("y", "x"), "y"), NAMES, r"uses mesh dim 'y' for tensor dims 0 and 1"),
    ],
)
def test_unknown_out_of_range_and_reused_mesh_dims_are_value_errors(
    spec: Any, names: Optional[tuple[str, ...]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        to_placements(spec, SHAPE, names, len(spec))


def test_a_pending_reduction_has_no_partition_spec() -> None:
    with pytest.raises(ValueError, match=r"placements \('S\(0\)', 'P\(sum\)'\) hold a pending reduction P\(sum\) on mesh dim 1"):
        from_placements((Shard(0), Partial()), (), NAMES, 2)


# -- round trips --------------------------------------------------------------------------------


@st.composite
def specs(draw: st.DrawFn) -> tuple[tuple[Any, ...], tuple[int, ...], Optional[tuple[str, ...]], int, tuple[Any, ...]]:
    """(spec as written, mesh shape, mesh names, tensor rank, the canonical spec from_placements gives)."""
    k = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=k, max_size=k)))
    names = ("a", "bb", "c")[:k] if draw(st.booleans()) else None
    ndim = draw(st.integers(0, 4))
    owner = draw(st.lists(st.integers(-1, ndim - 1), min_size=k, max_size=k))  # -1: unused (partial replication)
    written: list[Any] = []
    canonical: list[Any] = []
    for d in range(ndim):
        axes = draw(st.permutations([m for m in range(k) if owner[m] == d]))  # tuple entries in any order
        spelled = tuple(names[m] if names and draw(st.booleans()) else m for m in axes)  # names, indices or a mix
        labels = tuple(names[m] for m in axes) if names else tuple(axes)
        if not axes:
            written.append(draw(st.sampled_from([None, ()])))
            canonical.append(None)
        elif len(axes) == 1:
            written.append(spelled if draw(st.booleans()) else spelled[0])
            canonical.append(labels[0])
        else:
            written.append(spelled)
            canonical.append(labels)
    return tuple(written), shape, names, ndim, tuple(canonical)


@SETTINGS
@given(specs())
def test_spec_to_placements_to_spec_is_the_identity(case: tuple[Any, ...]) -> None:
    spec, shape, names, ndim, canonical = case
    placements, order = to_placements(spec, shape, names, ndim)
    assert from_placements(placements, order, names, ndim) == canonical
    # the canonical spelling itself round-trips exactly, and gives the same layout
    assert to_placements(canonical, shape, names, ndim) == (placements, order)
    assert from_placements(*to_placements(canonical, shape, names, ndim), names, ndim) == canonical
    # the layout is what the spec says: each named mesh dim shards its tensor dim, in the written order
    for d, entry in enumerate(canonical):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        dims = tuple(names.index(a) if isinstance(a, str) else a for a in axes)
        assert all(placements[m] == Shard(d) for m in dims)
        want = dict(order).get(d, tuple(sorted(dims)))
        assert want == dims
    named_dims = {m for e in normalize_partition_spec(spec, shape, names, ndim) for m in e}
    assert all(placements[m] == Replicate() for m in range(len(shape)) if m not in named_dims)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[Placement, ...], Any, Optional[tuple[str, ...]], int]:
    """(placements, split order as a dict, mesh names, tensor rank): Shard/Replicate, any split order."""
    k = draw(st.integers(1, 3))
    ndim = draw(st.integers(0, 4))
    names = ("p", "q", "r")[:k] if draw(st.booleans()) else None
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    placements = tuple(draw(st.lists(st.sampled_from(choices), min_size=k, max_size=k)))
    order = {}
    for d in range(ndim):
        ms = [m for m, p in enumerate(placements) if p == Shard(d)]
        if len(ms) > 1:
            order[d] = tuple(draw(st.permutations(ms)))
    return placements, order, names, ndim


@SETTINGS
@given(layouts(), st.lists(st.integers(1, 3), min_size=3, max_size=3))
def test_placements_to_spec_to_placements_is_the_identity(layout: tuple[Any, ...], sizes: list[int]) -> None:
    placements, order, names, ndim = layout
    shape = tuple(sizes[: len(placements)])
    canonical_order = normalize_shard_order(placements, order, ndim)
    spec = from_placements(placements, canonical_order, names, ndim)
    assert len(spec) == ndim
    assert to_placements(spec, shape, names, ndim) == (placements, canonical_order)


@SETTINGS
@given(specs())
def test_plan_layouts_use_the_same_conversion(case: tuple[Any, ...]) -> None:
    _, shape, names, ndim, canonical = case
    if names is None:
        return  # plans name mesh dims
    mesh = AbstractMesh(shape, names)
    for cut in range(ndim + 1):  # plans may leave trailing tensor dims out
        spec = canonical[:cut]
        if any(e is not None for e in canonical[cut:]):
            continue
        lay = _plan.to_layout(spec, mesh, ndim)
        got = (lay.placements, lay.shard_order)
        assert got == to_placements(spec, shape, names, ndim, exact_length=False)
        assert got == to_placements(canonical, shape, names, ndim)
