"""Reduction, scan, softmax and normalization strategies, checked in one process.

Every candidate each strategy offers is simulated on every rank of a (4,) and a (2, 2)
mesh (`tests/strategy_sim.py`) and compared with the op on full tensors, for even and
uneven shapes (pieces of size 0 included) and Shard / Replicate / Partial inputs. Then the
propagator's choices are pinned where they matter: what stays Partial, what must move,
and that batch norm's running statistics are updated where they live.
"""

from __future__ import annotations

import doctest
import math
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import pytest
import torch

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._ops import Layout, OpStrategy, OutputSharding, _reduction, get_op_strategy, propagate
from shardwise._spec import DTensorSpec

from ..oracle import assemble, local_piece
from ..strategy_sim import check_op, coordinates, schema_for, simulate

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P, PAVG, PMAX, PMIN = Partial(), Partial("avg"), Partial("max"), Partial("min")


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var() on empty pieces warns about degrees of freedom
        yield


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# Layouts of one 3-D input: every placement kind on every mesh dim, uneven splits included.
ONE_INPUT = {
    (4,): [(S0,), (S1,), (S2,), (R,), (P,), (PAVG,), (PMAX,), (PMIN,)],
    (2, 2): [(S0, S1), (S1, S0), (S0, S0), (S2, R), (R, S1), (P, S0), (S1, PAVG), (PMAX, S2), (PMIN, R), (R, R)],
}
EVEN, UNEVEN = randn(8, 4, 6, seed=1), randn(5, 6, 3, seed=2)  # UNEVEN: 5 and 3 leave empty pieces on 4 ranks


def one_input(mesh_shape: tuple[int, ...]) -> list[list[tuple[Placement, ...]]]:
    return [[lay] for lay in ONE_INPUT[mesh_shape]]


REDUCTIONS: dict[str, tuple[Any, Callable[[torch.Tensor], tuple[Any, ...]], dict[str, Any]]] = {
    "sum": (aten.sum.default, lambda x: (x,), {}),
    "sum_dim": (aten.sum.dim_IntList, lambda x: (x, [1]), {}),
    "sum_dims_keepdim": (aten.sum.dim_IntList, lambda x: (x, [0, 2], True), {}),
    "sum_dtype": (aten.sum.dim_IntList, lambda x: (x, [-1]), {"dtype": torch.float64}),
    "nansum": (aten.nansum.default, lambda x: (x, [0]), {}),
    "count_nonzero": (aten.count_nonzero.dim_IntList, lambda x: ((x > 0).float(), [0, 1]), {}),
    "mean": (aten.mean.default, lambda x: (x,), {}),
    "mean_dim": (aten.mean.dim, lambda x: (x, [0]), {}),
    "mean_dims_keepdim": (aten.mean.dim, lambda x: (x, [1, 2], True), {}),
    "prod": (aten.prod.default, lambda x: (x,), {}),
    "prod_dim": (aten.prod.dim_int, lambda x: (x, 1), {}),
    "amax": (aten.amax.default, lambda x: (x, [0]), {}),
    "amax_keepdim": (aten.amax.default, lambda x: (x, [1, 2], True), {}),
    "amin_all": (aten.amin.default, lambda x: (x,), {}),
    "max": (aten.max.default, lambda x: (x,), {}),
    "min": (aten.min.default, lambda x: (x,), {}),
    "max_dim": (aten.max.dim, lambda x: (x, 0), {}),
    "min_dim_keepdim": (aten.min.dim, lambda x: (x, 2, True), {}),
    "argmax": (aten.argmax.default, lambda x: (x, 1), {}),
    "argmin_flat": (aten.argmin.default, lambda x: (x,), {}),
    "var": (aten.var.correction, lambda x: (x, [1]), {}),
    "std_all": (aten.std.correction, lambda x: (x,), {"correction": 0}),
    "var_mean": (aten.var_mean.correction, lambda x: (x, [0, 2]), {"keepdim": True}),
    "std_mean_dim": (aten.std_mean.dim, lambda x: (x, [1], True), {}),
    "logsumexp": (aten.logsumexp.default, lambda x: (x, [2]), {}),
    "norm2": (aten.linalg_vector_norm.default, lambda x: (x, 2, [1]), {}),
    "norm1": (aten.linalg_vector_norm.default, lambda x: (x, 1, [0, 1]), {}),
    "norm0": (aten.linalg_vector_norm.default, lambda x: (x.relu(), 0), {}),
    "norm_inf": (aten.linalg_vector_norm.default, lambda x: (x, math.inf, [0]), {}),
    "norm_neg_inf": (aten.linalg_vector_norm.default, lambda x: (x, -math.inf), {}),
    "norm_legacy": (aten.norm.ScalarOpt_dim, lambda x: (x, 3, [2], True), {}),
    "any": (aten.any.default, lambda x: (x > 1,), {}),
    "any_dim": (aten.any.dim, lambda x: (x > 1, 0), {}),
    "all_dims": (aten.all.dims, lambda x: (x > -1, [0, 2]), {}),
    "any_no_dims": (aten.any.dims, lambda x: (x > 0, []), {}),
    "aminmax": (aten.aminmax.default, lambda x: (x,), {"dim": 0}),
    "aminmax_all": (aten.aminmax.default, lambda x: (x,), {}),
    "cumsum": (aten.cumsum.default, lambda x: (x, 1), {}),
    "cumprod": (aten.cumprod.default, lambda x: (x, 0), {}),
    "logcumsumexp": (aten.logcumsumexp.default, lambda x: (x, 2), {}),
}


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_every_reduction_candidate_matches_the_full_op(name: str, mesh_shape: tuple[int, ...]) -> None:
    op, make_args, kwargs = REDUCTIONS[name]
    for full in (EVEN, UNEVEN):
        n = check_op(op, make_args(full), kwargs, mesh_shape=mesh_shape, layouts=one_input(mesh_shape),
                     atol=1e-4, rtol=1e-4)
        assert n >= len(ONE_INPUT[mesh_shape])  # at least one candidate per layout


