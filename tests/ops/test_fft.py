"""FFT family strategies (`_fft_c2c/r2c/c2r`, conjugation, `view_as_real/complex`), simulated.

Every candidate the strategy offers (and the propagator's pick) runs on every simulated
rank of meshes (4,) and (2, 2), for even and uneven shapes and dims smaller than the
mesh, with Shard/Replicate/Partial inputs. Complex Partial inputs are split into genuine
random complex terms (the shared simulator splits only real floating tensors), so a
strategy that kept a Partial through a non-linear step would fail. One multi-rank test
runs `torch.fft.*` end to end, forward and backward, against a single device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shardwise import AbstractMesh, Partial, Replicate, Shard
from shardwise._ops import Layout, OutputSharding, propagate
from shardwise._spec import DTensorSpec
from shardwise.testing import distributed

from .. import strategy_sim
from ..strategy_sim import check_op, schema_for

aten = torch.ops.aten

MESHES = [(4,), (2, 2)]


@pytest.fixture(autouse=True)
def complex_partial_terms(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Split complex Partial inputs into random complex terms and reassemble complex outputs,
    both through their real view (the shared simulator handles real tensors only)."""
    real_terms = strategy_sim._terms

    def terms(full: torch.Tensor, mesh_shape: Any, layout: Layout, seed: int) -> Any:
        if not full.is_complex():
            return real_terms(full, mesh_shape, layout, seed)
        pieces = real_terms(torch.view_as_real(full), mesh_shape, layout, seed)
        return {c: torch.view_as_complex(p.contiguous()) for c, p in pieces.items()}

    real_assemble = strategy_sim.assemble_output

    def assemble(pieces: dict[Any, torch.Tensor], mesh_shape: Any, layout: Layout) -> torch.Tensor:
        # `_conj` pieces are lazy views, resolved as the dispatcher does
        if not any(p.is_complex() for p in pieces.values()):
            return real_assemble(pieces, mesh_shape, layout)
        real = {k: torch.view_as_real(p.resolve_conj()) for k, p in pieces.items()}
        return torch.view_as_complex(real_assemble(real, mesh_shape, layout).contiguous())

    monkeypatch.setattr(strategy_sim, "_terms", terms)
    monkeypatch.setattr(strategy_sim, "assemble_output", assemble)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny FFTs: a thread pool per call only costs time
    yield
    torch.set_num_threads(threads)


def r(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def c(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.complex128)


# (id, op, args): even shapes, uneven ones, dims smaller than the mesh; every norm mode.
CASES: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("c2c_last", aten._fft_c2c.default, (c(8, 6), [1], 0, True)),
    ("c2c_first_uneven", aten._fft_c2c.default, (c(5, 6), [0], 1, False)),
    ("c2c_2d_of_3d", aten._fft_c2c.default, (c(3, 4, 5), [1, 2], 2, True)),
    ("c2c_outer_dims", aten._fft_c2c.default, (c(6, 3, 4), [0, 2], 1, True)),
    ("c2c_all", aten._fft_c2c.default, (c(4, 6), [0, 1], 0, False)),
    ("c2c_small_batch", aten._fft_c2c.default, (c(3, 8), [1], 0, True)),
    ("r2c_onesided", aten._fft_r2c.default, (r(8, 6), [1], 0, True)),
    ("r2c_twosided", aten._fft_r2c.default, (r(5, 7), [1], 2, False)),
    ("r2c_2d_of_3d", aten._fft_r2c.default, (r(3, 4, 6), [0, 2], 1, True)),
    ("r2c_first_dim", aten._fft_r2c.default, (r(7, 5), [0], 0, True)),
    ("c2r_even", aten._fft_c2r.default, (c(8, 5), [1], 2, 8)),
    ("c2r_odd", aten._fft_c2r.default, (c(6, 4), [1], 0, 7)),
    ("c2r_2d_of_3d", aten._fft_c2r.default, (c(5, 4, 3), [0, 2], 1, 4)),
    ("c2r_first_dim_uneven", aten._fft_c2r.default, (c(3, 5), [0], 0, 4)),
    ("conj", aten._conj.default, (c(5, 6),)),
    ("conj_physical_", aten._conj_physical.default, (c(6, 3),)),
    ("conj_physical", aten.conj_physical.default, (c(3, 7),)),
    ("conj_physical_inplace", aten.conj_physical_.default, (c(4, 5),)),
    ("conj_physical_real", aten.conj_physical.default, (r(5, 4),)),
    ("view_as_real", aten.view_as_real.default, (c(5, 6),)),
    ("view_as_real_1d", aten.view_as_real.default, (c(7),)),
    ("view_as_complex", aten.view_as_complex.default, (r(6, 5, 2),)),
    ("view_as_complex_uneven", aten.view_as_complex.default, (r(3, 2),)),
]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_candidate_matches_single_device(case: tuple[str, Any, tuple[Any, ...]], mesh_shape: tuple[int, ...]) -> None:
    _, op, args = case
    n = check_op(op, args, mesh_shape=mesh_shape, atol=1e-9, rtol=1e-9)
    assert n > 0


