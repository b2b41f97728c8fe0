"""Layout math (`shardwise._layout`) checked against the naive oracle in `tests/oracle.py`.

Random meshes (1-3 dims of size 1-4), tensors (0-3 dims of size 0-9, so dims smaller than
the mesh and empty trailing pieces are common), placements (negative Shard dims included)
and split orders: every rank's shape and offset must be exactly the piece `torch.chunk`
gives, the pieces must tile the tensor once per replica, and the max piece must be the
elementwise max.
"""

from __future__ import annotations

import doctest
import math
import re
from collections.abc import Mapping, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise import Partial, Placement, Replicate, Shard, _layout
from shardwise._layout import (
    chunk_range,
    global_shape_from_local,
    local_shape_and_offset,
    max_local_shape,
    normalize_placements,
    normalize_shard_order,
    split_orders,
)

from .oracle import assemble, coordinates, local_piece

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...], dict[int, tuple[int, ...]]]


@st.composite
def layouts(draw: st.DrawFn, partial: bool = True) -> Layout:
    """(mesh_shape, global_shape, raw placements, normalized placements, split-order mapping)."""
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    global_shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    ndim = len(global_shape)
    choices: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if partial:
        choices.append(st.sampled_from(["sum", "avg", "max", "min"]).map(Partial))
    if ndim:
        choices.append(st.integers(-ndim, ndim - 1).map(Shard))
    raw = tuple(draw(st.one_of(*choices)) for _ in mesh_shape)
    placements = normalize_placements(raw, len(mesh_shape), ndim)
    order: dict[int, tuple[int, ...]] = {}
    for d, ms in split_orders(placements).items():
        if len(ms) > 1 and draw(st.booleans()):
            key = d - ndim if draw(st.booleans()) else d  # negative tensor dims are accepted too
            order[key] = tuple(draw(st.permutations(ms)))
    return mesh_shape, global_shape, raw, placements, order


def _arange(shape: Sequence[int]) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(tuple(shape))


def _slice(full: torch.Tensor, shape: Sequence[int], offset: Sequence[int]) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _positive(order: Mapping[int, tuple[int, ...]], ndim: int) -> dict[int, tuple[int, ...]]:
    return {d % ndim: ms for d, ms in order.items()}


# --- against the oracle ---------------------------------------------------------------


@SETTINGS
@given(layouts())
def test_local_shape_and_offset_match_the_torch_chunk_oracle(layout: Layout) -> None:
    mesh_shape, global_shape, _, placements, order = layout
    full = _arange(global_shape)
    canonical = normalize_shard_order(placements, order, len(global_shape))
    for coord in coordinates(mesh_shape):
        want = local_piece(full, mesh_shape, placements, coord, _positive(order, len(global_shape)))
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, placements, coord, order)
        assert shape == tuple(want.shape), (coord, shape, tuple(want.shape))
        assert torch.equal(_slice(full, shape, offset), want), (coord, offset)
        assert all(0 <= o <= g for o, g in zip(offset, global_shape)), (coord, offset)
        # the canonical tuple form of the same order gives the same answer
        assert local_shape_and_offset(global_shape, mesh_shape, placements, coord, canonical) == (shape, offset)


@SETTINGS
@given(layouts())
def test_pieces_tile_the_global_tensor_once_per_replica(layout: Layout) -> None:
    mesh_shape, global_shape, _, placements, order = layout
    # Replicate and Partial mesh dims hold the whole (term of the) tensor on every rank.
    replicas = math.prod(n for n, p in zip(mesh_shape, placements) if not isinstance(p, Shard))
    count = torch.zeros(global_shape, dtype=torch.int64)
    for coord in coordinates(mesh_shape):
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, placements, coord, order)
        _slice(count, shape, offset).add_(1)
    assert torch.equal(count, torch.full(global_shape, replicas, dtype=torch.int64))


@SETTINGS
@given(layouts(partial=False))
def test_oracle_assemble_rebuilds_the_global_tensor_from_library_pieces(layout: Layout) -> None:
    mesh_shape, global_shape, _, placements, order = layout
    full = _arange(global_shape)
    pieces = {}
    for coord in coordinates(mesh_shape):
        shape, offset = local_shape_and_offset(global_shape, mesh_shape, placements, coord, order)
        pieces[coord] = _slice(full, shape, offset)
    rebuilt = assemble(pieces, mesh_shape, placements, _positive(order, len(global_shape)))
    assert torch.equal(rebuilt, full)