def test_dims_smaller_than_the_mesh() -> None:
    tiny = randn(3, 2, seed=3)  # both dims smaller than 4: trailing ranks hold empty pieces
    layouts = [[(S0,)], [(S1,)], [(P,)], [(PMAX,)]]
    for op, args in [(aten.amax.default, (tiny, [0])), (aten.max.default, (tiny,)), (aten.mean.dim, (tiny, [1])),
                     (aten.sum.default, (tiny,)), (aten.aminmax.default, (tiny,)), (aten.argmax.default, (tiny, 0)),
                     (aten.cumsum.default, (tiny, 1)), (aten.linalg_vector_norm.default, (tiny, math.inf))]:
        check_op(op, args, mesh_shape=(4,), layouts=layouts)


def test_reduction_module_doctests_pass() -> None:
    result = doctest.testmod(_reduction)
    assert result.attempted > 0 and result.failed == 0


# -- the propagator's choices -----------------------------------------------------------------

def choose(op: Any, args: Sequence[Any], layouts: Sequence[tuple[Placement, ...]], mesh_shape: tuple[int, ...] = (4,),
           kwargs: dict[str, Any] | None = None, orders: Sequence[Any] = ()) -> OutputSharding:
    lays = [Layout(tuple(p), orders[k] if k < len(orders) else ()) for k, p in enumerate(layouts)]
    return propagate(schema_for(op, args, kwargs or {}, AbstractMesh(mesh_shape), lays))


def placements_of(result: OutputSharding, k: int = 0) -> tuple[Placement, ...]:
    out = result.output_spec
    spec = out[k] if isinstance(out, tuple) else out
    assert isinstance(spec, DTensorSpec)
    return spec.placements


def test_sum_over_a_sharded_dim_is_a_partial_sum_without_communication() -> None:
    r = choose(aten.sum.dim_IntList, (EVEN, [0]), [(S0,)])
    assert not r.needs_redistribute and placements_of(r) == (P,)
    r = choose(aten.sum.dim_IntList, (EVEN, [1]), [(S0, S1)], (2, 2))
    assert not r.needs_redistribute and placements_of(r) == (S0, P)
    # linear: a partial sum (or average) input stays partial
    for partial in (P, PAVG):
        r = choose(aten.sum.default, (EVEN,), [(partial,)])
        assert not r.needs_redistribute and placements_of(r) == (partial,)
    # max of a partial sum is not the sum of maxes: the input is reduced first
    r = choose(aten.amax.default, (EVEN, [0]), [(P,)])
    assert r.input_specs[0] is not None and not r.input_specs[0].placements[0].is_partial()


