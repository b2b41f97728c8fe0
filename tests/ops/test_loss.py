"""Loss, order-statistic and lookup strategies, checked in one process.

Every candidate is simulated on every rank of a (4,) and a (2, 2) mesh
(`tests/strategy_sim.py`) and compared with the op on full tensors, for even and uneven
shapes and Shard / Replicate / Partial inputs; then the propagator's choices are pinned
where correctness hinges on them (a mean over uneven pieces, a mean's backward).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._ops import Layout, get_op_strategy, propagate

from ..strategy_sim import check_op, schema_for

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]
SHAPES = [(8, 4), (5, 3)]  # even on both meshes; uneven (and a dim smaller than 4)
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
PAVG = Partial("avg")


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _layouts(args: Sequence[Any], mesh: Sequence[int]) -> list[list[Layout]]:
    """A few layout combinations of the tensor args: all split on dim 0 / dim 1 / both, all
    Replicate, all Partial, only the first split (dims a tensor lacks: Replicate)."""
    k = len(mesh)
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.ndim > 0]

    def fit(t: torch.Tensor, ps: Sequence[Placement]) -> Layout:
        return Layout(tuple(R if isinstance(p, Shard) and p.dim >= t.ndim else p for p in ps))

    base = [(S0,) * k, (S1,) * k, (S0, S1) if k == 2 else (S1,), (R,) * k, (P,) * k]
    combos = [[fit(t, b) for t in tensors] for b in base]
    combos.append([Layout((S0,) * k)] + [Layout((R,) * k)] * (len(tensors) - 1))
    return combos


def _probs(shape: Sequence[int], seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 0.8 + 0.1


def _loss_args(op: Any, shape: Sequence[int]) -> tuple[list[Any], int]:
    """(tensor args before `reduction`, index where reduction goes)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    y = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    w = _probs(shape[-1:], 3)
    if op is aten.binary_cross_entropy.default:
        return [_probs(shape, 4), _probs(shape, 5), _probs(shape, 6)], 3
    if op is aten.binary_cross_entropy_with_logits.default:
        return [x, _probs(shape, 5), w, _probs(shape[-1:], 7)], 4  # weight / pos_weight broadcast
    if op is aten.soft_margin_loss.default:
        return [x, torch.sign(y)], 2
    return [x, y], 2


_FORWARD = [aten.mse_loss.default, aten.huber_loss.default, aten.smooth_l1_loss.default,
            aten.soft_margin_loss.default, aten.binary_cross_entropy.default,
            aten.binary_cross_entropy_with_logits.default]
_BACKWARD = {aten.mse_loss_backward.default: aten.mse_loss.default,
             aten.huber_loss_backward.default: aten.huber_loss.default,
             aten.smooth_l1_loss_backward.default: aten.smooth_l1_loss.default,
             aten.soft_margin_loss_backward.default: aten.soft_margin_loss.default,
             aten.binary_cross_entropy_backward.default: aten.binary_cross_entropy.default}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("op", _FORWARD, ids=str)
def test_elementwise_loss_candidates(op: Any, reduction: int, shape: Sequence[int], mesh: Sequence[int]) -> None:
    tensors, at = _loss_args(op, shape)
    args = tensors + [None] * (at - len(tensors)) + [reduction]
    assert check_op(op, args, mesh_shape=mesh, layouts=_layouts(args, mesh)) > 0


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("op", list(_BACKWARD), ids=str)
def test_elementwise_loss_backward_candidates(op: Any, reduction: int, shape: Sequence[int], mesh: Sequence[int]) -> None:
    tensors, _ = _loss_args(_BACKWARD[op], shape)
    grad = torch.randn(*shape) if reduction == 0 else torch.tensor(0.7)
    args: list[Any] = [grad, *tensors, reduction]
    if op in (aten.huber_loss_backward.default, aten.smooth_l1_loss_backward.default):
        args.append(0.5)
    assert check_op(op, args, mesh_shape=mesh, layouts=_layouts(args, mesh)) > 0


def _chosen(op: Any, args: Sequence[Any], mesh: Sequence[int], placements: Sequence[Placement]) -> Any:
    n = sum(1 for a in args if isinstance(a, torch.Tensor) and a.ndim > 0)
    schema = schema_for(op, args, {}, AbstractMesh(tuple(mesh)), [Layout(tuple(placements))] * n)
    return schema, propagate(schema)


