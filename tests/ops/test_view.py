"""View and shape op strategies, checked by simulating every rank in one process.

Each case runs every candidate the strategy offers (and the propagator's pick) for a
sample of Shard/Replicate/Partial input layouts on meshes (4,) and (2, 2), with even and
uneven shapes and dims smaller than the mesh; the targeted tests below pin the choices
that matter (no gather where none is needed) and the bugs they fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from shardwise import AbstractMesh, Partial, Replicate, Shard
from shardwise._ops import Layout, OutputSharding, get_op_strategy, propagate
from shardwise._ops._view import view_groups
from shardwise._spec import DTensorSpec

from ..oracle import assemble, local_piece
from ..strategy_sim import check_op, coordinates, schema_for


aten = torch.ops.aten

MESHES = [(4,), (2, 2)]
INT_MAX = 2**63 - 1


def t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# (id, op, args): even shapes, uneven ones, and dims smaller than the mesh.
CASES: list[tuple[str, Any, tuple[Any, ...]]] = [
    # view / _unsafe_view / reshape: merges, splits, size-1 dims, -1, empty
    ("view_merge_even", aten.view.default, (t(8, 6), [48])),
    ("view_merge_uneven", aten.view.default, (t(6, 4), [24])),
    ("view_merge_odd", aten.view.default, (t(5, 6), [30])),
    ("view_split_merge", aten.view.default, (t(8, 6), [2, 4, 3, 2])),
    ("view_minus_one", aten.view.default, (t(5, 6), [-1, 3])),
    ("view_split_1d", aten.view.default, (t(12), [3, 4])),
    ("view_split_outer", aten.view.default, (t(16, 3), [4, 4, 3])),
    ("view_regroup", aten.view.default, (t(4, 6), [8, 3])),
    ("view_3d_to_2d", aten.view.default, (t(2, 3, 4), [6, 4])),
    ("view_3d_keep_last_merge", aten.view.default, (t(2, 3, 4), [2, 12])),
    ("view_drop_leading_one", aten.view.default, (t(1, 8, 4), [8, 4])),
    ("view_add_leading_one", aten.view.default, (t(8, 4), [1, 8, 4])),
    ("view_inner_one", aten.view.default, (t(4, 1, 6), [4, 6])),
    ("view_ones_swap", aten.view.default, (t(1, 5), [5, 1])),
    ("view_identity", aten.view.default, (t(5, 6), [5, 6])),
    ("view_empty", aten.view.default, (torch.randn(0, 4), [4, 0])),
    ("unsafe_view_linear_out", aten._unsafe_view.default, (t(8, 5), [2, 4, 5])),
    ("unsafe_view_uneven", aten._unsafe_view.default, (t(6, 5), [2, 3, 5])),
    ("reshape", aten.reshape.default, (t(4, 6), [2, 12])),
    # expand
    ("expand_row", aten.expand.default, (t(1, 6), [4, 6])),
    ("expand_new_dims", aten.expand.default, (t(4, 1), [2, 4, 5])),
    ("expand_minus_one", aten.expand.default, (t(5, 1), [-1, 3])),
    # permutations, alias
    ("permute", aten.permute.default, (t(2, 3, 4), [2, 0, 1])),
    ("permute_neg", aten.permute.default, (t(5, 6), [-1, 0])),
    ("transpose", aten.transpose.int, (t(5, 6), 0, 1)),
    ("transpose_3d", aten.transpose.int, (t(2, 5, 3), -1, 0)),
    ("t", aten.t.default, (t(5, 6),)),
    ("t_1d", aten.t.default, (t(5),)),
    ("alias", aten.alias.default, (t(5, 6),)),
    # size-1 dims
    ("unsqueeze_0", aten.unsqueeze.default, (t(5, 6), 0)),
    ("unsqueeze_mid", aten.unsqueeze.default, (t(5, 6), 1)),
    ("unsqueeze_last", aten.unsqueeze.default, (t(5, 6), -1)),
    ("squeeze_all", aten.squeeze.default, (t(5, 1, 3),)),
    ("squeeze_all_pieces_of_one", aten.squeeze.default, (t(4, 1, 8),)),
    ("squeeze_dim", aten.squeeze.dim, (t(1, 6), 0)),
    ("squeeze_dim_noop_pieces_of_one", aten.squeeze.dim, (t(4, 6), 0)),
    ("squeeze_dims", aten.squeeze.dims, (t(4, 1, 1), [1, 2])),
    ("squeeze_dims_mixed", aten.squeeze.dims, (t(4, 1, 3), [0, 1])),
    # in place: self takes the result's layout (the tensor layer re-lays it out)
    ("squeeze_inplace_all", aten.squeeze_.default, (t(5, 1, 3),)),
    ("squeeze_inplace_dim", aten.squeeze_.dim, (t(4, 1, 6), 1)),
    ("squeeze_inplace_dims", aten.squeeze_.dims, (t(4, 1, 1), [1, 2])),
    ("unsqueeze_inplace", aten.unsqueeze_.default, (t(5, 6), 1)),
    ("transpose_inplace", aten.transpose_.default, (t(4, 6, 3), 0, 2)),
    ("t_inplace", aten.t_.default, (t(5, 6),)),
    # picking elements
    ("slice", aten.slice.Tensor, (t(8, 6), 0, 1, 7)),
    ("slice_step", aten.slice.Tensor, (t(5, 6), 1, 0, 6, 2)),
    ("slice_negative", aten.slice.Tensor, (t(5, 6), 0, -3)),
    ("slice_whole", aten.slice.Tensor, (t(5, 6), 0, 0, INT_MAX)),
    ("select", aten.select.int, (t(5, 6), 0, 2)),
    ("select_negative", aten.select.int, (t(5, 6), 1, -1)),
    ("split", aten.split.Tensor, (t(8, 6), 3)),
    ("split_dim1_uneven", aten.split.Tensor, (t(5, 6), 4, 1)),
    ("split_one_piece", aten.split.Tensor, (t(5, 6), 10)),
    ("split_with_sizes", aten.split_with_sizes.default, (t(8, 6), [1, 5], 1)),
    ("unbind", aten.unbind.int, (t(3, 4),)),
    ("unbind_dim1", aten.unbind.int, (t(5, 3), 1)),
    ("diagonal", aten.diagonal.default, (t(5, 6),)),
    ("diagonal_batched", aten.diagonal.default, (t(2, 5, 6), 1, 1, 2)),
    ("diagonal_outer", aten.diagonal.default, (t(5, 6, 3), -1, 0, 1)),
    ("diagonal_copy", aten.diagonal_copy.default, (t(5, 6),)),
    # joining
    ("cat_dim0", aten.cat.default, ([t(5, 6), t(3, 6, seed=1)], 0)),
    ("cat_dim1", aten.cat.default, ([t(5, 6), t(5, 2, seed=1)], 1)),
    ("cat_three", aten.cat.default, ([t(4, 3), t(4, 3, seed=1), t(4, 3, seed=2)], -1)),
    ("cat_legacy_empty", aten.cat.default, ([t(5, 6), torch.empty(0)], 0)),
    ("stack_dim0", aten.stack.default, ([t(5, 6), t(5, 6, seed=1)], 0)),
    ("stack_dim1", aten.stack.default, ([t(5, 6), t(5, 6, seed=1)], 1)),
    ("stack_last", aten.stack.default, ([t(3, 6), t(3, 6, seed=1)], -1)),
    # rearranging
    ("repeat", aten.repeat.default, (t(5, 6), [2, 1])),
    ("repeat_inner", aten.repeat.default, (t(5, 6), [1, 3])),
    ("repeat_new_dim", aten.repeat.default, (t(5, 6), [2, 1, 1])),
    ("flip", aten.flip.default, (t(5, 6), [0])),
    ("flip_both", aten.flip.default, (t(5, 6), [0, -1])),
    ("roll", aten.roll.default, (t(5, 6), [1], [0])),
    ("roll_two", aten.roll.default, (t(5, 6), [2, -1], [0, 1])),
    ("roll_flat", aten.roll.default, (t(5, 6), [3])),
    ("roll_full_turn", aten.roll.default, (t(5, 6), [5], [0])),
    ("tril", aten.tril.default, (t(5, 6),)),
    ("triu_batched", aten.triu.default, (t(3, 5, 6), 1)),
    ("tril_negative", aten.tril.default, (t(2, 4, 4), -1)),
    ("rot90", aten.rot90.default, (t(5, 6), 1, [0, 1])),
    ("rot90_batched", aten.rot90.default, (t(2, 5, 6), 3, [1, 2])),
    ("unfold", aten.unfold.default, (t(8, 6), 0, 2, 2)),
    ("unfold_overlap", aten.unfold.default, (t(5, 6), 1, 3, 1)),
    # backward ops
    ("slice_backward", aten.slice_backward.default, (t(4, 6), [8, 6], 0, 2, 6, 1)),
    ("slice_backward_step", aten.slice_backward.default, (t(5, 3), [5, 6], 1, 0, 6, 2)),
    ("slice_backward_whole", aten.slice_backward.default, (t(5, 6), [5, 6], 0, 0, INT_MAX, 1)),
    ("select_backward", aten.select_backward.default, (t(6), [5, 6], 0, 2)),
    ("select_backward_3d", aten.select_backward.default, (t(2, 5), [2, 3, 5], 1, -1)),
    ("diagonal_backward", aten.diagonal_backward.default, (t(5), [5, 6], 0, 0, 1)),
    ("diagonal_backward_batched", aten.diagonal_backward.default, (t(2, 5), [2, 5, 6], 1, 1, 2)),
    ("unfold_backward", aten.unfold_backward.default, (t(4, 6, 2), [8, 6], 0, 2, 2)),
    ("unfold_backward_overlap", aten.unfold_backward.default, (t(5, 4, 3), [5, 6], 1, 3, 1)),
]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize(("op", "args"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_candidate_matches_the_op_on_full_tensors(
    op: Any, args: tuple[Any, ...], mesh_shape: tuple[int, ...]
) -> None:
    assert check_op(op, args, mesh_shape=mesh_shape) > 0


def test_every_registered_op_has_a_case() -> None:
    import shardwise._ops._shape as shape_module
    import shardwise._ops._view as view_module

    ours = _registered_here(view_module) | _registered_here(shape_module)
    assert len(ours) >= 30 and ours - {c[1] for c in CASES} == set()


def _registered_here(module: Any) -> set[Any]:
    from shardwise._ops import registered_ops

    return {op for op in registered_ops() if getattr(get_op_strategy(op), "__module__", "") == module.__name__}


# -- max/min partials ----------------------------------------------------------------------

ALL_PARTIALS = [Partial(op) for op in ("sum", "avg", "max", "min")]


@pytest.mark.parametrize("partial", ALL_PARTIALS, ids=str)
@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.view.default, (t(8, 6), [48])),
        (aten.slice.Tensor, (t(8, 6), 0, 1, 7)),
        (aten.tril.default, (t(5, 6),)),
        (aten.slice_backward.default, (t(4, 6), [8, 6], 0, 2, 6, 1)),
        (aten.diagonal_backward.default, (t(5), [5, 6], 0, 0, 1)),
        (aten.unfold_backward.default, (t(5, 4, 3), [5, 6], 1, 3, 1)),
        (aten.split.Tensor, (t(8, 6), 3)),
    ],
    ids=["view", "slice", "tril", "slice_backward", "diagonal_backward", "unfold_backward", "split"],
)
def test_partials_of_every_reduce_op_pass_only_where_exact(op: Any, args: tuple[Any, ...], partial: Partial) -> None:
    layouts = [[(partial, Shard(0))], [(Shard(0), partial)], [(partial, Replicate())]]
    assert check_op(op, args, mesh_shape=(2, 2), layouts=layouts) > 0
    chosen = _choose(op, args, [(partial, Replicate())], (2, 2))
    out = chosen.output_spec[0] if isinstance(chosen.output_spec, tuple) else chosen.output_spec
    assert out is not None
    linear_only = op is aten.unfold_backward.default
    kept = not linear_only or partial.reduce_op in ("sum", "avg")
    assert (out.placements[0] == partial) == kept and (chosen.input_specs[0] is None) == kept


@pytest.mark.parametrize(
    ("op", "partials"),
    [(aten.cat.default, ("sum", "sum")), (aten.cat.default, ("max", "max")), (aten.stack.default, ("avg", "avg"))],
)
def test_cat_and_stack_keep_a_partial_all_inputs_share(op: Any, partials: tuple[str, str]) -> None:
    a, b = t(4, 6), t(4, 6, seed=1)
    layout = [(Partial(partials[0]),), (Partial(partials[1]),)]
    check_op(op, ([a, b], 0), mesh_shape=(4,), layouts=[layout])
    chosen = _choose(op, ([a, b], 0), layout, (4,))
    assert chosen.input_specs == (None, None) and chosen.output_spec.placements == (Partial(partials[0]),)


def test_cat_of_a_partial_and_a_replicated_tensor_keeps_the_partial_and_moves_nothing() -> None:
    # the replicated input becomes the Partial's terms for free (its value on the first rank,
    # zeros elsewhere), as torch does for stack / cat of P and R
    a, b = t(4, 6), t(4, 6, seed=1)
    check_op(aten.cat.default, ([a, b], 0), mesh_shape=(4,), layouts=[[(Partial(),), (Replicate(),)]])
    chosen = _choose(aten.cat.default, ([a, b], 0), [(Partial(),), (Replicate(),)], (4,))
    assert chosen.output_spec.placements == (Partial(),)
    assert chosen.input_specs[0] is None


# -- the propagator's choices: no gather where none is needed -------------------------------


def _choose(op: Any, args: Sequence[Any], layouts: Sequence[Sequence[Any]], mesh_shape: tuple[int, ...],
            orders: Sequence[Any] = ()) -> OutputSharding:
    mesh = AbstractMesh(mesh_shape)
    lays = [Layout(tuple(lay), orders[k] if k < len(orders) else ()) for k, lay in enumerate(layouts)]
    return propagate(schema_for(op, args, {}, mesh, lays))


def _out_placements(chosen: OutputSharding, k: int = 0) -> tuple[Any, ...]:
    spec = chosen.output_spec[k] if isinstance(chosen.output_spec, tuple) else chosen.output_spec
    assert isinstance(spec, DTensorSpec)
    return spec.placements


@pytest.mark.parametrize(
    ("args", "mesh_shape", "inp", "out"),
    [
        ((t(8, 6), [48]), (4,), (Shard(0),), (Shard(0),)),  # 2 rows = 12 elements per rank
        ((t(8, 4), [32]), (2, 2), (Shard(0), Shard(0)), (Shard(0), Shard(0))),
        ((t(12), [2, 6]), (2, 2), (Shard(0), Replicate()), (Shard(0), Replicate())),  # 6 elements = 1 row
        ((t(4, 6, 5), [24, 5]), (4,), (Shard(0),), (Shard(0),)),  # linear's flatten of a batch-sharded input
        ((t(24, 5), [4, 6, 5]), (4,), (Shard(0),), (Shard(0),)),  # ... and the unflatten back
        ((t(4, 6, 5), [24, 5]), (2, 2), (Shard(2), Shard(0)), (Shard(1), Shard(0))),
        ((t(1, 8, 4), [8, 4]), (4,), (Shard(1),), (Shard(0),)),  # batch of one: the sequence split survives
        ((t(8, 4), [32]), (2, 2), (Partial(), Shard(0)), (Partial(), Shard(0))),
    ],
)
def test_views_keep_splits_that_stay_torch_chunk_pieces(args: Any, mesh_shape: Any, inp: Any, out: Any) -> None:
    chosen = _choose(aten.view.default, args, [inp], mesh_shape)
    assert chosen.input_specs == (None,) and _out_placements(chosen) == out


@pytest.mark.parametrize(
    ("shape", "size", "mesh_shape", "inp"),
    [
        ((6, 4), [24], (4,), (Shard(0),)),  # rows 2,2,2,0 but 24 splits 6,6,6,6
        ((5, 6), [30], (4,), (Shard(0),)),
        ((12,), [3, 4], (2,), (Shard(0),)),  # 6 elements = 1.5 rows
        ((6, 4), [24], (2, 2), (Shard(0), Shard(0))),  # 6 -> 3,3 -> 2,1,2,1 rows
        ((2, 3, 5), [6, 5], (4,), (Shard(0),)),  # 2 rows over 4 ranks: 1,1,0,0 vs 6 -> 2,2,2,0
    ],
)
def test_views_do_not_keep_splits_that_would_not_be_torch_chunk_pieces(
    shape: Any, size: Any, mesh_shape: Any, inp: Any
) -> None:
    x = t(*shape)
    chosen = _choose(aten.view.default, (x, size), [inp], mesh_shape)
    target = chosen.input_specs[0]
    assert target is not None  # the input had to move
    check_op(aten.view.default, (x, size), mesh_shape=mesh_shape, layouts=[[inp]])


def test_view_moves_a_split_inner_dim_by_all_to_all_rather_than_gathering() -> None:
    chosen = _choose(aten.view.default, (t(2, 4, 6), [8, 6]), [(Shard(1),)], (4,))
    target = chosen.input_specs[0]
    assert target is not None and target.placements == (Shard(2),) and _out_placements(chosen) == (Shard(1),)


def test_regression_squeeze_does_not_drop_a_dim_split_into_pieces_of_one() -> None:
    # (4, 1, 8) split 4 ways holds (1, 1, 8) locally: a local squeeze() would drop dim 0 too.
    x = t(4, 1, 8)
    chosen = _choose(aten.squeeze.default, (x,), [(Shard(0),)], (4,))
    assert chosen.input_specs[0] is not None and _out_placements(chosen) != (Shard(0),)
    check_op(aten.squeeze.default, (x,), mesh_shape=(4,), layouts=[[(Shard(0),)]])
    check_op(aten.squeeze.dim, (t(4, 6), 0), mesh_shape=(4,), layouts=[[(Shard(0),)]])
    # pieces of 2 are safe: no communication
    chosen = _choose(aten.squeeze.default, (t(8, 1, 8),), [(Shard(0),)], (4,))
    assert chosen.input_specs == (None,) and _out_placements(chosen) == (Shard(0),)


@pytest.mark.parametrize(
    ("op", "args", "inp", "out"),
    [
        (aten.transpose.int, (t(5, 6), 0, 1), (Shard(0), Partial()), (Shard(1), Partial())),
        (aten.permute.default, (t(2, 3, 4), [2, 0, 1]), (Shard(2), Shard(0)), (Shard(0), Shard(1))),
        (aten.unsqueeze.default, (t(5, 6), 0), (Shard(1), Shard(0)), (Shard(2), Shard(1))),
        (aten.expand.default, (t(5, 1), [2, 5, 3]), (Shard(0), Partial()), (Shard(1), Partial())),
        (aten.slice.Tensor, (t(8, 6), 0, 1, 7), (Replicate(), Shard(1)), (Replicate(), Shard(1))),
        (aten.slice.Tensor, (t(8, 6), 1, 0, INT_MAX), (Shard(1), Shard(0)), (Shard(1), Shard(0))),
        (aten.select.int, (t(5, 6, 3), 1, 2), (Shard(2), Shard(0)), (Shard(1), Shard(0))),
        (aten.split.Tensor, (t(8, 6), 3, 1), (Shard(0), Partial()), (Shard(0), Partial())),
        (aten.unbind.int, (t(5, 3), 1), (Shard(0), Replicate()), (Shard(0), Replicate())),
        (aten.repeat.default, (t(5, 6), [2, 1, 1]), (Shard(0), Replicate()), (Shard(1), Replicate())),
        (aten.tril.default, (t(3, 5, 6),), (Shard(0), Partial("max")), (Shard(0), Partial("max"))),
        (aten.diagonal.default, (t(5, 6, 3),), (Shard(2), Replicate()), (Shard(0), Replicate())),
        (aten.select_backward.default, (t(5, 3), [5, 4, 3], 1, 0), (Shard(1), Shard(0)), (Shard(2), Shard(0))),
        (aten.slice_backward.default, (t(8, 3), [8, 6], 1, 0, 3, 1), (Shard(0), Partial()), (Shard(0), Partial())),
        (aten.diagonal_backward.default, (t(3, 5), [5, 3, 6], 0, 0, 2), (Shard(0), Replicate()),
         (Shard(1), Replicate())),
    ],
)
def test_ops_keep_splits_on_dims_they_leave_whole_without_communication(op: Any, args: Any, inp: Any, out: Any) -> None:
    chosen = _choose(op, args, [inp], (2, 2))
    assert chosen.input_specs == (None,), chosen
    assert _out_placements(chosen) == out
    check_op(op, args, mesh_shape=(2, 2), layouts=[[inp]])


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.slice.Tensor, (t(8, 6), 0, 1, 7)),
        (aten.select.int, (t(8, 6), 0, 3)),
        (aten.flip.default, (t(8, 6), [0])),
        (aten.roll.default, (t(8, 6), [1], [0])),
        (aten.tril.default, (t(8, 6),)),
        (aten.repeat.default, (t(8, 6), [2, 1])),
        (aten.diagonal.default, (t(8, 6),)),
        (aten.unfold.default, (t(8, 6), 0, 2, 2)),
        (aten.split.Tensor, (t(8, 6), 3)),
    ],
)
def test_ops_that_index_a_split_dim_move_it_first(op: Any, args: Any) -> None:
    chosen = _choose(op, args, [(Shard(0),)], (4,))
    assert chosen.input_specs[0] is not None and Shard(0) not in chosen.input_specs[0].placements


def test_cat_keeps_a_split_every_input_shares_and_moves_the_others() -> None:
    a, b = t(5, 6), t(3, 6, seed=1)
    chosen = _choose(aten.cat.default, ([a, b], 0), [(Shard(1),), (Shard(1),)], (4,))
    assert chosen.input_specs == (None, None) and _out_placements(chosen) == (Shard(1),)
    chosen = _choose(aten.cat.default, ([a, b], 0), [(Shard(1),), (Replicate(),)], (4,))
    assert chosen.input_specs[0] is None and _out_placements(chosen) == (Shard(1),)  # R -> S(1) is a local chunk
    chosen = _choose(aten.stack.default, ([a, a], 1), [(Shard(1), Shard(0))] * 2, (2, 2))
    assert chosen.input_specs == (None, None) and _out_placements(chosen) == (Shard(2), Shard(0))


# -- split orders: a tensor dim split by both mesh dims, outer split on mesh dim 1 ------------


def _simulate_ordered(
    op: Any, args: Sequence[Any], layout: Layout, mesh_shape: tuple[int, ...]
) -> tuple[Layout, torch.Tensor]:
    """Run the propagator's pick for an input with a split order; reassemble the output with
    the naive oracle (which knows split orders)."""
    mesh = AbstractMesh(mesh_shape)
    x = args[0]
    chosen = propagate(schema_for(op, args, {}, mesh, [layout]))
    assert chosen.input_specs == (None,), "a split order kept by the op must not move the input"
    out = chosen.output_spec
    assert isinstance(out, DTensorSpec)
    pieces = {}
    for c in coordinates(mesh_shape):
        local = local_piece(x, mesh_shape, layout.placements, c, dict(layout.shard_order))
        largs = [local, *args[1:]]
        if chosen.shape_arg is not None:
            largs[chosen.shape_arg] = list(out.local_shape_and_offset(c)[0])
        pieces[c] = op(*largs)
    got = assemble(pieces, mesh_shape, out.placements, dict(out.shard_order))
    return Layout(out.placements, out.shard_order), got


@pytest.mark.parametrize(
    ("op", "args", "want"),
    [
        (aten.transpose.int, (t(8, 5), 0, 1), Layout((Shard(1), Shard(1)), ((1, (1, 0)),))),
        (aten.view.default, (t(8, 3), [24]), Layout((Shard(0), Shard(0)), ((0, (1, 0)),))),
        (aten.view.default, (t(8, 3), [4, 2, 3]), Layout((Shard(0), Shard(0)), ((0, (1, 0)),))),
        (aten.unsqueeze.default, (t(8, 3), 0), Layout((Shard(1), Shard(1)), ((1, (1, 0)),))),
        (aten.slice.Tensor, (t(8, 3), 1, 1, 3), Layout((Shard(0), Shard(0)), ((0, (1, 0)),))),
        (aten.cat.default, ([t(8, 3), t(8, 2, seed=1)], 1), Layout((Shard(0), Shard(0)), ((0, (1, 0)),))),
    ],
)
def test_split_orders_are_kept_and_renamed(op: Any, args: Any, want: Layout) -> None:
    layout = Layout((Shard(0), Shard(0)), ((0, (1, 0)),))
    mesh = AbstractMesh((2, 2))
    if op is aten.cat.default:
        chosen = propagate(schema_for(op, args, {}, mesh, [layout, layout]))
        assert chosen.input_specs == (None, None)
        out = chosen.output_spec
        assert isinstance(out, DTensorSpec) and Layout(out.placements, out.shard_order) == want
        return
    got_layout, got = _simulate_ordered(op, args, layout, (2, 2))
    assert got_layout == want
    torch.testing.assert_close(got, op(*args))


# -- the dim grouping of views -------------------------------------------------------------


SHAPES_OF_24 = [(2, 3, 4), (6, 4), (24,), (1, 24), (4, 1, 6), (2, 12, 1)]


@pytest.mark.parametrize("shapes", list(itertools.product(SHAPES_OF_24, repeat=2)))
def test_view_groups_cover_every_dim_once_with_equal_numel(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    a, b = shapes
    groups = view_groups(a, b)
    assert [d for ins, _ in groups for d in ins] == list(range(len(a)))
    assert [d for _, outs in groups for d in outs] == list(range(len(b)))
    for ins, outs in groups:
        assert math.prod(a[d] for d in ins) == math.prod(b[d] for d in outs)


def test_split_with_sizes_into_one_piece_does_not_keep_the_shard() -> None:
    # regression: one output piece was treated as the identity, but split_with_sizes([6]) on a
    # sharded dim asks every rank's smaller local piece for 6 rows and raises
    x = torch.randn(6, 5)
    assert check_op(aten.split_with_sizes.default, (x, [6], 0), mesh_shape=(4,), layouts=[[(Shard(0),)]]) > 0
