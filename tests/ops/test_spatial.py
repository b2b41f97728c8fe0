"""Strategies for padding, resampling and the long-tail ops of `_ops/_spatial`, checked
in one process against the op on full tensors (every candidate simulated)."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch

from shardwise import AbstractMesh, Partial, Replicate, Shard
from shardwise._ops import Layout, get_op_strategy, propagate

from shardwise.testing import distributed

from ..strategy_sim import check_op as _check_op
from ..strategy_sim import default_layouts, schema_for

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]


def check_op(op: Any, args: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> int:
    """`strategy_sim.check_op` on a deterministic sample of about 10 input layout combinations,
    Partial first inputs included
    (the full default sample is slow for ops with many candidates)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.ndim > 0]
    combos = default_layouts(tensors, len(mesh_shape))
    step = max(1, len(combos) // 6)
    partial = [c for c in combos if any(isinstance(p, Partial) for p in c[0].placements)]
    sample = combos[::step] + partial[:: max(1, len(partial) // 3)] + [combos[-1]]
    return _check_op(op, args, mesh_shape=mesh_shape, layouts=sample)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


# shapes: even on the leading dims, then uneven with a dim smaller than the mesh (empty pieces)
SHAPES = [(4, 4, 6, 5), (5, 1, 7, 6)]

Case = tuple[Any, Callable[[tuple[int, ...]], tuple[Any, ...]]]


def _spatial_cases() -> list[tuple[str, Case]]:
    def x(s: tuple[int, ...]) -> torch.Tensor:
        return randn(*s)

    def go(s: tuple[int, ...], h: int, w: int) -> torch.Tensor:  # a grad_output of spatial size h x w
        return randn(s[0], s[1], h, w, seed=1)

    return [
        ("const_pad0", (aten.constant_pad_nd.default, lambda s: (x(s), [1, 2, 0, 0]))),
        ("const_pad_value", (aten.constant_pad_nd.default, lambda s: (x(s), [0, 0, 1, 1], 0.5))),
        ("const_crop", (aten.constant_pad_nd.default, lambda s: (x(s), [-1, 0]))),
        ("reflect2d", (aten.reflection_pad2d.default, lambda s: (x(s), [1, 2, 1, 0]))),
        ("reflect1d", (aten.reflection_pad1d.default, lambda s: (x(s)[0], [2, 1]))),
        ("replicate2d", (aten.replication_pad2d.default, lambda s: (x(s), [1, 2, 0, 1]))),
        ("reflect2d_bwd", (aten.reflection_pad2d_backward.default,
                           lambda s: (go(s, s[2] + 2, s[3] + 3), x(s), [1, 2, 1, 1]))),
        ("replicate1d_bwd", (aten.replication_pad1d_backward.default,
                             lambda s: (randn(s[0], s[1], s[2] + 3, seed=2), x(s)[..., 0], [1, 2]))),
        ("nearest2d", (aten.upsample_nearest2d.default, lambda s: (x(s), [9, 7]))),
        ("nearest2d_vec", (aten.upsample_nearest2d.vec, lambda s: (x(s), None, [2.0, 1.5]))),
        ("nearest1d", (aten.upsample_nearest1d.default, lambda s: (x(s)[..., 0], [11]))),
        ("bilinear2d", (aten.upsample_bilinear2d.default, lambda s: (x(s), [9, 7], False))),
        ("bilinear2d_aa", (aten._upsample_bilinear2d_aa.default, lambda s: (x(s), [3, 2], False))),
        ("bicubic2d", (aten.upsample_bicubic2d.default, lambda s: (x(s), [9, 7], True))),
        ("linear1d", (aten.upsample_linear1d.default, lambda s: (x(s)[..., 0], [11], False))),
        ("nearest2d_bwd", (aten.upsample_nearest2d_backward.default, lambda s: (go(s, 9, 7), [9, 7], list(s)))),
        ("bilinear2d_bwd", (aten.upsample_bilinear2d_backward.default,
                            lambda s: (go(s, 9, 7), [9, 7], list(s), False))),
        ("bicubic2d_bwd", (aten.upsample_bicubic2d_backward.default,
                           lambda s: (go(s, 9, 7), [9, 7], list(s), True))),
        ("grid_sampler", (aten.grid_sampler_2d.default,
                          lambda s: (x(s), torch.rand(s[0], 3, 4, 2, generator=_g(3)) * 2 - 1, 0, 0, False))),
        ("diag_embed", (aten.diag_embed.default, lambda s: (x(s)[..., 0], 1, 0, 2))),
        ("diag_embed_default", (aten.diag_embed.default, lambda s: (x(s)[0],))),
    ]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,case", _spatial_cases(), ids=[n for n, _ in _spatial_cases()])
def test_spatial_strategies_match_the_full_op(name: str, case: Case, shape: tuple[int, ...],
                                              mesh_shape: tuple[int, ...]) -> None:
    op, build = case
    assert check_op(op, build(shape), mesh_shape=mesh_shape) > 0


def _grid_backward_args(s: tuple[int, ...]) -> tuple[Any, ...]:
    grid = torch.rand(s[0], 3, 4, 2, generator=_g(3)) * 2 - 1
    return randn(s[0], s[1], 3, 4, seed=4), randn(*s), grid, 0, 0, False, [True, True]


def _unpool_args(s: tuple[int, ...]) -> tuple[Any, ...]:
    out, idx = torch.nn.functional.max_pool2d(randn(s[0], s[1], 2 * s[2], 2 * s[3]), 2, return_indices=True)
    return out, idx, [2 * s[2], 2 * s[3]]


def _unpool3d_args(s: tuple[int, ...]) -> tuple[Any, ...]:
    out, idx = torch.nn.functional.max_pool3d(randn(s[0], s[1], 4, 2 * s[2], 4), 2, return_indices=True)
    return out, idx, [4, 2 * s[2], 4], [2, 2, 2], [0, 0, 0]


def _other_cases() -> list[tuple[str, Case]]:
    return [
        ("grid_sampler_bwd", (aten.grid_sampler_2d_backward.default, _grid_backward_args)),
        ("max_unpool2d", (aten.max_unpool2d.default, _unpool_args)),
        ("max_unpool3d", (aten.max_unpool3d.default, _unpool3d_args)),
        ("diagonal_scatter", (aten.diagonal_scatter.default,
                              lambda s: (randn(*s), randn(s[0], s[3], min(s[1], s[2]) - 0, seed=5), 0, 1, 2))),
        ("diagonal_scatter_offset", (aten.diagonal_scatter.default,
                                     lambda s: (randn(s[2], s[3]), randn(min(s[2], s[3] - 1), seed=5), 1))),
        ("cdist", (aten._cdist_forward.default, lambda s: (randn(s[0], s[2], s[3]), randn(s[0], s[1], s[3], seed=6), 2.0, None))),
        ("cdist_p1", (aten._cdist_forward.default, lambda s: (randn(s[2], s[3]), randn(s[1], s[3], seed=6), 1.0, None))),
        ("bucketize", (aten.bucketize.Tensor, lambda s: (randn(s[0], s[2]), torch.linspace(-1, 1, s[2])))),
        ("nanmedian", (aten.nanmedian.dim, lambda s: (randn(s[0], s[2]), 1))),
        ("nanmedian_all", (aten.nanmedian.default, lambda s: (randn(s[0], s[2]),))),
        ("nanmedian_keep", (aten.nanmedian.dim, lambda s: (randn(s[0], s[2], s[3]), 0, True))),
        ("index_reduce", (aten.index_reduce.default,
                          lambda s: (randn(s[0], s[2]), 1, torch.tensor([0, 2, 1, 0, 2, 1])[: s[1] + 1],
                                     randn(s[0], s[1] + 1, seed=7), "amax"))),
        ("rsub", (aten.rsub.Tensor, lambda s: (randn(s[0], s[2]), randn(s[2], seed=8)))),
        ("floor_divide", (aten.floor_divide.default, lambda s: (randn(s[0], s[2]), randn(s[0], s[2], seed=9).abs() + 0.5))),
        ("complex", (aten.complex.default, lambda s: (randn(s[0], s[2]), randn(s[0], s[2], seed=9)))),
        ("alias_copy", (aten.alias_copy.default, lambda s: (randn(s[0], s[2]),))),
        ("expand_copy", (aten.expand_copy.default, lambda s: (randn(s[0], 1), [s[0], s[2]]))),
        ("unsafe_split", (aten.unsafe_split.Tensor, lambda s: (randn(s[0], s[2]), 2, 1))),
    ]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,case", _other_cases(), ids=[n for n, _ in _other_cases()])
def test_long_tail_strategies_match_the_full_op(name: str, case: Case, shape: tuple[int, ...],
                                                mesh_shape: tuple[int, ...]) -> None:
    op, build = case
    assert check_op(op, build(shape), mesh_shape=mesh_shape) > 0


def _choice(op: Any, args: tuple[Any, ...], layouts: list[Layout], mesh_shape: tuple[int, ...] = (4,)) -> Any:
    schema = schema_for(op, args, {}, AbstractMesh(mesh_shape), layouts)
    return propagate(schema)


def test_padding_keeps_batch_shards_without_moving_data() -> None:
    x = randn(8, 4, 6, 6)
    r = _choice(aten.constant_pad_nd.default, (x, [1, 1, 1, 1]), [Layout((Shard(0),))])
    assert r.input_specs == (None,) and r.output_spec.placements == (Shard(0),)
    r = _choice(aten.reflection_pad2d.default, (x, [1, 1, 1, 1]), [Layout((Shard(1),))])
    assert r.input_specs == (None,) and r.output_spec.placements == (Shard(1),)


def test_padded_dim_is_gathered() -> None:
    x = randn(8, 4, 6, 6)
    r = _choice(aten.constant_pad_nd.default, (x, [1, 1]), [Layout((Shard(3),))])
    assert r.input_specs[0] is not None and Shard(3) not in r.input_specs[0].placements


def test_constant_pad_partial_sum_passes_only_with_a_zero_pad_value() -> None:
    x = randn(8, 4)
    r = _choice(aten.constant_pad_nd.default, (x, [1, 1]), [Layout((Partial("sum"),))])
    assert r.input_specs == (None,) and r.output_spec.placements == (Partial("sum"),)
    r = _choice(aten.constant_pad_nd.default, (x, [1, 1], 2.0), [Layout((Partial("sum"),))])
    assert r.output_spec.placements != (Partial("sum"),)
    r = _choice(aten.constant_pad_nd.default, (x, [1, 1], 2.0), [Layout((Partial("max"),))])
    assert r.input_specs == (None,) and r.output_spec.placements == (Partial("max"),)


def test_upsample_keeps_channel_shards_and_linear_partials() -> None:
    x = randn(2, 8, 5, 5)
    r = _choice(aten.upsample_bilinear2d.default, (x, [10, 10], False), [Layout((Shard(1),))])
    assert r.input_specs == (None,) and r.output_spec.placements == (Shard(1),)
    r = _choice(aten.upsample_bilinear2d.default, (x, [10, 10], False), [Layout((Partial("sum"),))])
    assert r.input_specs == (None,) and r.output_spec.placements == (Partial("sum"),)
    r = _choice(aten.upsample_bilinear2d.default, (x, [10, 10], False), [Layout((Partial("max"),))])
    assert r.output_spec.placements != (Partial("max"),)


def test_upsample_backward_rewrites_the_input_size_per_rank() -> None:
    g = randn(8, 2, 10, 10)
    r = _choice(aten.upsample_nearest2d_backward.default, (g, [10, 10], [8, 2, 5, 5]), [Layout((Shard(0),))])
    assert r.shape_arg == 2 and r.output_spec.placements == (Shard(0),)


def test_the_fallback_examples_still_have_no_strategy() -> None:
    # tests/tensor/test_dtensor_ops.py uses these as its examples of ops without a strategy
    assert get_op_strategy(aten.segment_reduce.default) is None


def test_replicate_is_always_a_candidate() -> None:
    x = randn(4, 4, 6, 6)
    schema = schema_for(aten.upsample_nearest2d.default, (x, [12, 12]), {}, AbstractMesh((2, 2)),
                        [Layout((Shard(2), Shard(3)))])
    strategy = get_op_strategy(aten.upsample_nearest2d.default)(schema)  # type: ignore[misc]
    assert any(c.input_specs == (Layout((Replicate(), Replicate())),) for c in strategy.strategies)


def _max_cases() -> list[tuple[str, Case, int]]:
    """Ops that claim to keep P(max) / P(min): (name, case, index of the Partial input)."""
    x = randn(4, 3, 5, 6)
    out, idx = torch.nn.functional.max_pool2d(randn(4, 3, 10, 12), 2, return_indices=True)
    return [
        ("const_pad_value", (aten.constant_pad_nd.default, lambda: (x, [1, 1], 2.0)), 0),
        ("reflect2d", (aten.reflection_pad2d.default, lambda: (x, [1, 2, 1, 0])), 0),
        ("nearest2d", (aten.upsample_nearest2d.default, lambda: (x, [9, 7])), 0),
        ("max_unpool2d", (aten.max_unpool2d.default, lambda: (out, idx, [10, 12])), 0),
        ("diag_embed", (aten.diag_embed.default, lambda: (x,)), 0),
        ("bucketize", (aten.bucketize.Tensor, lambda: (x, torch.linspace(-1, 1, 7))), 0),
        ("diagonal_scatter", (aten.diagonal_scatter.default, lambda: (x, randn(4, 3, 5, seed=2), 0, 2, 3)), -1),
    ]


@pytest.mark.parametrize("reduce_op", ["max", "min"])
@pytest.mark.parametrize("name,case,k", _max_cases(), ids=[n for n, _, _ in _max_cases()])
def test_order_partials_pass_where_claimed(name: str, case: Any, k: int, reduce_op: str) -> None:
    op, build = case
    args = build()
    n = sum(isinstance(a, torch.Tensor) and a.ndim > 0 for a in args)
    p = Partial(reduce_op)
    for mesh_shape, mine in (((4,), (p,)), ((2, 2), (Shard(0), p))):
        # the Partial input gets `mine`; with k == -1 every input does
        layouts = [[Layout(mine) if k in (-1, j) else Layout((Replicate(),) * len(mesh_shape)) for j in range(n)]]
        assert _check_op(op, args, mesh_shape=mesh_shape, layouts=layouts) > 0
        chosen = _choice(op, args, layouts[0], mesh_shape)
        assert chosen.input_specs[0] is None and chosen.output_spec.placements == mine


# -- on real ranks: the one multi-rank test of this family -----------------------------------


@distributed(world_size=4)
def test_pads_resampling_and_grid_sampling_on_ranks_match_single_device() -> None:
    import torch.nn.functional as F

    import shardwise as sw
    from shardwise._ops import set_strict

    x_full = randn(5, 3, 6, 7)  # uneven batch on 4 ranks
    grid_full = torch.rand(5, 4, 3, 2, generator=_g(11)) * 2 - 1
    fns: list[tuple[str, Callable[..., torch.Tensor]]] = [
        ("pad constant", lambda x, g: F.pad(x, (1, 2, 0, 1), value=0.5)),
        ("pad reflect", lambda x, g: F.pad(x, (1, 2, 2, 1), mode="reflect")),
        ("pad replicate", lambda x, g: F.pad(x, (1, 2, 2, 1), mode="replicate")),
        ("nearest", lambda x, g: F.interpolate(x, scale_factor=2)),
        ("bilinear", lambda x, g: F.interpolate(x, size=(9, 8), mode="bilinear")),
        ("bicubic", lambda x, g: F.interpolate(x, size=(9, 8), mode="bicubic", align_corners=True)),
        ("grid_sample", lambda x, g: F.grid_sample(x, g, align_corners=False)),
    ]
    cases = [((4,), [Shard(0)], [Shard(0)]), ((2, 2), [Shard(0), Shard(1)], [Shard(0), Replicate()])]
    set_strict(True)  # every op on the way, backward included, must have a strategy
    try:
        for mesh_shape, xp, gp in cases:
            mesh = sw.init_device_mesh("cpu", mesh_shape)
            for name, fn in fns:
                what = f"{name} on {mesh_shape} x {xp}"
                ref_x, ref_g = x_full.clone().requires_grad_(True), grid_full.clone().requires_grad_(True)
                want = fn(ref_x, ref_g)
                coef = randn(*want.shape, seed=12)
                (want * coef).sum().backward()
                x = sw.distribute_tensor(x_full.clone().requires_grad_(True), mesh, xp)
                g = sw.distribute_tensor(grid_full.clone().requires_grad_(True), mesh, gp)
                got = fn(x, g)
                assert got.placements == tuple(xp), f"{what}: output {got.placements}"
                torch.testing.assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-5, msg=what)
                (got * sw.distribute_tensor(coef, mesh, list(got.placements))).sum().backward()
                for leaf, ref in ((x, ref_x), (g, ref_g)):
                    if name == "grid_sample" or leaf is x:
                        assert leaf.grad is not None and ref.grad is not None, what
                        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, rtol=1e-4, atol=1e-4, msg=f"{what} grad")
    finally:
        set_strict(False)


def _registered_spatial_case(op: Any) -> tuple[Any, ...]:
    """Arguments for any registered pad / upsample overload, built from its signature."""
    name = op._schema.name.split("::")[1]
    names = [a.name for a in op._schema.arguments]
    n = int(re.search(r"(\d)d", name).group(1))  # type: ignore[union-attr]  # spatial dims
    x = randn(3, 5, *[4 + k for k in range(n)])
    if "pad" in name:
        pad = [1, 2] * n
        if "backward" in name:
            return randn(3, 5, *[7 + k for k in range(n)], seed=1), x, pad
        return x, pad
    size = [6 + k for k in range(n)] if "aa" not in name else [2 + k for k in range(n)]
    extra = [False] if "align_corners" in names else []
    if "backward" in name:
        return (randn(3, 5, *size, seed=1), size, list(x.shape), *extra)
    if op._overloadname == "vec":
        return (x, size, *extra, None)
    return (x, size, *extra)


def _registered_spatial_ops() -> list[Any]:
    from shardwise._ops import registered_ops

    return sorted((op for op in registered_ops() if ("pad" in str(op) and "constant" not in str(op)) or "upsample" in str(op)),
                  key=str)


@pytest.mark.parametrize("op", _registered_spatial_ops(), ids=str)
def test_every_registered_pad_and_upsample_overload(op: Any) -> None:
    args = _registered_spatial_case(op)
    for mesh_shape in MESHES:
        assert check_op(op, args, mesh_shape=mesh_shape) > 0


def test_grid_sampler_3d_and_index_reduce_inplace() -> None:
    x = randn(3, 5, 4, 3, 4)
    grid = torch.rand(3, 2, 3, 2, 3, generator=_g(5)) * 2 - 1
    g = randn(3, 5, 2, 3, 2, seed=6)
    for mesh_shape in MESHES:
        assert check_op(aten.grid_sampler_3d.default, (x, grid, 0, 0, True), mesh_shape=mesh_shape) > 0
        assert check_op(aten.grid_sampler_3d_backward.default, (g, x, grid, 0, 1, False, [True, True]),
                        mesh_shape=mesh_shape) > 0
        args = (randn(5, 6), 0, torch.tensor([0, 2, 1, 0]), randn(4, 6, seed=7), "mean")
        assert check_op(aten.index_reduce_.default, args, mesh_shape=mesh_shape) > 0
