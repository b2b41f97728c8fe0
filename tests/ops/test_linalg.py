"""Batched linear algebra strategies, checked by simulating every rank (no processes).

Each case runs `check_op` on meshes (4,) and (2, 2): every candidate is simulated for a sample
of input layouts (Shard on each dim, Replicate, Partial) and its reassembled outputs compared
with the op on full tensors. Batch sizes are even, uneven and smaller than the mesh; inputs
are well conditioned (SPD matrices for Cholesky and solves) so float32 tolerances hold.
Decompositions whose outputs are not unique (signs of SVD/QR/eig vectors) compare raw outputs:
each simulated rank runs the same kernel on the same matrices, so they agree exactly.
A few tests pin what the propagator picks: batch-split inputs run without gathering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import warnings

import pytest
import torch

import shardwise as sw
from shardwise import AbstractMesh, DTensor, Partial, Placement, Replicate, Shard
from shardwise._ops import Layout, get_op_strategy, propagate

from shardwise.testing import distributed

from ..strategy_sim import check_op, schema_for

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]
BATCHES = [(4,), (5,), (3, 2), (1, 6)]  # even, uneven, two batch dims, a broadcastable 1
R = Replicate()
TOL = {"atol": 1e-4, "rtol": 1e-4}


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def spd(*batch: int, n: int = 4, seed: int = 0) -> torch.Tensor:
    a = randn(*batch, n, n, seed=seed, dtype=torch.float64)
    return (a @ a.mT + n * torch.eye(n, dtype=torch.float64)).float()


def pick(op: Any, args: Sequence[Any], placements: Sequence[Sequence[Placement]], mesh_shape: Sequence[int] = (4,),
         kwargs: dict[str, Any] | None = None) -> Any:
    schema = schema_for(op, args, kwargs or {}, AbstractMesh(tuple(mesh_shape)), [Layout(tuple(p)) for p in placements])
    return propagate(schema)


# layouts tried on mesh (2, 2), where the default sample would be slow: splits of the batch
# dims (nested, crossed, uneven), a split matrix dim, a Partial, replicated
GRID = [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), R), (R, Shard(1)),
        (Partial(), Shard(0)), (Shard(-1), Shard(0)), (R, R)]


def grid_layouts(args: Sequence[Any], kwargs: dict[str, Any]) -> list[list[Layout]]:
    """Every input alike from GRID, then the first input replicated and the others from GRID."""
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor) and t.ndim > 0]

    def fit(t: torch.Tensor, ps: tuple[Placement, ...]) -> Layout:
        return Layout(tuple(Shard(p.dim % t.ndim) if isinstance(p, Shard) else p for p in ps))

    combos = [[fit(t, ps) for t in tensors] for ps in GRID]
    if len(tensors) > 1:
        combos += [[Layout((R, R))] + [fit(t, ps) for t in tensors[1:]] for ps in GRID[:-1]]
    return combos


def check(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, mesh_shape: Sequence[int] = (4,)) -> None:
    kwargs = kwargs or {}
    layouts = grid_layouts(args, kwargs) if len(mesh_shape) == 2 else None
    assert check_op(op, args, kwargs, mesh_shape=mesh_shape, layouts=layouts, **TOL) > 0


# -- one matrix in ---------------------------------------------------------------------------

UNARY = [
    (aten._linalg_svd.default, {}), (aten._linalg_svd.default, {"full_matrices": True}),
    (aten._linalg_svd.default, {"compute_uv": False}),
    (aten.linalg_inv_ex.default, {}), (aten.linalg_lu_factor_ex.default, {}), (aten.linalg_lu.default, {}),
    (aten.linalg_cholesky_ex.default, {}), (aten.cholesky.default, {}), (aten.cholesky_inverse.default, {}),
    (aten.linalg_eig.default, {}), (aten._linalg_eigh.default, {}), (aten._linalg_eigh.default, {"compute_v": False}),
    (aten.linalg_ldl_factor_ex.default, {}), (aten.linalg_qr.default, {}), (aten.linalg_qr.default, {"mode": "r"}),
    (aten.linalg_qr.default, {"mode": "complete"}),
    (aten._linalg_slogdet.default, {}), (aten._linalg_det.default, {}),
    (aten.linalg_matrix_exp.default, {}), (aten.linalg_pinv.atol_rtol_tensor, {}),
]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("op,kwargs", UNARY, ids=[f"{o.__name__}{k}" for o, k in UNARY])
def test_unary(mesh_shape: tuple[int, ...], op: Any, kwargs: dict[str, Any]) -> None:
    for batch in [(6,)] if mesh_shape == (4,) else [(3, 2)]:  # uneven: 6 over 4 ranks, 3 over 2
        a = spd(*batch, n=3)
        if op is aten.cholesky_inverse.default:
            a = torch.linalg.cholesky(a)
        check(op, (a,), kwargs, mesh_shape)


def test_unbatched_matrix_is_replicated() -> None:
    """A lone matrix has no batch dim: every candidate gathers it."""
    strategy = get_op_strategy(aten.linalg_inv_ex.default)
    assert strategy is not None
    schema = schema_for(aten.linalg_inv_ex.default, (spd(n=4),), {}, AbstractMesh((4,)), [Layout((Shard(0),))])
    for cand in strategy(schema).strategies:
        assert cand.input_specs == (Layout((R,)),)
    check(aten.linalg_inv_ex.default, (spd(n=5),))


def test_batch_split_runs_in_place() -> None:
    a = spd(8, n=3)
    for op in (aten._linalg_svd.default, aten.linalg_inv_ex.default, aten._linalg_det.default, aten.linalg_eig.default):
        chosen = pick(op, (a,), [(Shard(0),)])
        assert all(s is None for s in chosen.input_specs), op
        assert all(o.placements == (Shard(0),) for o in chosen.output_spec), op
    chosen = pick(aten.linalg_inv_ex.default, (spd(2, 3, n=3),), [(Shard(1), Shard(0))], mesh_shape=(2, 2))
    assert all(s is None for s in chosen.input_specs)
    # the matrix dims must be whole: a split row block is gathered
    chosen = pick(aten.linalg_inv_ex.default, (a,), [(Shard(1),)])
    assert chosen.input_specs[0].placements == (R,)
    # not linear: a Partial input is reduced first
    chosen = pick(aten.linalg_matrix_exp.default, (a,), [(Partial(),)])
    assert chosen.input_specs[0].placements == (R,)


def test_pinv_tolerance_tensors() -> None:
    a, atol = randn(6, 3, 4), randn(6, seed=1).abs()
    for mesh_shape in MESHES:
        check(aten.linalg_pinv.atol_rtol_tensor, (a,), {"atol": atol, "hermitian": False}, mesh_shape)


# -- solves ----------------------------------------------------------------------------------


def _solve_cases() -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    a, b = spd(5, n=3), randn(5, 3, 2, seed=1)
    lone, wide_b = spd(n=3, seed=2), randn(4, 3, 2, seed=3)
    lu, piv = torch.linalg.lu_factor(a)
    ld, lpiv = torch.linalg.ldl_factor(a)
    chol = torch.linalg.cholesky(a)
    qa, tau = torch.geqrf(randn(5, 3, 3, seed=4))
    tri = torch.linalg.cholesky(a).mT.contiguous()
    return [
        (aten._linalg_solve_ex.default, (a, b), {}),
        (aten._linalg_solve_ex.default, (a, randn(5, 3, seed=5)), {}),       # batch of vectors
        (aten._linalg_solve_ex.default, (lone, wide_b), {}),                # A broadcast over B's batch
        (aten._linalg_solve_ex.default, (a, randn(5, 2, 3, seed=6)), {"left": False}),
        (aten.linalg_lu_solve.default, (lu, piv, b), {}),
        (aten.lu_unpack.default, (lu, piv), {}),
        (aten.lu_unpack.default, (lu, piv, False, True), {}),
        (aten.linalg_lu_solve.default, (lu, piv, b.mT.contiguous()), {"left": False}),
        (aten.cholesky_solve.default, (b, chol), {}),
        (aten.cholesky_solve.default, (wide_b, torch.linalg.cholesky(lone)), {}),
        (aten.linalg_ldl_solve.default, (ld, lpiv, b), {}),
        (aten.triangular_solve.default, (b, tri), {}),
        (aten.triangular_solve.default, (wide_b, lone.triu()), {}),
        (aten.linalg_solve_triangular.default, (tri, b), {"upper": True}),
        (aten.linalg_householder_product.default, (qa, tau), {}),
        (aten.ormqr.default, (qa, tau, b), {}),
    ]


SOLVES = _solve_cases()


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("case", range(len(SOLVES)))
def test_solves(mesh_shape: tuple[int, ...], case: int) -> None:
    op, args, kwargs = SOLVES[case]
    check(op, args, kwargs, mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_solve_two_batch_dims_with_broadcast(mesh_shape: tuple[int, ...]) -> None:
    a, b = spd(1, 3, n=3), randn(4, 3, 3, 2, seed=1)
    layouts = [[Layout((Shard(1),) * len(mesh_shape)), Layout((Shard(0),) * len(mesh_shape))],
               [Layout((R,) * len(mesh_shape)), Layout((Shard(1),) * len(mesh_shape))],
               [Layout((Shard(1),) + (R,) * (len(mesh_shape) - 1)), Layout((Shard(0),) * len(mesh_shape))]]
    for op, args in [(aten._linalg_solve_ex.default, (a, b)), (aten.cholesky_solve.default, (b, torch.linalg.cholesky(a)))]:
        assert check_op(op, args, {}, mesh_shape=mesh_shape, layouts=layouts, **TOL) > 0


def test_solve_keeps_partial_rhs() -> None:
    """Solves are linear in the right-hand side: a partial B gives a partial solution, no reduction."""
    a, b = spd(4, n=3), randn(4, 3, 2, seed=1)
    chosen = pick(aten._linalg_solve_ex.default, (a, b), [(Shard(0),), (Partial(),)], mesh_shape=(4,))
    chosen = pick(aten._linalg_solve_ex.default, (a, b), [(R,), (Partial(),)], mesh_shape=(4,))
    assert all(s is None for s in chosen.input_specs)
    assert chosen.output_spec[0].placements == (Partial(),)
    assert chosen.output_spec[1].placements == (R,)
    chosen = pick(aten.cholesky_solve.default, (b, torch.linalg.cholesky(a)), [(Partial("avg"),), (R,)])
    assert chosen.output_spec.placements == (Partial("avg"),) and all(s is None for s in chosen.input_specs)
    # but the matrix side is not linear
    chosen = pick(aten.cholesky_solve.default, (b, torch.linalg.cholesky(a)), [(R,), (Partial(),)])
    assert chosen.input_specs[1] is not None and chosen.input_specs[1].placements == (R,)
    for mesh_shape in MESHES:
        n = len(mesh_shape)
        layouts = [[Layout((R,) * n), Layout((Partial(),) * n)], [Layout((Shard(0),) * n), Layout((Partial("avg"),) * n)],
                   [Layout((Shard(0),) + (R,) * (n - 1)), Layout((Partial(),) * n)]]
        for op, args in [(aten._linalg_solve_ex.default, (a, b)), (aten.linalg_solve_triangular.default, (a.triu(), b))]:
            kwargs = {"upper": True} if op is aten.linalg_solve_triangular.default else {}
            assert check_op(op, args, kwargs, mesh_shape=mesh_shape, layouts=layouts, **TOL) > 0


# -- cross -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shapes,dim", [(((5, 3), (5, 3)), -1), (((3, 6), (3, 6)), 0), (((4, 1, 3), (4, 7, 3)), 2),
                                        (((2, 3, 5), (1, 3, 5)), 1)])
def test_cross(mesh_shape: tuple[int, ...], shapes: tuple[tuple[int, ...], ...], dim: int) -> None:
    x, y = randn(*shapes[0]), randn(*shapes[1], seed=1)
    check(aten.linalg_cross.default, (x, y), {"dim": dim}, mesh_shape)


def test_cross_keeps_split_and_partial() -> None:
    x, y = randn(8, 3), randn(8, 3, seed=1)
    chosen = pick(aten.linalg_cross.default, (x, y), [(Shard(0),), (Shard(0),)])
    assert all(s is None for s in chosen.input_specs) and chosen.output_spec.placements == (Shard(0),)
    chosen = pick(aten.linalg_cross.default, (x, y), [(Partial(),), (R,)])
    assert all(s is None for s in chosen.input_specs) and chosen.output_spec.placements == (Partial(),)
    chosen = pick(aten.linalg_cross.default, (x, y), [(Shard(1),), (R,)])
    assert chosen.input_specs[0].placements == (R,)


# -- error checks ----------------------------------------------------------------------------


def test_check_errors_gathers_info_so_every_rank_raises_together() -> None:
    # a sharded info checked where it lies would raise on some ranks only; the others would
    # hang in their next collective
    fn = get_op_strategy(aten._linalg_check_errors.default)
    assert fn is not None
    info = torch.zeros(8, dtype=torch.int32)
    mesh = AbstractMesh((2, 2))
    for layout in [Layout((Shard(0), R)), Layout((Shard(0), Partial()))]:
        schema = schema_for(aten._linalg_check_errors.default, (info, "linalg.inv"), {"is_matrix": False}, mesh,
                            [layout])
        (cand,) = fn(schema).strategies
        assert cand.output_specs is None and cand.input_specs == (Layout((R, R)),)
        assert propagate(schema).output_spec is None


# -- real ranks: forward and backward ---------------------------------------------------------


def _spd_fn(f: Any) -> Any:
    """`f` of an SPD matrix built from the leaf, so gradients flow through the factorization."""
    return lambda a, *rest: f(a @ a.mT + 3 * torch.eye(a.shape[-1]), *rest)


RANK_CASES: dict[str, tuple[Any, list[tuple[int, ...]]]] = {
    "inv": (_spd_fn(torch.linalg.inv), [(6, 3, 3)]),
    "solve": (_spd_fn(torch.linalg.solve), [(6, 3, 3), (6, 3, 2)]),
    "cholesky_solve": (_spd_fn(lambda s, b: torch.cholesky_solve(b, torch.linalg.cholesky(s))), [(6, 3, 3), (6, 3, 2)]),
    "det": (_spd_fn(torch.linalg.det), [(6, 3, 3)]),
    "slogdet": (_spd_fn(lambda s: torch.linalg.slogdet(s)[1]), [(6, 3, 3)]),
    "eigvalsh": (_spd_fn(torch.linalg.eigvalsh), [(6, 3, 3)]),
    "svdvals": (torch.linalg.svdvals, [(6, 4, 3)]),
    "qr_product": (lambda a: (lambda q, r: q @ r)(*torch.linalg.qr(a)), [(6, 4, 3)]),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a / 4), [(6, 3, 3)]),
    "cross": (lambda x, y: torch.linalg.cross(x, y), [(6, 5, 3), (6, 5, 3)]),
}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@distributed(world_size=4)
def test_linalg_forward_and_backward_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    layout = [Shard(0)] if mesh_shape == (4,) else [Shard(0), R]  # batch 6: uneven over 4 ranks
    for name, (fn, shapes) in RANK_CASES.items():
        fulls = [randn(*s, seed=k) for k, s in enumerate(shapes)]
        refs = [t.clone().requires_grad_(True) for t in fulls]
        want = fn(*refs)
        want.pow(2).sum().backward()
        leaves = [sw.distribute_tensor(t.clone().requires_grad_(True), mesh, layout) for t in fulls]
        with warnings.catch_warnings(record=True) as caught, sw.implicit_replication():  # the eye of _spd_fn
            warnings.simplefilter("always")
            got = fn(*leaves)
        assert isinstance(got, DTensor), name
        gathered = [str(w.message) for w in caught if "no sharding strategy" in str(w.message)]
        assert not gathered, f"{name}: linalg ops fell back to replicated execution: {gathered}"
        assert got.placements[0] == Shard(0), f"{name}: output {got.placements}, expected the batch split kept"
        torch.testing.assert_close(got.full_tensor(), want, **TOL, msg=lambda m: f"{name}: output\n{m}")
        got.full_tensor().pow(2).sum().backward()
        for k, (leaf, ref) in enumerate(zip(leaves, refs)):
            assert isinstance(leaf.grad, DTensor), f"{name}: leaf {k} got no DTensor grad"
            torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL, msg=lambda m: f"{name}: grad {k}\n{m}")