PARTIAL_LAYOUTS: dict[str, list[list[Layout]]] = {
    "1d": [[Layout((Partial("avg"),))], [Layout((Partial("max"),))], [Layout((Partial("min"),))]],
    "2d": [
        [Layout((Partial("avg"), Shard(0)))],
        [Layout((Shard(0), Partial("sum")))],
        [Layout((Partial("max"), Partial("sum")))],
        [Layout((Partial("sum"), Partial("avg")))],
    ],
}


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten._fft_r2c.default, (r(8, 6), [1], 0, True)),
        (aten._fft_r2c.default, (r(5, 6), [1], 1, False)),
        (aten._fft_c2c.default, (c(8, 6), [1], 2, False)),
        (aten._fft_c2r.default, (c(8, 4), [1], 0, 6)),
        (aten._conj_physical.default, (c(5, 4),)),
        (aten.view_as_real.default, (c(8, 3),)),
        (aten.view_as_complex.default, (r(8, 3, 2),)),
    ],
    ids=["r2c", "r2c_uneven", "c2c", "c2r", "conj_physical", "view_as_real", "view_as_complex"],
)
def test_avg_max_min_partials_and_split_orders(op: Any, args: tuple[Any, ...]) -> None:
    """P(avg) survives, P(max)/P(min) are reduced first (a real-input r2c would be wrong with
    them kept)."""
    assert check_op(op, args, mesh_shape=(4,), layouts=PARTIAL_LAYOUTS["1d"], atol=1e-9, rtol=1e-9) > 0
    assert check_op(op, args, mesh_shape=(2, 2), layouts=PARTIAL_LAYOUTS["2d"], atol=1e-9, rtol=1e-9) > 0


def _choose(op: Any, args: tuple[Any, ...], mesh_shape: tuple[int, ...], layout: Layout) -> OutputSharding:
    return propagate(schema_for(op, args, {}, AbstractMesh(mesh_shape), [layout]))


def _out(chosen: OutputSharding) -> tuple[Any, ...]:
    spec = chosen.output_spec
    assert spec is not None and not isinstance(spec, tuple)
    return tuple(spec.placements)