def test_mean_is_a_partial_average_only_when_every_rank_averages_as_many_elements() -> None:
    r = choose(aten.mean.dim, (EVEN, [0]), [(S0,)])  # 8 rows on 4 ranks: 2 each
    assert not r.needs_redistribute and placements_of(r) == (PAVG,)
    r = choose(aten.mean.dim, (UNEVEN, [0]), [(S0,)])  # 5 rows: 2, 2, 1, 0
    assert placements_of(r) != (PAVG,) and r.input_specs[0] is not None
    assert r.input_specs[0].placements != (S0,)
    r = choose(aten.mean.dim, (UNEVEN, [1]), [(S0,)])  # the reduced dim is whole: the shard is kept
    assert not r.needs_redistribute and placements_of(r) == (S0,)
    r = choose(aten.mean.default, (EVEN,), [(S0, S0)], (2, 2))  # 8 -> 4 -> 2 rows each
    assert not r.needs_redistribute and placements_of(r) == (PAVG, PAVG)


def test_max_is_a_partial_max_unless_a_rank_would_reduce_an_empty_piece() -> None:
    r = choose(aten.amax.default, (EVEN, [0]), [(S0,)])
    assert not r.needs_redistribute and placements_of(r) == (PMAX,)
    r = choose(aten.amin.default, (EVEN, [0]), [(PMIN,)])
    assert not r.needs_redistribute and placements_of(r) == (PMIN,)
    r = choose(aten.max.default, (UNEVEN,), [(S0,)])  # rank 3 holds 0 rows: max() of nothing raises
    assert placements_of(r) != (PMAX,) and r.needs_redistribute
    r = choose(aten.aminmax.default, (EVEN,), [(S1,)], kwargs={"dim": 1})
    assert not r.needs_redistribute and (placements_of(r, 0), placements_of(r, 1)) == ((PMIN,), (PMAX,))
    r = choose(aten.any.dim, (EVEN > 0, 1), [(S1,)])
    assert not r.needs_redistribute and placements_of(r) == (PMAX,)


def test_a_dim_that_must_be_whole_moves_to_another_dim_rather_than_gathering() -> None:
    for op, args in [(aten._softmax.default, (EVEN, 1, False)), (aten.argmax.default, (EVEN, 1)),
                     (aten.var.correction, (EVEN, [1])), (aten.cumsum.default, (EVEN, 1))]:
        r = choose(op, args, [(S1,)])
        target = r.input_specs[0]
        assert target is not None and target.placements[0].is_shard() and target.placements[0] != S1, op
        assert placements_of(r)[0].is_shard(), op


def test_reductions_keep_a_non_default_split_order() -> None:
    mesh_shape, order = (2, 2), ((0, (1, 0)),)  # tensor dim 0 split by mesh dim 1 first
    full = randn(8, 6, 3, seed=5)
    for op, args in [(aten.sum.dim_IntList, (full, [1])), (aten._softmax.default, (full, 2, False)),
                     (aten.var.correction, (full, [2])), (aten.native_layer_norm.default, (full, [3], None, None, 1e-5))]:
        r = choose(op, args, [(S0, S0)], mesh_shape, orders=[order])
        assert not r.needs_redistribute, op
        out = r.output_spec[0] if isinstance(r.output_spec, tuple) else r.output_spec
        assert out is not None and out.placements == (S0, S0) and out.shard_order == order, op
        pieces = {}
        for c in coordinates(mesh_shape):
            got = op(local_piece(full, mesh_shape, (S0, S0), c, {0: (1, 0)}), *args[1:])
            pieces[c] = got[0] if isinstance(got, tuple) else got
        want = op(*args)
        torch.testing.assert_close(assemble(pieces, mesh_shape, (S0, S0), {0: (1, 0)}),
                                   want[0] if isinstance(want, tuple) else want)


# -- softmax and normalization layers ---------------------------------------------------------

X, G = randn(6, 5, 4, seed=6), randn(6, 5, 4, seed=7)  # 6 and 5 split unevenly on 4 ranks, 4 evenly
W, B = randn(4, seed=8), randn(4, seed=9)
LN = aten.native_layer_norm.default(X, [4], W, B, 1e-5)
SM, LSM = aten._softmax.default(X, 1, False), aten._log_softmax.default(X, 2, False)

