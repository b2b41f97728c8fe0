"""ShardingSpec: tile assignment, replication groups, group assignment and type against torch_xla's
worked (4, 2) table and against a naive oracle that loops over mesh coordinates; each device's
shard slices against shardwise's layout math and torch.chunk; the per-spec cache."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardwise.spmd._sharding_spec as _sharding_spec
from shardwise import DTensor, Replicate, Shard
from shardwise._layout import local_shape_and_offset
from shardwise._partition_spec import from_placements, to_placements
from shardwise.spmd._mesh import Mesh
from shardwise.spmd._sharding_spec import ShardingSpec, ShardingType
from shardwise.testing import run_distributed

from ..oracle import local_piece

R, T, P = ShardingType.REPLICATED, ShardingType.TILED, ShardingType.PARTIAL
MESH_42 = Mesh(list(range(8)), (4, 2), ("x", "y"))
SINGLETONS = [[i] for i in range(8)]

# spmd-anchors.md §1.2, `Mesh(range(8), (4, 2), ('x', 'y'))`: every row of the worked table.
# (partition spec, type, tile assignment (None: unused), replication groups, group assignment)
TABLE_42: list[tuple[tuple[Any, ...], ShardingType, Optional[list[Any]], list[Any], list[Any]]] = [
    ((0, 1), T, [[0, 1], [2, 3], [4, 5], [6, 7]], [], []),
    ((1, 0), T, [[0, 2, 4, 6], [1, 3, 5, 7]], [], []),
    ((0, None), P, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]], [[0], [1], [2], [3]]),
    ((None, 0), P, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1, 2, 3]]),
    ((1, None), P, [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]], [[0], [1]]),
    ((None, 1), P, [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1]]),
    ((None, None), R, None, [], []),
    ((("x", "y"), None), P, list(range(8)), SINGLETONS, SINGLETONS),
    ((("y", "x"), None), P, [0, 2, 4, 6, 1, 3, 5, 7], [[0], [2], [4], [6], [1], [3], [5], [7]], SINGLETONS),
    ((0,), P, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 2, 3]),
    (((0, 1),), T, list(range(8)), [], []),
]


@pytest.mark.parametrize("spec, kind, tile, groups, assignment", TABLE_42, ids=[str(r[0]) for r in TABLE_42])
def test_every_row_of_the_worked_4x2_table(
    spec: tuple[Any, ...], kind: ShardingType, tile: Optional[list[Any]], groups: list[Any], assignment: list[Any]
) -> None:
    s = ShardingSpec(MESH_42, spec)
    assert s.sharding_type is kind
    if tile is not None:
        assert s.tile_assignment == tile
    assert s.replication_groups == groups
    assert s.group_assignment == assignment
    # named and indexed spellings of one spec give the same values
    named = tuple(_names(e, ("x", "y")) for e in spec)
    assert _values(ShardingSpec(MESH_42, named)) == _values(s)


def _names(entry: Any, names: Sequence[str]) -> Any:
    if isinstance(entry, int):
        return names[entry]
    if isinstance(entry, tuple):
        return tuple(names[a] if isinstance(a, int) else a for a in entry)
    return entry


def _values(s: ShardingSpec) -> tuple[Any, ...]:
    return s.sharding_type, s.tile_assignment, s.replication_groups, s.group_assignment


# -- the naive oracle: loop over mesh coordinates ---------------------------------------------


def oracle(mesh: Mesh, spec: Sequence[Any]) -> tuple[ShardingType, list[Any], list[Any], list[Any]]:
    """(type, tile assignment, replication groups, group assignment) by visiting every device."""
    names = list(mesh.axis_names or ())
    shape = mesh.mesh_shape
    entries = [
        () if e is None else tuple(names.index(a) if isinstance(a, str) else a for a in (e if isinstance(e, tuple) else (e,)))
        for e in spec
    ]
    tiled = [ms for ms in entries if ms]
    unused = [m for m in range(len(shape)) if all(m not in ms for ms in entries)]
    tile_counts = [math.prod(shape[m] for m in ms) for ms in tiled]
    tile = np.full(tile_counts + [shape[m] for m in unused], -1)
    holders: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    logical = mesh.get_logical_mesh()
    for coord in itertools.product(*(range(n) for n in shape)):
        device = int(logical[coord])
        # the device's tile along each split tensor dim: its coordinates on that entry's axes, major first
        which = tuple(_row_major([coord[m] for m in ms], [shape[m] for m in ms]) for ms in tiled)
        rest = tuple(coord[m] for m in unused)
        tile[which + rest] = device
        holders.setdefault(which, []).append((rest, device))
    if not entries:
        kind = ShardingType.REPLICATED
    elif len(tiled) + len(unused) > len(entries):
        kind = ShardingType.PARTIAL
    elif mesh.size() == 1:
        kind = ShardingType.MAXIMAL
    elif not tiled:
        kind = ShardingType.REPLICATED
    elif len(tiled) < len(entries):
        kind = ShardingType.PARTIAL
    else:
        kind = ShardingType.TILED
    if kind is not ShardingType.PARTIAL:
        return kind, tile.tolist(), [], []
    order = list(itertools.product(*(range(n) for n in tile_counts)))  # group ids: row-major over tiles
    groups = [[dev for _, dev in sorted(holders[w])] for w in order]
    assignment = np.zeros([tile_counts[len([x for x in entries[:d] if x])] if ms else 1 for d, ms in enumerate(entries)],
                          dtype=int)
    for index in itertools.product(*(range(n) for n in assignment.shape)):
        which = tuple(i for i, ms in zip(index, entries) if ms)
        assignment[index] = order.index(which)
    return kind, tile.tolist(), groups, assignment.tolist()


def _row_major(coords: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coords, sizes):
        index = index * n + c
    return index


def all_specs(mesh: Mesh, tensor_ndim: int) -> Iterator[tuple[Any, ...]]:
    """Every partition spec: each mesh axis unused or splitting some tensor dim, in every order."""
    k = len(mesh.mesh_shape)
    for owner in itertools.product(range(-1, tensor_ndim), repeat=k):
        per_dim = [[m for m in range(k) if owner[m] == d] for d in range(tensor_ndim)]
        for orders in itertools.product(*(itertools.permutations(ms) for ms in per_dim)):
            yield tuple(None if not ms else ms[0] if len(ms) == 1 else tuple(ms) for ms in orders)


MESHES = [
    Mesh(list(range(8)), (4, 2), ("x", "y")),
    Mesh(list(range(8)), (2, 2, 2), ("a", "b", "c")),
    Mesh([5, 2, 7, 0, 3, 6, 1, 4], (2, 2, 2)),  # a custom device order
    Mesh([3, 0, 5, 1, 4, 2], (2, 3), ("r", "c")),
    Mesh(list(range(4)), (4,), ("d",)),
    Mesh([0], (1,)),
    Mesh([0], (1, 1)),
]


@pytest.mark.parametrize("mesh", MESHES, ids=repr)
@pytest.mark.parametrize("tensor_ndim", [0, 1, 2, 3])
def test_every_spec_matches_the_coordinate_oracle(mesh: Mesh, tensor_ndim: int) -> None:
    # covers 3-D tensors on 2-D meshes, 2-D tensors on 3-D meshes, tuple entries in every order
    count = 0
    for spec in all_specs(mesh, tensor_ndim):
        s = ShardingSpec(mesh, spec)
        assert _values(s) == oracle(mesh, spec), spec
        count += 1
    assert count >= 1


def test_scalars_and_one_device_meshes_follow_torch_xla() -> None:
    assert ShardingSpec(MESH_42, ()).sharding_type is ShardingType.REPLICATED
    assert ShardingSpec(Mesh([0], (1,)), (0,)).sharding_type is ShardingType.MAXIMAL
    assert ShardingSpec(Mesh([0], (1,)), (None, None)).sharding_type is ShardingType.MAXIMAL
    # a spec that leaves mesh axes unused is partial replication, None entry or not
    assert ShardingSpec(MESH_42, (None,)).sharding_type is ShardingType.PARTIAL
    assert ShardingSpec(MESH_42, (None,)).replication_groups == [list(range(8))]
    assert int(ShardingType.PARTIAL) == 5 and [t.value for t in ShardingType] == list(range(7))


# -- shard slices: from the tile assignment, equal to the layout math and torch.chunk ------------

SHAPES = {1: [(8,), (5,), (3,)], 2: [(8, 4), (7, 5), (2, 3)], 3: [(4, 6, 2), (5, 3, 7)]}


@pytest.mark.parametrize("mesh", MESHES[:4], ids=repr)
@pytest.mark.parametrize("tensor_ndim", [0, 1, 2, 3])
def test_shard_indices_equal_the_layout_math(mesh: Mesh, tensor_ndim: int) -> None:
    logical = mesh.get_logical_mesh()
    for spec in all_specs(mesh, tensor_ndim):
        s = ShardingSpec(mesh, spec)
        placements, order = to_placements(spec, mesh.mesh_shape, mesh.axis_names, tensor_ndim)
        assert (s.placements, s.shard_order) == (placements, order)
        for shape in SHAPES.get(tensor_ndim, [()]):
            full = torch.arange(math.prod(shape)).reshape(shape)
            indices = s.shard_indices(shape)
            assert sorted(indices) == list(range(mesh.size()))
            for coord in itertools.product(*(range(n) for n in mesh.mesh_shape)):
                got = indices[int(logical[coord])]
                local, offset = local_shape_and_offset(shape, mesh.mesh_shape, placements, coord, order)
                assert got == tuple(slice(o, o + n) for o, n in zip(offset, local)), (spec, shape, coord)
                assert torch.equal(full[got], local_piece(full, mesh.mesh_shape, placements, coord, dict(order)))


def test_shard_indices_of_the_4x2_table_rows_on_an_even_shape() -> None:
    # (0, None) on (8, 32): devices {2r, 2r + 1} both hold rows [2r:2r + 2]
    indices = ShardingSpec(MESH_42, (0, None)).shard_indices((8, 32))
    assert all(indices[d] == (slice(d // 2 * 2, d // 2 * 2 + 2), slice(0, 32)) for d in range(8))
    # ('y', 'x') as one dim: the tile order 0, 2, 4, 6, 1, 3, 5, 7 gives rows in that order
    indices = ShardingSpec(MESH_42, (("y", "x"), None)).shard_indices((16, 2))
    assert [indices[d][0].start for d in (0, 2, 4, 6, 1, 3, 5, 7)] == list(range(0, 16, 2))


def test_shard_indices_rejects_a_shape_of_another_rank() -> None:
    with pytest.raises(ValueError, match=r"global shape \(8,\) has 1 dims but partition spec \(0, None\) has 2 entries"):
        ShardingSpec(MESH_42, (0, None)).shard_indices((8,))


# -- cache, value semantics, validation ---------------------------------------------------------


def test_sharding_args_are_computed_once_per_distinct_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = _sharding_spec._tile_assignment

    def counting(mesh: Mesh, dims: Any) -> Any:
        calls.append(dims)
        return real(mesh, dims)

    monkeypatch.setattr(_sharding_spec, "_tile_assignment", counting)
    _sharding_spec.sharding_args.cache_clear()
    mesh = Mesh([1, 0, 3, 2], (2, 2), ("p", "q"))
    same_mesh = Mesh(np.array([1, 0, 3, 2]), [2, 2], ["p", "q"])
    for m in (mesh, same_mesh):
        for spec in [("p", None), (0, None), [["p"], None], (None, "q"), (None, 1), (("q", "p"),)]:
            s = ShardingSpec(m, spec)
            s.tile_assignment, s.replication_groups, s.group_assignment, s.sharding_type  # noqa: B018
    assert len(calls) == 3  # ("p", None) in three spellings, (None, "q") in two, (("q", "p"),)
    monkeypatch.undo()
    _sharding_spec.sharding_args.cache_clear()


def test_sharding_spec_is_a_frozen_value_and_returns_copies() -> None:
    a = ShardingSpec(MESH_42, [["x", "y"], None])
    assert a.partition_spec == (("x", "y"), None)
    assert a == ShardingSpec(Mesh(range(8), (4, 2), ("x", "y")), (("x", "y"), None))
    assert hash(a) == hash(eval(repr(a)))
    with pytest.raises(AttributeError):
        a.minibatch = True  # type: ignore[misc]
    a.tile_assignment.append(99)
    assert a.tile_assignment == list(range(8))
    assert ShardingSpec(MESH_42, (0, None), minibatch=True).minibatch


def test_sharding_spec_validation_names_the_values() -> None:
    with pytest.raises(ValueError, match=r"names mesh dim 'z', which does not exist: the mesh's dims are \('x', 'y'\)"):
        ShardingSpec(MESH_42, ("z", None))
    with pytest.raises(ValueError, match="uses mesh dim 'x' for tensor dims 0 and 1"):
        ShardingSpec(MESH_42, ("x", "x"))
    with pytest.raises(ValueError, match="names mesh dim 2, out of range for a 2-D mesh"):
        ShardingSpec(MESH_42, (2, None))
    with pytest.raises(TypeError, match="nested tuple"):
        ShardingSpec(MESH_42, ((("x",), "y"),))
    with pytest.raises(TypeError, match=r"takes a shardwise.spmd.Mesh, got \(4, 2\) \(tuple\)"):
        ShardingSpec((4, 2), (0, None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="minibatch"):
        ShardingSpec(MESH_42, (0, None), minibatch="yes")  # type: ignore[arg-type]


def test_can_apply_checks_the_rank() -> None:
    s = ShardingSpec(MESH_42, (0, None))
    assert s.can_apply(torch.zeros(8, 4)) and not s.can_apply(torch.zeros(8)) and not s.can_apply(torch.zeros(2, 2, 2))


def test_placements_round_trip_to_the_partition_spec() -> None:
    for spec in all_specs(MESH_42, 2):
        s = ShardingSpec(MESH_42, spec)
        named = tuple(_names(e, ("x", "y")) for e in spec)
        assert from_placements(s.placements, s.shard_order, MESH_42.axis_names, 2) == named
    assert ShardingSpec(MESH_42, (("y", "x"),)).placements == (Shard(0), Shard(0))
    assert ShardingSpec(MESH_42, (("y", "x"),)).shard_order == ((0, (1, 0)),)
    assert ShardingSpec(MESH_42, (None, "y")).placements == (Replicate(), Shard(1))


# -- apply: mark_sharding on four ranks ---------------------------------------------------------


def _apply_body() -> None:
    mesh = Mesh(list(range(4)), (2, 2), ("dp", "tp"))
    rank = dist.get_rank()
    full = torch.arange(35.0).reshape(5, 7)  # uneven on both meshes' splits
    for spec in [(("tp", "dp"), None), ("dp", "tp"), (None, "tp")]:
        s = ShardingSpec(mesh, spec)
        out = s.apply(full)
        assert isinstance(out, DTensor) and tuple(out.placements) == s.placements
        assert torch.equal(out.to_local(), full[s.shard_indices(full.shape)[rank]])
        assert torch.equal(out.full_tensor(), full)


def test_apply_marks_the_tensor_with_this_spec() -> None:
    from shardwise.spmd import _mark

    if not hasattr(_mark, "mark_sharding"):
        pytest.skip("shardwise.spmd.mark_sharding is not written yet (another helper's _mark.py): the lead runs this")
    run_distributed(_apply_body, 4)


@pytest.mark.parametrize("spec", [0, "xy", None])
def test_a_partition_spec_that_is_not_a_sequence_is_a_type_error_naming_it(spec: Any) -> None:
    # Regression: ShardingSpec(mesh, 0) raised "object of type 'int' has no len()"
    with pytest.raises(TypeError, match=r"one entry per tensor dim .*got " + repr(spec).replace("'", "'")):
        ShardingSpec(MESH_42, spec)