@pytest.mark.parametrize(
    ("op", "args", "mesh_shape", "inp", "out"),
    [
        # a batch split stays: every rank transforms its own rows, no communication
        (aten._fft_c2c.default, (c(8, 6), [1], 0, True), (4,), (Shard(0),), (Shard(0),)),
        (aten._fft_r2c.default, (r(4, 8, 6), [1, 2], 0, True), (2, 2), (Shard(0), Shard(0)), (Shard(0), Shard(0))),
        (aten._fft_c2r.default, (c(6, 4, 5), [0, 2], 0, 8), (2, 2), (Replicate(), Shard(1)), (Replicate(), Shard(1))),
        # linear: a pending sum (or average) is reduced after the transform, or never
        (aten._fft_r2c.default, (r(8, 6), [1], 0, True), (4,), (Partial(),), (Partial(),)),
        (aten._fft_c2c.default, (c(8, 6), [0, 1], 0, True), (2, 2), (Partial("avg"), Shard(0)), None),
        (aten._fft_c2r.default, (c(8, 6), [1], 0, 10), (4,), (Partial(),), (Partial(),)),
        (aten._conj_physical.default, (c(8, 6),), (4,), (Partial(),), (Partial(),)),
        (aten.view_as_real.default, (c(8, 6),), (2, 2), (Shard(1), Partial()), (Shard(1), Partial())),
        (aten.view_as_complex.default, (r(8, 6, 2),), (2, 2), (Shard(1), Shard(0)), (Shard(1), Shard(0))),
        # max does not commute with a transform: reduced first
        (aten._fft_r2c.default, (r(8, 6), [1], 0, True), (4,), (Partial("max"),), (Replicate(),)),
    ],
)
def test_chosen_layouts_avoid_needless_communication(
    op: Any, args: tuple[Any, ...], mesh_shape: tuple[int, ...], inp: tuple[Any, ...], out: Any
) -> None:
    chosen = _choose(op, args, mesh_shape, Layout(inp))
    if out is None:  # the transformed batch dim cannot stay split: only the Partial is asserted
        assert _out(chosen)[0] == Partial("avg")
        return
    if out == inp:  # the op runs where the input lies
        assert chosen.input_specs == (None,)
    assert _out(chosen) == out


def test_a_split_transformed_dim_moves_to_a_batch_dim_or_is_gathered() -> None:
    """fft over a split dim cannot run locally: the input is re-split on the batch dim."""
    chosen = _choose(aten._fft_c2c.default, (c(8, 16), [1], 0, True), (4,), Layout((Shard(1),)))
    assert _out(chosen) == (Shard(0),)
    spec = chosen.input_specs[0]
    assert spec is not None and tuple(spec.placements) == (Shard(0),)
    # view_as_complex needs the (real, imag) pair whole
    chosen = _choose(aten.view_as_complex.default, (r(8, 4, 2),), (2,), Layout((Shard(2),)))
    spec = chosen.input_specs[0]
    assert spec is not None and Shard(2) not in spec.placements


def test_fft_never_leaves_a_rank_an_empty_piece() -> None:
    """Regression: 3 rows on 4 ranks split 1, 1, 1, 0 and the FFT backend raises on the
    empty piece, so a batch split with an empty piece must not be kept."""
    chosen = _choose(aten._fft_c2c.default, (c(3, 8), [1], 0, True), (4,), Layout((Shard(0),)))
    assert _out(chosen) == (Replicate(),), chosen  # rows 1, 1, 1, 0; the other dim is transformed
    # on (2, 2) rows split 2, 1 then 1, 1, 1, 0: one mesh dim may keep the split, not both
    chosen = _choose(aten._fft_c2c.default, (c(3, 8), [1], 0, True), (2, 2), Layout((Shard(0), Shard(0))))
    assert _out(chosen) in [(Shard(0), Replicate()), (Replicate(), Shard(0))], chosen
    # 5 rows on 4 ranks split 2, 2, 1, 0: still empty; 7 rows split 2, 2, 2, 1: kept
    assert _out(_choose(aten._fft_r2c.default, (r(5, 8), [1], 0, True), (4,), Layout((Shard(0),)))) != (Shard(0),)
    assert _out(_choose(aten._fft_r2c.default, (r(7, 8), [1], 0, True), (4,), Layout((Shard(0),)))) == (Shard(0),)


def test_a_reversed_split_order_of_a_batch_dim_is_kept() -> None:
    layout = Layout((Shard(0), Shard(0)), ((0, (1, 0)),))
    chosen = _choose(aten._fft_c2c.default, (c(8, 6), [1], 0, True), (2, 2), layout)
    assert chosen.input_specs == (None,)
    spec = chosen.output_spec
    assert isinstance(spec, DTensorSpec) and Layout(spec.placements, spec.shard_order) == layout