def test_mean_loss_stays_partial_avg_only_on_even_pieces() -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    _, even = _chosen(aten.mse_loss.default, [x, y, 1], (4,), [S0])
    assert even.output_spec.placements == (PAVG,) and not even.needs_redistribute
    _, summed = _chosen(aten.mse_loss.default, [x[:5], y[:5], 2], (4,), [S0])
    assert summed.output_spec.placements == (P,) and not summed.needs_redistribute
    # (5, 4): an all_to_all onto the 4 columns gives equal pieces, so P(avg) is fine there
    _, moved = _chosen(aten.mse_loss.default, [x[:5], y[:5], 1], (4,), [S0])
    assert moved.output_spec.placements == (PAVG,) and moved.input_specs[0].placements == (S1,)
    x, y = torch.randn(5, 3), torch.randn(5, 3)  # no dim splits evenly over 4 ranks
    schema, uneven = _chosen(aten.mse_loss.default, [x, y, 1], (4,), [S0])
    assert PAVG not in uneven.output_spec.placements
    fn = get_op_strategy(aten.mse_loss.default)
    assert fn is not None
    assert all(PAVG not in s.output_specs.placements for s in fn(schema).strategies)


def test_mean_loss_backward_never_splits_self() -> None:
    # the kernel scales by 1 / (local element count): a split self would be off by the mesh size
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    schema = schema_for(aten.mse_loss_backward.default, [torch.tensor(1.0), x, y, 1], {}, AbstractMesh((4,)),
                        [Layout((S0,))] * 2)
    fn = get_op_strategy(aten.mse_loss_backward.default)
    assert fn is not None
    assert all(lay is not None and lay.placements == (R,) for s in fn(schema).strategies for lay in s.input_specs)
    _, summed = _chosen(aten.mse_loss_backward.default, [torch.tensor(1.0), x, y, 2], (4,), [S0])
    assert summed.output_spec.placements == (S0,) and not summed.needs_redistribute


def test_loss_backward_keeps_partial_grad_output() -> None:
    x, y, g = torch.randn(6, 3), torch.randn(6, 3), torch.randn(6, 3)
    for mesh in MESHES:
        k = len(mesh)
        check_op(aten.mse_loss_backward.default, [g, x, y, 0], mesh_shape=mesh,
                 layouts=[[Layout((P,) * k), Layout((R,) * k), Layout((R,) * k)]])
        schema = schema_for(aten.mse_loss_backward.default, [g, x, y, 0], {}, AbstractMesh(mesh),
                            [Layout((P,) * k), Layout((R,) * k), Layout((R,) * k)])
        assert propagate(schema).output_spec.placements == (P,) * k


# -- margin losses ---------------------------------------------------------------------------


