"""Strategies of the misc family (`_ops/_misc.py`), checked by simulating every rank.

Each case runs every candidate (and the propagator's pick) for a sample of Shard /
Replicate / Partial input layouts on meshes (4,) and (2, 2), with even shapes, uneven
ones and dims smaller than the mesh; targeted tests pin the shards that must survive
(no gather) and the Partials that must pass through.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._ops import Layout, get_op_strategy, propagate
from shardwise._spec import DTensorSpec

from ..strategy_sim import check_op, default_layouts, schema_for

aten = torch.ops.aten

MESHES = [(4,), (2, 2)]


def t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def idx(high: int, *shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


CASES: list[tuple[str, Any, tuple[Any, ...]]] = [
    # view copies
    ("view_copy_even", aten.view_copy.default, (t(8, 6), [48])),
    ("view_copy_uneven", aten.view_copy.default, (t(6, 4), [24])),
    ("view_copy_split", aten.view_copy.default, (t(5, 6), [5, 2, 3])),
    ("t_copy", aten.t_copy.default, (t(5, 6),)),
    ("t_copy_1d", aten.t_copy.default, (t(6),)),
    ("transpose_copy", aten.transpose_copy.int, (t(3, 5, 8), 0, -1)),
    ("transpose_copy_same", aten.transpose_copy.int, (t(5, 8), 1, 1)),
    ("permute_copy", aten.permute_copy.default, (t(3, 5, 8), [2, 0, 1])),
    ("unsqueeze_copy", aten.unsqueeze_copy.default, (t(5, 6), 1)),
    ("unsqueeze_copy_last", aten.unsqueeze_copy.default, (t(3, 6), -1)),
    ("squeeze_copy_all", aten.squeeze_copy.default, (t(1, 5, 1, 6),)),
    ("squeeze_copy_small", aten.squeeze_copy.default, (t(4, 1, 3),)),
    ("squeeze_copy_dim", aten.squeeze_copy.dim, (t(5, 1, 6), 1)),
    ("squeeze_copy_dim_kept", aten.squeeze_copy.dim, (t(4, 6), 0)),
    ("squeeze_copy_dims", aten.squeeze_copy.dims, (t(1, 5, 1, 3), [0, 2, 3])),
    ("unbind_copy", aten.unbind_copy.int, (t(3, 5), 0)),
    ("unbind_copy_inner", aten.unbind_copy.int, (t(6, 3), 1)),
    ("split_with_sizes_copy", aten.split_with_sizes_copy.default, (t(6, 5), [2, 4], 0)),
    ("split_with_sizes_copy_inner", aten.split_with_sizes_copy.default, (t(5, 7), [3, 1, 3], 1)),
    ("split_with_sizes_copy_whole", aten.split_with_sizes_copy.default, (t(6, 5), [5], 1)),
    ("unfold_copy", aten.unfold_copy.default, (t(8, 5), 0, 3, 2)),
    ("unfold_copy_inner", aten.unfold_copy.default, (t(5, 7), 1, 2, 1)),
    ("narrow_copy", aten.narrow_copy.default, (t(8, 5), 0, 1, 5)),
    ("narrow_copy_inner", aten.narrow_copy.default, (t(5, 6), 1, 2, 3)),
    ("narrow_copy_whole", aten.narrow_copy.default, (t(6, 5), 0, 0, 6)),
    # scatters
    ("select_scatter", aten.select_scatter.default, (t(6, 5), t(5, seed=2), 0, 2)),
    ("select_scatter_inner", aten.select_scatter.default, (t(5, 6, 3), t(5, 3, seed=2), 1, -1)),
    ("slice_scatter", aten.slice_scatter.default, (t(8, 5), t(3, 5, seed=2), 0, 2, 5)),
    ("slice_scatter_step", aten.slice_scatter.default, (t(5, 7), t(5, 3, seed=2), 1, 0, 6, 2)),
    ("slice_scatter_whole", aten.slice_scatter.default, (t(6, 5), t(6, 5, seed=2), 0)),
    ("scatter_reduce_add", aten.scatter.reduce, (t(6, 5), 0, idx(6, 6, 5), t(6, 5, seed=2)), {"reduce": "add"}),
    ("scatter_reduce_mul", aten.scatter.reduce, (t(5, 6), 1, idx(6, 5, 6), t(5, 6, seed=2)), {"reduce": "multiply"}),
    ("scatter_reduce_small_index", aten.scatter.reduce, (t(6, 5), 0, idx(6, 3, 5), t(4, 5, seed=2)), {"reduce": "add"}),
    ("scatter__reduce", aten.scatter_.reduce, (t(6, 5), 1, idx(5, 6, 5), t(6, 5, seed=2)), {"reduce": "add"}),
    ("scatter_value_reduce_add", aten.scatter.value_reduce, (t(6, 5), 0, idx(6, 6, 5), 1.5), {"reduce": "add"}),
    ("scatter_value_reduce_mul", aten.scatter.value_reduce, (t(5, 6), 1, idx(6, 5, 6), 2.0), {"reduce": "multiply"}),
    ("scatter__value_reduce", aten.scatter_.value_reduce, (t(6, 5), 0, idx(6, 6, 5), 3.0), {"reduce": "multiply"}),
    # images
    ("pixel_shuffle", aten.pixel_shuffle.default, (t(8, 8, 2, 3), 2)),
    ("pixel_shuffle_uneven", aten.pixel_shuffle.default, (t(3, 4, 3, 2), 2)),
    ("pixel_shuffle_5d", aten.pixel_shuffle.default, (t(2, 3, 4, 1, 1), 2)),
    ("pixel_unshuffle", aten.pixel_unshuffle.default, (t(8, 2, 4, 6), 2)),
    ("pixel_unshuffle_uneven", aten.pixel_unshuffle.default, (t(5, 1, 4, 2), 2)),
    ("channel_shuffle", aten.channel_shuffle.default, (t(8, 6, 3), 3)),
    ("channel_shuffle_uneven", aten.channel_shuffle.default, (t(3, 4, 5), 2)),
    ("im2col", aten.im2col.default, (t(4, 1, 4, 3), [2, 2], [1, 1], [1, 0], [1, 2])),
    ("im2col_uneven", aten.im2col.default, (t(3, 2, 4, 3), [2, 2], [1, 1], [0, 0], [1, 1])),
    ("im2col_unbatched", aten.im2col.default, (t(2, 4, 4), [3, 3], [1, 1], [1, 1], [1, 1])),
    ("col2im", aten.col2im.default, (t(8, 8, 12), [4, 5], [2, 2], [1, 1], [0, 0], [1, 1])),
    ("col2im_uneven", aten.col2im.default, (t(3, 4, 6), [4, 4], [2, 1], [1, 1], [0, 0], [1, 2])),
    ("col2im_unbatched", aten.col2im.default, (t(8, 12), [4, 5], [2, 2], [1, 1], [0, 0], [1, 1])),
    # single ops
    ("safe_softmax", aten._safe_softmax.default, (t(6, 5), 1)),
    ("safe_softmax_dim0", aten._safe_softmax.default, (t(5, 3, 4), 0)),
    ("prelu", aten._prelu_kernel.default, (t(6, 5, 3, 2), t(5, 1, 1, seed=2))),
    ("prelu_uneven", aten._prelu_kernel.default, (t(3, 7, 5), t(7, 1, seed=2))),
    ("prelu_scalar_weight", aten._prelu_kernel.default, (t(5, 6), t(1, seed=2))),
    ("prelu_backward", aten._prelu_kernel_backward.default, (t(6, 5, 3, seed=3), t(6, 5, 3), t(5, 1, seed=2))),
    ("prelu_backward_uneven", aten._prelu_kernel_backward.default, (t(3, 7, seed=3), t(3, 7), t(7, seed=2))),
    ("polar", aten.polar.default, (t(6, 5).abs(), t(6, 5, seed=2))),
    ("polar_broadcast", aten.polar.default, (t(3, 5).abs(), t(5, seed=2))),
    ("trace", aten.trace.default, (t(6, 5),)),
    ("trace_small", aten.trace.default, (t(3, 2),)),
    ("renorm", aten.renorm.default, (t(8, 5), 2, 0, 1.0)),
    ("renorm_uneven", aten.renorm.default, (t(3, 5, 6), 1, 1, 0.5)),
    ("renorm_", aten.renorm_.default, (t(6, 5), 2, 1, 1.0)),
]


def _split(case: tuple[Any, ...]) -> tuple[str, Any, tuple[Any, ...], dict[str, Any]]:
    name, op, args, *rest = case
    return name, op, args, (rest[0] if rest else {})


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize(("op", "args", "kwargs"), [_split(c)[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_candidate_matches_the_op_on_full_tensors(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh_shape: tuple[int, ...]
) -> None:
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.ndim > 0]
    assert check_op(op, args, kwargs, mesh_shape=mesh_shape, layouts=_sample(tensors, len(mesh_shape))) > 0


def _sample(tensors: list[torch.Tensor], mesh_ndim: int, cap: int = 10) -> list[list[Layout]]:
    """`default_layouts`, thinned evenly to `cap` combinations (keeps the suite fast)."""
    combos = default_layouts(tensors, mesh_ndim)
    step = max(1, -(-len(combos) // cap))
    return combos[::step]


def test_every_registered_op_has_a_case() -> None:
    import shardwise._ops._misc as misc
    from shardwise._ops import registered_ops

    ours = {op for op in registered_ops() if getattr(get_op_strategy(op), "__module__", "") == misc.__name__}
    assert len(ours) >= 30 and ours == {c[1] for c in CASES} | {aten.is_same_size.default}


@pytest.mark.parametrize("other", [(8, 5), (5, 8)])
def test_is_same_size_compares_global_shapes_and_moves_nothing(other: tuple[int, ...]) -> None:
    from shardwise._ops import rule_for
    from shardwise._ops._local import LocalCall

    mesh = AbstractMesh((4,))
    a = schema_for(aten.is_same_size.default, (t(8, 5), t(*other)), {}, mesh, [Layout((Shard(0),)), Layout((Replicate(),))])
    result = propagate(a)
    assert result.input_specs == (None, None) and result.output_spec is None
    specs = a.input_specs()
    local = rule_for(aten.is_same_size.default).local
    assert local is not None
    call = LocalCall(aten.is_same_size.default, [t(2, 5), t(*other)], {}, tuple(specs), None, None)  # type: ignore[arg-type]
    assert local(call) is (other == (8, 5))


# -- targeted: what must stay sharded, what must pass through ------------------------------

ANY_PARTIALS = [Partial(op) for op in ("sum", "avg", "max", "min")]


@pytest.mark.parametrize("partial", ANY_PARTIALS, ids=str)
@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.view_copy.default, (t(8, 6), [48])),
        (aten.transpose_copy.int, (t(5, 6), 0, 1)),
        (aten.narrow_copy.default, (t(8, 5), 0, 1, 5)),
        (aten.pixel_shuffle.default, (t(3, 8, 2, 3), 2)),
        (aten.channel_shuffle.default, (t(3, 6, 2), 3)),
        (aten.im2col.default, (t(3, 2, 4, 4), [2, 2], [1, 1], [1, 1], [1, 1])),
        (aten.select_scatter.default, (t(6, 5), t(5, seed=2), 0, 2)),
    ],
    ids=["view_copy", "transpose_copy", "narrow_copy", "pixel_shuffle", "channel_shuffle", "im2col", "select_scatter"],
)
def test_partials_pass_through_data_movement(op: Any, args: tuple[Any, ...], partial: Partial) -> None:
    n_tensors = sum(isinstance(a, torch.Tensor) for a in args)
    layouts = [[(partial,)] * n_tensors, [(partial, Replicate())] * n_tensors]
    for layout, mesh in zip(layouts, MESHES):
        check_op(op, args, mesh_shape=mesh, layouts=[layout])
        chosen = _choose(op, args, {}, mesh, layout)
        _assert_kept(_out_placements(chosen), layout[0])
        for spec, given in zip(chosen.input_specs, layout):
            assert spec is None or _kept(spec.placements, given)


def _kept(got: tuple[Placement, ...], want: tuple[Placement, ...]) -> bool:
    """`got` has every non-Replicate placement of `want` (a Replicate may be split further:
    cutting a local slice of a replica costs nothing, and the propagator prefers it)."""
    return all(isinstance(w, Replicate) or g == w for g, w in zip(got, want))


def _assert_kept(got: tuple[Placement, ...], want: tuple[Placement, ...]) -> None:
    assert _kept(got, want), f"{got} drops a placement of {want}"


def _choose(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: tuple[int, ...],
            layout: list[tuple[Placement, ...]]) -> Any:
    return propagate(schema_for(op, args, kwargs, AbstractMesh(mesh), [Layout(p) for p in layout]))


def _out_placements(chosen: Any) -> tuple[Placement, ...]:
    out = chosen.output_spec
    first = out[0] if isinstance(out, tuple) else out
    assert isinstance(first, DTensorSpec)
    return first.placements


KEEPS: list[tuple[str, Any, tuple[Any, ...], dict[str, Any], list[tuple[Placement, ...]], tuple[Placement, ...]]] = [
    ("view_copy", aten.view_copy.default, (t(8, 6), [48]), {}, [(Shard(0), Shard(0))], (Shard(0), Shard(0))),
    ("transpose_copy", aten.transpose_copy.int, (t(3, 5, 8), 0, 2), {}, [(Shard(0), Shard(1))], (Shard(2), Shard(1))),
    ("t_copy", aten.t_copy.default, (t(5, 8),), {}, [(Shard(0), Shard(1))], (Shard(1), Shard(0))),
    ("squeeze_copy", aten.squeeze_copy.dim, (t(8, 1, 6), 1), {}, [(Shard(2), Shard(0))], (Shard(1), Shard(0))),
    ("unbind_copy", aten.unbind_copy.int, (t(3, 8, 6), 0), {}, [(Shard(1), Shard(2))], (Shard(0), Shard(1))),
    ("narrow_copy", aten.narrow_copy.default, (t(8, 5), 1, 1, 3), {}, [(Shard(0), Replicate())], (Shard(0), Replicate())),
    ("select_scatter", aten.select_scatter.default, (t(6, 8), t(8), 0, 1), {},
     [(Shard(1), Replicate()), (Shard(0), Replicate())], (Shard(1), Replicate())),
    ("slice_scatter", aten.slice_scatter.default, (t(8, 6), t(8, 2), 1, 2, 4), {},
     [(Shard(0), Shard(0)), (Shard(0), Shard(0))], (Shard(0), Shard(0))),
    ("scatter_reduce", aten.scatter.reduce, (t(8, 6), 1, idx(6, 8, 6), t(8, 6)), {"reduce": "add"},
     [(Shard(0), Replicate())] * 3, (Shard(0), Replicate())),
    ("pixel_shuffle", aten.pixel_shuffle.default, (t(8, 8, 2, 2), 2), {}, [(Shard(0), Replicate())], (Shard(0), Replicate())),
    ("channel_shuffle", aten.channel_shuffle.default, (t(8, 6, 4), 2), {}, [(Shard(0), Shard(2))], (Shard(0), Shard(2))),
    ("im2col", aten.im2col.default, (t(8, 2, 4, 4), [2, 2], [1, 1], [0, 0], [1, 1]), {}, [(Shard(0), Replicate())],
     (Shard(0), Replicate())),
    ("prelu", aten._prelu_kernel.default, (t(8, 6, 4), t(6, 1)), {}, [(Shard(1), Shard(2)), (Shard(0), Replicate())],
     (Shard(1), Shard(2))),
    ("safe_softmax", aten._safe_softmax.default, (t(8, 6), 1), {}, [(Shard(0), Replicate())], (Shard(0), Replicate())),
    ("renorm", aten.renorm.default, (t(8, 6), 2, 0, 1.0), {}, [(Shard(0), Replicate())], (Shard(0), Replicate())),
    ("trace", aten.trace.default, (t(8, 6),), {}, [(Partial(), Replicate())], (Partial(), Replicate())),
]


@pytest.mark.parametrize(("op", "args", "kwargs", "layout", "out"), [k[1:] for k in KEEPS], ids=[k[0] for k in KEEPS])
def test_shards_survive_without_a_gather(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                                         layout: list[tuple[Placement, ...]], out: tuple[Placement, ...]) -> None:
    check_op(op, args, kwargs, mesh_shape=(2, 2), layouts=[layout])
    chosen = _choose(op, args, kwargs, (2, 2), layout)
    _assert_kept(_out_placements(chosen), out)
    assert all(s is None or _kept(s.placements, p) for s, p in zip(chosen.input_specs, layout))


@pytest.mark.parametrize(
    ("op", "args", "kwargs", "dim"),
    [
        (aten.narrow_copy.default, (t(8, 5), 0, 0, 8), {}, 0),  # whole dim: local length would be wrong
        (aten.split_with_sizes_copy.default, (t(8, 5), [8], 0), {}, 0),
        (aten.select_scatter.default, (t(8, 5), t(5), 0, 3), {}, 0),
        (aten.slice_scatter.default, (t(8, 5), t(8, 5), 0), {}, 0),
        (aten.scatter.reduce, (t(8, 5), 0, idx(8, 8, 5), t(8, 5)), {"reduce": "add"}, 0),
        (aten.pixel_shuffle.default, (t(2, 8, 4, 4), 2), {}, 2),
        (aten.channel_shuffle.default, (t(2, 8, 4), 2), {}, 1),
        (aten.renorm.default, (t(8, 6), 2, 0, 1.0), {}, 1),
        (aten.trace.default, (t(8, 8),), {}, 0),
    ],
    ids=["narrow_copy_whole", "split_copy_whole", "select_scatter", "slice_scatter", "scatter_reduce",
         "pixel_shuffle_spatial", "channel_shuffle_channels", "renorm_other_dim", "trace"],
)
def test_dims_read_with_global_positions_are_gathered(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> None:
    n_tensors = sum(isinstance(a, torch.Tensor) and a.ndim > 0 for a in args)
    layout = [(Shard(dim),)] + [(Replicate(),)] * (n_tensors - 1)
    check_op(op, args, kwargs, mesh_shape=(4,), layouts=[layout])
    chosen = _choose(op, args, kwargs, (4,), layout)
    assert chosen.input_specs[0] is not None and Shard(dim) not in chosen.input_specs[0].placements


def test_scatter_value_add_does_not_keep_a_sum_partial() -> None:
    """Adding the value once per term would count it 4 times; multiplying is linear."""
    args = (t(6, 5), 0, idx(6, 6, 5), 1.5)
    chosen = _choose(aten.scatter.value_reduce, args, {"reduce": "add"}, (4,), [(Partial(),), (Replicate(),)])
    assert _out_placements(chosen) != (Partial(),)
    chosen = _choose(aten.scatter.value_reduce, args, {"reduce": "multiply"}, (4,), [(Partial(),), (Replicate(),)])
    assert _out_placements(chosen) == (Partial(),)