# -- end to end, on real ranks ---------------------------------------------------------------

FFT_CALLS: dict[str, tuple[Any, bool]] = {  # name: (function of the input, complex input)
    "fft2": (lambda t: torch.fft.fft2(t, norm="ortho"), True),
    "ifft": (lambda t: torch.fft.ifft(t, n=7), True),
    "rfftn": (lambda t: torch.fft.rfftn(t, dim=(1, 2)), False),
    "irfft": (lambda t: torch.fft.irfft(t, n=8, norm="forward"), True),
    "hfftn": (lambda t: torch.fft.hfftn(t, dim=(1, 2)), True),
    "ihfft2": (lambda t: torch.fft.ihfft2(t), False),
    "fftshift_fft": (lambda t: torch.fft.fftshift(torch.fft.fft(t), dim=-1), False),
    "view_as_real": (lambda t: torch.view_as_real(torch.fft.rfft(t)) * 2, False),
}


def _real_loss(out: Any, weight: torch.Tensor) -> Any:
    if out.is_complex():
        out = torch.view_as_real(out)
    return (out * weight).sum()


@distributed(world_size=4)
def test_torch_fft_on_a_batch_split_matches_single_device_with_gradients() -> None:
    import shardwise as sw
    from shardwise import DTensor

    from ..dist_helpers import expected_piece, make_dtensor, term_grad_scale

    torch.set_num_threads(1)  # four ranks share the cores; tiny FFTs gain nothing from threads
    for mesh_shape in [(4,), (2, 2)]:
        mesh = sw.init_device_mesh("cpu", mesh_shape)
        nd = len(mesh_shape)
        layouts = [(Shard(0),) * nd, (Partial(),) + (Shard(0),) * (nd - 1)]
        if nd == 2:
            layouts.append((Shard(0), Partial("avg")))
        for rows in (8, 6):  # even, and uneven (6 rows on 4 ranks: 2, 2, 2, 0)
            for name, (fn, is_complex) in FFT_CALLS.items():
                dtype = torch.complex128 if is_complex else torch.float64
                full = torch.randn(rows, 6, 5, generator=torch.Generator().manual_seed(rows), dtype=dtype)
                ref = full.clone().requires_grad_(True)
                want = fn(ref)
                weight_shape = torch.view_as_real(want).shape if want.is_complex() else want.shape
                weight = torch.randn(weight_shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
                _real_loss(want, weight).backward()
                for placements in layouts:
                    what = f"{name} rows={rows} mesh={mesh_shape} {placements}"
                    piece = make_dtensor(full, mesh, placements)._local_tensor.detach().clone().requires_grad_(True)
                    x = DTensor.from_local(piece, mesh, placements, shape=full.shape, stride=full.stride())
                    got = fn(x)
                    torch.testing.assert_close(got.full_tensor(), want.detach(), msg=lambda m: f"{what} forward\n{m}")
                    w = sw.distribute_tensor(weight, mesh, [Replicate()] * nd)
                    _real_loss(got, w).backward()
                    assert ref.grad is not None and piece.grad is not None, what
                    grad_layout = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
                    coordinate = mesh.get_coordinate()
                    assert coordinate is not None
                    want_grad = expected_piece(ref.grad, mesh.shape, grad_layout, coordinate, None)
                    want_grad = want_grad * term_grad_scale(placements, mesh.shape)
                    torch.testing.assert_close(piece.grad, want_grad, msg=lambda m: f"{what} gradient\n{m}")

    # a batch split stays put: the whole transform runs without communication
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.randn(8, 6, 5, dtype=torch.complex128), mesh, [Shard(0)])
    with sw.comm_log() as log:
        y = torch.fft.fft2(x)
        z = torch.fft.irfftn(y, s=(6, 5), dim=(1, 2))
    assert log == [] and y.placements == (Shard(0),) and z.placements == (Shard(0),)