def _margin_args(op: Any, shape: Sequence[int], reduction: int) -> list[Any]:
    n, c = shape
    x = torch.randn(n, c, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    if op in (aten.multi_margin_loss.default, aten.multi_margin_loss_backward.default):
        t = torch.randint(0, c, (n,), generator=gen)
        return [x, t, 1, 1.0, _probs((c,), 3), reduction]
    t = torch.randint(-1, c, (n, c), generator=gen)
    return [x, t, reduction]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("op", [aten.multi_margin_loss.default, aten.multilabel_margin_loss_forward.default], ids=str)
def test_margin_loss_candidates(op: Any, reduction: int, shape: Sequence[int], mesh: Sequence[int]) -> None:
    args = _margin_args(op, shape, reduction)
    assert check_op(op, args, mesh_shape=mesh, layouts=_layouts(args, mesh)) > 0


def test_margin_loss_sum_skips_empty_batch_pieces() -> None:
    # regression: multi_margin_loss(reduction=sum) on a 0-row piece returned garbage, so a
    # split batch with an empty rank (5 rows on 4 ranks) must not be a candidate
    x, t, p, margin, w, _ = _margin_args(aten.multi_margin_loss.default, (8, 3), 2)
    fn = get_op_strategy(aten.multi_margin_loss.default)
    assert fn is not None
    for rows in (5, 8):
        schema = schema_for(aten.multi_margin_loss.default, [x[:rows], t[:rows], p, margin, w, 2], {}, AbstractMesh((4,)),
                            [Layout((S0,)), Layout((S0,)), Layout((R,))])
        split = [s for s in fn(schema).strategies if s.input_specs[0] is not None and s.input_specs[0].placements == (S0,)]
        assert len(split) == (0 if rows == 5 else 1)


# -- order statistics and lookups --------------------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", [(8, 4, 6), (5, 3, 7)])
def test_order_statistics(shape: Sequence[int], mesh: Sequence[int]) -> None:
    # distinct values: ties would make the indices implementation-defined
    x = torch.randperm(int(torch.tensor(shape).prod()), generator=torch.Generator().manual_seed(0)).float().reshape(shape)
    k = len(mesh)
    lays = [[Layout(ps)] for ps in [(S0,) * k, (S1,) * k, (Shard(2),) * k, (S0, Shard(2))[:k], (P,) * k, (R,) * k]]
    check_op(aten.median.default, [x], mesh_shape=mesh, layouts=lays)
    for dim, keepdim in ((0, False), (1, True), (-1, False)):
        assert check_op(aten.median.dim, [x, dim, keepdim], mesh_shape=mesh, layouts=lays) > 0
        assert check_op(aten.kthvalue.default, [x, 2, dim, not keepdim], mesh_shape=mesh, layouts=lays) > 0
    modes = torch.randint(0, 3, tuple(shape), generator=torch.Generator().manual_seed(1)).float()
    assert check_op(aten.mode.default, [modes, 0, True], mesh_shape=mesh, layouts=lays) > 0
    assert check_op(aten.mode.default, [modes, 2], mesh_shape=mesh, layouts=lays) > 0


def test_order_statistic_keeps_other_dims_split() -> None:
    x = torch.randn(8, 6)
    _, chosen = _chosen(aten.median.dim, [x, 1], (4,), [S0])
    assert not chosen.needs_redistribute
    assert [s.placements for s in chosen.output_spec] == [(S0,), (S0,)]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", [(8, 4), (5, 3)])
def test_lookups(shape: Sequence[int], mesh: Sequence[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    seq = torch.randn(*shape, generator=gen).sort(-1).values
    vals = torch.randn(shape[0], 6, generator=gen)
    assert check_op(aten.searchsorted.Tensor, [seq, vals], mesh_shape=mesh) > 0
    assert check_op(aten.searchsorted.Tensor, [seq[0], vals], {"right": True}, mesh_shape=mesh) > 0
    order = torch.randn(*shape, generator=gen).argsort(-1)
    unsorted = torch.randn(*shape, generator=gen)
    assert check_op(aten.searchsorted.Tensor, [unsorted, vals], {"sorter": order}, mesh_shape=mesh) > 0
    ints = torch.randint(0, 10, tuple(shape), generator=gen)
    assert check_op(aten.isin.Tensor_Tensor, [ints, torch.arange(0, 10, 3)], mesh_shape=mesh) > 0
    assert check_op(aten.isin.Tensor_Tensor, [ints, ints[:2]], {"invert": True}, mesh_shape=mesh) > 0
    numel = shape[0] * shape[1]
    index = torch.randint(0, numel, (5, 2), generator=gen)
    assert check_op(aten.take.default, [unsorted, index], mesh_shape=mesh) > 0
    flat = torch.randperm(numel, generator=gen)[:3]
    src = torch.randn(3, generator=gen)
    assert check_op(aten.put.default, [unsorted, flat, src, True], mesh_shape=mesh) > 0
    assert check_op(aten.put_.default, [unsorted.clone(), flat, src], mesh_shape=mesh) > 0
    assert check_op(aten._pdist_forward.default, [unsorted, 2.0], mesh_shape=mesh) > 0
    assert check_op(aten.block_diag.default, [[unsorted, vals]], mesh_shape=mesh) > 0
    a, b, w = torch.randn(shape[0], 3, generator=gen), torch.randn(shape[0], 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    tri = [a, w, b, [1, 3], [0], [1, 2], [2, 3]]  # what F.bilinear sends
    assert check_op(aten._trilinear.default, tri, mesh_shape=mesh) > 0


def test_lookups_keep_shards() -> None:
    seq, vals = torch.randn(8, 4).sort(-1).values, torch.randn(8, 6)
    _, chosen = _chosen(aten.searchsorted.Tensor, [seq, vals], (4,), [S0])
    assert not chosen.needs_redistribute and chosen.output_spec.placements == (S0,)
    schema = schema_for(aten.searchsorted.Tensor, [seq, vals], {}, AbstractMesh((4,)), [Layout((S1,)), Layout((S1,))])
    chosen = propagate(schema)
    assert chosen.input_specs[0] is not None and chosen.input_specs[0].placements != (S1,)  # searched dim whole
    _, chosen = _chosen(aten.isin.Tensor_Tensor, [torch.arange(8), torch.arange(3)], (4,), [S0])
    assert chosen.output_spec.placements == (S0,)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, float("inf"), float("-inf")])
def test_dist_keeps_partial_norms_where_they_combine(mesh_shape: tuple[int, ...], p: float) -> None:
    x, y = torch.randn(7, 5), torch.randn(7, 5)
    y[0, 0] = x[0, 0]  # a zero difference, so p = 0 counts something less than everything
    assert check_op(aten.dist.default, (x, y, p), mesh_shape=mesh_shape) > 0