ACTIVATION_LAYOUTS = {
    (4,): [(S0,), (S1,), (S2,), (R,), (P,)],
    (2, 2): [(S0, S1), (S1, S0), (S2, S0), (R, S1), (P, S0), (S1, PAVG)],
}


def with_grad_layouts(mesh_shape: tuple[int, ...], rest: Sequence[tuple[Placement, ...]]) -> list[list[Any]]:
    """Grad layouts (Partial included) x activation layouts, then the listed layouts for the other inputs."""
    nd = len(mesh_shape)
    grads = [(P,) * nd, (PAVG,) + (R,) * (nd - 1), (S0,) * nd, (R,) * nd]
    acts = [lay for lay in ACTIVATION_LAYOUTS[mesh_shape] if not any(p.is_partial() for p in lay)][:2]
    return [[g, a, *rest] for g in grads for a in acts]


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_softmax_forward_and_backward(mesh_shape: tuple[int, ...]) -> None:
    one = [[lay] for lay in ACTIVATION_LAYOUTS[mesh_shape]]
    check_op(aten._softmax.default, (X, 1, False), mesh_shape=mesh_shape, layouts=one)
    check_op(aten._log_softmax.default, (X, -1, False), mesh_shape=mesh_shape, layouts=one)
    pairs = [lay[:2] for lay in with_grad_layouts(mesh_shape, [])]
    check_op(aten._softmax_backward_data.default, (G, SM, 1, torch.float32), mesh_shape=mesh_shape, layouts=pairs)
    check_op(aten._log_softmax_backward_data.default, (G, LSM, 2, torch.float32), mesh_shape=mesh_shape, layouts=pairs)


def test_softmax_backward_keeps_a_partial_gradient() -> None:
    r = choose(aten._softmax_backward_data.default, (G, SM, 1, torch.float32), [(P,), (R,)])
    assert not r.needs_redistribute and placements_of(r) == (P,)
    r = choose(aten._softmax.default, (X, 0, False), [(P,)])  # not linear: reduced first
    assert placements_of(r) != (P,)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_layer_norm_forward_and_backward(mesh_shape: tuple[int, ...]) -> None:
    nd = len(mesh_shape)
    rep = (R,) * nd
    acts = [[lay, rep, rep] for lay in ACTIVATION_LAYOUTS[mesh_shape]]
    check_op(aten.native_layer_norm.default, (X, [4], W, B, 1e-5), mesh_shape=mesh_shape, layouts=acts, atol=1e-4)
    check_op(aten.native_layer_norm.default, (X, [5, 4], None, None, 1e-5), mesh_shape=mesh_shape,
             layouts=[lay[:1] for lay in acts], atol=1e-4)
    w2 = randn(5, 4, seed=20)
    check_op(aten.native_layer_norm.default, (X, [5, 4], w2, None, 1e-5), mesh_shape=mesh_shape,
             layouts=[lay[:2] for lay in acts][:2], atol=1e-4)
    for mask in ([True, True, True], [True, False, True], [False, True, False]):
        layouts = [lay[:2] + [lay[1], lay[1], rep, rep] for lay in with_grad_layouts(mesh_shape, [])]
        check_op(aten.native_layer_norm_backward.default, (G, X, [4], LN[1], LN[2], W, B, mask),
                 mesh_shape=mesh_shape, layouts=layouts, atol=1e-4, rtol=1e-4)


def test_layer_norm_keeps_batch_shards_and_sums_parameter_grads() -> None:
    r = choose(aten.native_layer_norm.default, (X, [4], W, B, 1e-5), [(S0, S1), (R, R), (R, R)], (2, 2))
    assert not r.needs_redistribute and [placements_of(r, k) for k in range(3)] == [(S0, S1)] * 3
    r = choose(aten.native_layer_norm.default, (X, [5, 4], None, None, 1e-5), [(S2,)])
    assert r.input_specs[0] is not None and r.input_specs[0].placements == (S0,)  # moved onto the batch dim
    act = (S0, S1)
    r = choose(aten.native_layer_norm_backward.default, (G, X, [4], LN[1], LN[2], W, B, [True, True, True]),
               [act, act, act, act, (R, R), (R, R)], (2, 2))
    assert not r.needs_redistribute
    assert [placements_of(r, k) for k in range(3)] == [act, (P, P), (P, P)]
    r = choose(aten.native_layer_norm_backward.default, (G, X, [4], LN[1], LN[2], W, B, [True, True, False]),
               [(P,), (R,), (R,), (R,), (R,), (R,)])
    assert not r.needs_redistribute and [placements_of(r, k) for k in range(2)] == [(P,), (P,)]
    assert isinstance(r.output_spec, tuple) and r.output_spec[2] is None


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_fused_rms_norm(mesh_shape: tuple[int, ...]) -> None:
    rep = (R,) * len(mesh_shape)
    acts = [[lay, rep] for lay in ACTIVATION_LAYOUTS[mesh_shape]]
    check_op(aten._fused_rms_norm.default, (X, [4], W, 1e-5), mesh_shape=mesh_shape, layouts=acts, atol=1e-4)