@SETTINGS
@given(layouts())
def test_max_local_shape_is_the_elementwise_max_over_coordinates(layout: Layout) -> None:
    mesh_shape, global_shape, _, placements, order = layout
    canonical = normalize_shard_order(placements, order, len(global_shape))
    shapes = [local_shape_and_offset(global_shape, mesh_shape, placements, c, order)[0] for c in coordinates(mesh_shape)]
    want = tuple(max(s[d] for s in shapes) for d in range(len(global_shape)))
    assert max_local_shape(global_shape, mesh_shape, placements, canonical) == want


@SETTINGS
@given(layouts())
def test_global_shape_from_local_inverts_even_layouts_and_rounds_up_uneven_ones(layout: Layout) -> None:
    mesh_shape, global_shape, _, placements, _order = layout
    local = max_local_shape(global_shape, mesh_shape, placements)
    got = global_shape_from_local(local, mesh_shape, placements)
    split_by = [math.prod(mesh_shape[m] for m in split_orders(placements).get(d, ())) for d in range(len(global_shape))]
    # even: exact inverse; uneven: every rank is assumed to hold the first (largest) piece
    want = tuple(-(-g // n) * n for g, n in zip(global_shape, split_by))
    assert got == want, (got, global_shape)


def test_global_shape_from_local_multiplies_every_splitter() -> None:
    placements = (Shard(0), Replicate(), Shard(0), Partial())
    assert global_shape_from_local((2, 5), (2, 3, 4, 5), placements) == (16, 5)


# --- chunk_range ----------------------------------------------------------------------


@pytest.mark.parametrize("size", range(0, 14))
@pytest.mark.parametrize("parts", range(1, 7))
def test_chunk_range_matches_torch_chunk(size: int, parts: int) -> None:
    chunks = torch.chunk(torch.arange(size), parts)
    for index in range(parts):
        start, length = chunk_range(size, parts, index)
        if index < len(chunks):
            assert length == len(chunks[index]), (index, length)
            if length:
                assert start == int(chunks[index][0])
        else:
            assert length == 0 and start == size, (index, start, length)


def test_chunk_range_gives_earlier_ranks_the_larger_pieces() -> None:
    assert [chunk_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [chunk_range(5, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [chunk_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]


# --- worked examples ------------------------------------------------------------------


def test_split_order_changes_which_piece_a_rank_holds() -> None:
    # (S(0), S(0)) on (2, 2) over 8 rows: default order splits by mesh dim 0 first.
    default = [local_shape_and_offset((8,), (2, 2), (Shard(0), Shard(0)), c) for c in coordinates((2, 2))]
    swapped = [local_shape_and_offset((8,), (2, 2), (Shard(0), Shard(0)), c, {0: (1, 0)}) for c in coordinates((2, 2))]
    assert [off for _, off in default] == [(0,), (2,), (4,), (6,)]
    assert [off for _, off in swapped] == [(0,), (4,), (2,), (6,)]


def test_uneven_nested_split_follows_torch_chunk_twice() -> None:
    # 7 rows split by 2 (4, 3), then each by 2 again: (2, 2), (2, 1)
    got = [local_shape_and_offset((7, 3), (2, 2), (Shard(0), Shard(0)), c) for c in coordinates((2, 2))]
    assert got == [((2, 3), (0, 0)), ((2, 3), (2, 0)), ((2, 3), (4, 0)), ((1, 3), (6, 0))]


def test_layout_module_doctests_pass() -> None:
    result = doctest.testmod(_layout)
    assert result.attempted >= 3 and result.failed == 0, result


# --- normalize_placements -------------------------------------------------------------


def test_normalize_placements_makes_shard_dims_non_negative() -> None:
    got = normalize_placements([Shard(-1), Replicate(), Shard(-3), Partial("max")], 4, 3)
    assert got == (Shard(2), Replicate(), Shard(0), Partial("max"))
    assert isinstance(got, tuple)
    assert normalize_placements(got, 4, 3) == got


def test_normalize_placements_accepts_a_single_placement_for_a_1d_mesh() -> None:
    assert normalize_placements(Shard(-1), 1, 2) == (Shard(1),)


def test_placements_length_must_match_the_mesh() -> None:
    with pytest.raises(ValueError) as err:
        normalize_placements((Shard(0), Replicate()), 3, 2)
    message = str(err.value)
    assert re.search(r"\b2\b", message) and re.search(r"\b3\b", message), message
    assert "(S(0), R)" in message, message


@pytest.mark.parametrize("dim", [3, 2, -3, 17])
def test_shard_dim_out_of_range_names_the_placement_and_the_valid_range(dim: int) -> None:
    with pytest.raises(ValueError) as err:
        normalize_placements([Replicate(), Shard(dim)], 2, 2)
    message = str(err.value)
    assert f"S({dim})" in message, message
    assert "[-2, 1]" in message, message
    assert "placements[1]" in message, message


def test_a_0d_tensor_cannot_be_sharded() -> None:
    with pytest.raises(ValueError, match=r"S\(0\).*0-D"):
        normalize_placements([Shard(0)], 1, 0)
    assert normalize_placements([Replicate()], 1, 0) == (Replicate(),)


@pytest.mark.parametrize("bad", [["S(0)"], [0], [None], [Shard]])
def test_non_placement_entries_are_a_type_error(bad: list[object]) -> None:
    with pytest.raises(TypeError, match=r"placements\[0\]"):
        normalize_placements(bad, 1, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["S(0)", 0, None, {Shard(0)}])
def test_placements_that_are_not_a_sequence_are_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        normalize_placements(bad, 1, 2)  # type: ignore[arg-type]


def test_errors_use_the_callers_argument_name() -> None:
    with pytest.raises(ValueError, match=r"dst placements\[0\]"):
        normalize_placements([Shard(5)], 1, 2, what="dst placements")


# --- normalize_shard_order ------------------------------------------------------------


def test_shard_order_is_canonicalised() -> None:
    placements = (Shard(0), Shard(1), Shard(0), Shard(1))
    assert normalize_shard_order(placements, None, 2) == ()
    assert normalize_shard_order(placements, {}, 2) == ()
    assert normalize_shard_order(placements, {0: (0, 2), 1: [1, 3]}, 2) == ()  # the defaults drop out
    assert normalize_shard_order(placements, {-1: [3, 1], 0: (2, 0)}, 2) == ((0, (2, 0)), (1, (3, 1)))
    assert normalize_shard_order(placements, ((1, (3, 1)),), 2) == ((1, (3, 1)),)


@pytest.mark.parametrize("order", [{0: (2, 0)}, {0: (0,)}, {0: (1, 0, 1)}, {0: ()}])
def test_shard_order_naming_the_wrong_mesh_dims_is_an_error(order: dict[int, tuple[int, ...]]) -> None:
    placements = (Shard(0), Shard(0), Replicate())
    with pytest.raises(ValueError) as err:
        normalize_shard_order(placements, order, 2)
    message = str(err.value)
    assert str(tuple(order[0])) in message, message  # what was given
    assert "(0, 1)" in message, message  # what the placements say


def test_shard_order_for_an_unsharded_tensor_dim_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"tensor dim 1.*\(1, 0\)"):
        normalize_shard_order((Shard(0), Shard(0)), {1: (1, 0)}, 2)


@pytest.mark.parametrize("tensor_dim", [2, -3, "0"])
def test_shard_order_tensor_dim_out_of_range_is_an_error(tensor_dim: object) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(tensor_dim))):
        normalize_shard_order((Shard(0), Shard(0)), {tensor_dim: (1, 0)}, 2)  # type: ignore[dict-item]


def test_shard_order_giving_one_tensor_dim_two_orders_is_an_error() -> None:
    # regression: {0: (1, 0), -2: (0, 1)} both name tensor dim 0; one order silently won
    with pytest.raises(ValueError, match="tensor dim 0 more than one split order"):
        normalize_shard_order((Shard(0), Shard(0)), {0: (1, 0), -2: (0, 1)}, 2)