def _rms_backward_reference(grad: torch.Tensor, x: torch.Tensor, shape: list[int], rstd: torch.Tensor,
                            weight: torch.Tensor, mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """_fused_rms_norm_backward has no CPU kernel: its closed form, for the simulator."""
    dims = list(range(x.ndim - len(shape), x.ndim))
    xhat = x * rstd  # (..., *shape)
    gw = grad * weight
    gi = rstd * (gw - xhat * (gw * xhat).mean(dims, keepdim=True))
    return gi, (grad * xhat).sum(list(range(x.ndim - len(shape))))


class _RmsBackward:
    _schema = aten._fused_rms_norm_backward.default._schema

    def __call__(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _rms_backward_reference(*args)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_fused_rms_norm_backward_against_its_closed_form(mesh_shape: tuple[int, ...]) -> None:
    x = X.clone().requires_grad_(True)
    w = W.clone().requires_grad_(True)
    out, rstd = aten._fused_rms_norm.default(x, [4], w, 1e-5)
    out.backward(G)
    want = _rms_backward_reference(G, X, [4], rstd.detach(), W, [True, True])
    torch.testing.assert_close(want, (x.grad, w.grad))  # the reference itself is right
    rep = (R,) * len(mesh_shape)
    mesh = AbstractMesh(mesh_shape)
    args = (G, X, [4], rstd.detach(), W, [True, True])
    for g, a, *_ in with_grad_layouts(mesh_shape, []):
        layouts = [Layout(g), Layout(a), Layout(a), Layout(rep)]
        strategy = get_op_strategy(aten._fused_rms_norm_backward.default)(schema_for(
            aten._fused_rms_norm_backward.default, args, {}, mesh, layouts))
        assert isinstance(strategy, OpStrategy) and len(strategy.strategies) > 1
        for cand in strategy.strategies:
            got = simulate(_RmsBackward(), args, {}, mesh_shape, cand, layouts)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{cand}: {m}")


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_group_norm_runs_replicated_but_passes_a_partial_gradient_through(mesh_shape: tuple[int, ...]) -> None:
    x, c = randn(4, 6, 5, seed=10), randn(6, seed=11)
    out = aten.native_group_norm.default(x, c, c, 4, 6, 5, 2, 1e-5)
    nd = len(mesh_shape)
    check_op(aten.native_group_norm.default, (x, c, c, 4, 6, 5, 2, 1e-5), mesh_shape=mesh_shape,
             layouts=[[(S0,) * nd, (R,) * nd, (R,) * nd], [(P,) * nd, (S0,) * nd, (R,) * nd]])
    g = randn(4, 6, 5, seed=12)
    check_op(aten.native_group_norm_backward.default, (g, x, out[1], out[2], c, 4, 6, 5, 2, [True, True, True]),
             mesh_shape=mesh_shape, layouts=[[(P,) * nd, (S0,) * nd, (R,) * nd, (R,) * nd, (R,) * nd]], atol=1e-4)
    r = choose(aten.native_group_norm_backward.default, (g, x, out[1], out[2], c, 4, 6, 5, 2, [True, True, True]),
               [(P,), (R,), (R,), (R,), (R,)])
    assert not r.needs_redistribute and placements_of(r, 1) == (P,)


# -- batch norm ---------------------------------------------------------------------------------

BX = randn(6, 8, 3, seed=13)  # (N, C, L): 8 channels split evenly, 6 rows and 3 positions not
BC, BRM, BRV = randn(8, seed=14), randn(8, seed=15), randn(8, seed=16).abs() + 0.5


def bn_layouts(mesh_shape: tuple[int, ...], n_tensors: int, act: tuple[Placement, ...]) -> list[Any]:
    """The activation layout, then each per-channel tensor Shard(0) where it shards channels, else Replicate."""
    per_channel = tuple(S0 if p == S1 else R for p in act)
    return [act] + [per_channel] * (n_tensors - 1)


BN_ACTS = {(4,): [(S1,), (S0,), (S2,), (R,), (P,)], (2, 2): [(S1, S0), (S0, S1), (S2, R), (S1, S1), (P, S1)]}


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_batch_norm_forward_every_variant(mesh_shape: tuple[int, ...]) -> None:
    for training in (True, False):
        for op, args in [
            (aten.native_batch_norm.default, (BX, BC, BC, BRM.clone(), BRV.clone(), training, 0.1, 1e-5)),
            (aten._native_batch_norm_legit.default, (BX, BC, BC, BRM.clone(), BRV.clone(), training, 0.1, 1e-5)),
            (aten._native_batch_norm_legit_functional.default, (BX, BC, BC, BRM, BRV, training, 0.1, 1e-5)),
            (aten._native_batch_norm_legit.no_stats, (BX, BC, BC, training, 0.1, 1e-5)),
            (aten.native_batch_norm.default, (BX, None, None, None, None, True, 0.1, 1e-5)),
        ]:
            if not training and op is aten._native_batch_norm_legit.no_stats:
                continue
            n = sum(isinstance(a, torch.Tensor) for a in args)
            layouts = [bn_layouts(mesh_shape, n, act) for act in BN_ACTS[mesh_shape]]
            check_op(op, args, mesh_shape=mesh_shape, layouts=layouts, atol=1e-4, rtol=1e-4)
    eval_args = (BX, BC, BC, BRM, BRV, 0.1, 1e-5)
    check_op(aten._native_batch_norm_legit_no_training.default, eval_args, mesh_shape=mesh_shape,
             layouts=[bn_layouts(mesh_shape, 5, act) for act in BN_ACTS[mesh_shape]], atol=1e-4)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_batch_norm_backward_train_and_eval(mesh_shape: tuple[int, ...]) -> None:
    g = randn(6, 8, 3, seed=17)
    for train in (True, False):
        # eval: the saved statistics are empty tensors, passed along all the same
        _, mean, invstd = aten.native_batch_norm.default(BX, BC, BC, BRM.clone(), BRV.clone(), train, 0.1, 1e-5)
        args = (g, BX, BC, BRM, BRV, mean, invstd, train, 1e-5, [True, True, True])
        layouts = []
        for act in BN_ACTS[mesh_shape]:
            activation = tuple(R if p.is_partial() else p for p in act)  # a Partial only on the gradient
            layouts.append([act] + bn_layouts(mesh_shape, 6, activation))
        check_op(aten.native_batch_norm_backward.default, args, mesh_shape=mesh_shape, layouts=layouts,
                 atol=1e-4, rtol=1e-4)
        masked = args[:-1] + ([True, False, True],)
        check_op(aten.native_batch_norm_backward.default, masked, mesh_shape=mesh_shape, layouts=layouts[:2],
                 atol=1e-4, rtol=1e-4)


def test_batch_norm_choices() -> None:
    per_channel = [(S0,)] * 4
    args = (BX, BC, BC, BRM, BRV, True, 0.1, 1e-5)
    r = choose(aten.native_batch_norm.default, args, [(S1,)] + per_channel)
    assert not r.needs_redistribute and [placements_of(r, k) for k in range(3)] == [(S1,), (S0,), (S0,)]
    # training statistics cover the batch: a batch shard is gathered, never normalized locally
    r = choose(aten.native_batch_norm.default, args, [(S0,)] + [(R,)] * 4)
    assert r.input_specs[0] is not None and r.input_specs[0].placements == (R,)
    # eval: the statistics are constants, so a batch shard stays (an empty piece included)
    eval_args = (BX, BC, BC, BRM, BRV, False, 0.1, 1e-5)
    r = choose(aten.native_batch_norm.default, eval_args, [(S0,)] + [(R,)] * 4)
    assert not r.needs_redistribute and placements_of(r) == (S0,)
    rows8 = randn(8, 8, 3, seed=18)  # the backward kernel crashes on an empty piece: 8 rows, 2 per rank
    grad_args = (rows8, rows8, BC, BRM, BRV, None, None, False, 1e-5, [True, True, True])
    r = choose(aten.native_batch_norm_backward.default, grad_args, [(S0,), (S0,)] + [(R,)] * 3)
    assert not r.needs_redistribute and [placements_of(r, k) for k in range(3)] == [(S0,), (P,), (P,)]
    r = choose(aten.native_batch_norm_backward.default, (BX, BX) + grad_args[2:], [(S0,), (S0,)] + [(R,)] * 3)
    assert r.needs_redistribute  # 6 rows: rank 3 would hold none
    grad_args = (BX, BX, BC, None, None, BRM, BRV, True, 1e-5, [True, True, True])
    r = choose(aten.native_batch_norm_backward.default, grad_args, [(S0,), (S0,)] + [(R,)] * 3)
    assert r.needs_redistribute and placements_of(r)[0] != S0  # training: the batch shard cannot stay
    r = choose(aten.native_batch_norm_backward.default, grad_args, [(P,), (R,)] + [(R,)] * 3)
    assert not r.needs_redistribute and [placements_of(r, k) for k in range(3)] == [(P,), (P,), (P,)]


def test_running_statistics_must_stay_put_in_training() -> None:
    args = (BX, BC, BC, BRM, BRV, True, 0.1, 1e-5)
    # replicated statistics and a channel-sharded input: the input is gathered, the statistics stay
    r = choose(aten.native_batch_norm.default, args, [(S1,), (S0,), (S0,), (R,), (R,)])
    assert r.input_specs[3] is None and r.input_specs[4] is None
    assert r.input_specs[0] is not None and r.input_specs[0].placements == (R,)
    with pytest.raises(ValueError, match=r"running_mean and running_var in place.*P\(sum\)"):
        choose(aten.native_batch_norm.default, args, [(S1,), (S0,), (S0,), (P,), (P,)])
    with pytest.raises(ValueError, match=r"same layout"):
        choose(aten.native_batch_norm.default, args, [(S1,), (S0,), (S0,), (S0,), (R,)])


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_running_statistics_updated_in_place_on_every_rank_match_one_device(mesh_shape: tuple[int, ...]) -> None:
    """Run the propagator's choice rank by rank, letting each rank update its own pieces of
    running_mean / running_var, and reassemble them from the layout they had."""
    op = aten.native_batch_norm.default
    mesh = AbstractMesh(mesh_shape)
    for act in BN_ACTS[mesh_shape]:
        if any(p.is_partial() for p in act):
            continue
        layouts = [Layout(lay) for lay in bn_layouts(mesh_shape, 5, act)]
        rm, rv = BRM.clone(), BRV.clone()
        want = op(BX, BC, BC, rm, rv, True, 0.1, 1e-5)
        result = propagate(schema_for(op, (BX, BC, BC, BRM, BRV, True, 0.1, 1e-5), {}, mesh, layouts))
        assert result.input_specs[3] is None and result.input_specs[4] is None
        ran = [(lay if t is None else Layout(t.placements, t.shard_order)) for lay, t in zip(layouts, result.input_specs)]
        outs, stats = {}, {}
        for c in coordinates(mesh_shape):
            local = [local_piece(t, mesh_shape, lay.placements, c).clone() for t, lay in zip((BX, BC, BC, BRM, BRV), ran)]
            outs[c] = op(*local[:3], local[3], local[4], True, 0.1, 1e-5)[0]
            stats[c] = (local[3], local[4])
        assert isinstance(result.output_spec, tuple) and result.output_spec[0] is not None
        torch.testing.assert_close(assemble(outs, mesh_shape, result.output_spec[0].placements), want[0],
                                   atol=1e-5, rtol=1e-5)
        for k, full in ((0, rm), (1, rv)):
            got = assemble({c: s[k] for c, s in stats.items()}, mesh_shape, layouts[3 + k].placements)
            torch.testing.assert_close(got, full, msg=lambda m: f"{act}: {m}")


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("op", [torch.ops.aten.cummax.default, torch.ops.aten.cummin.default])
def test_running_max_min_keep_shards_off_the_scanned_dim(mesh_shape: tuple[int, ...], op: object) -> None:
    for shape, dim in [((6, 5), 0), ((7, 3), 1), ((3, 1), 0)]:
        assert check_op(op, (torch.randn(*shape), dim), mesh_shape=mesh_shape) > 0
