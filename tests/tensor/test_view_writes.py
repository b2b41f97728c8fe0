"""Writes into a view of a DTensor reach the DTensor, as they reach a plain tensor.

A view whose plan had to move its base (`buf[:, a:b]` with `buf` split on dim 1: the slice is
taken of a gathered copy) does not share the base's memory; `_tensor/_view_links.py` links it
to the base and writes it back after each op that writes it. Before, `buf[:, a:b] = g` was
silently lost, as it still is with torch's DTensor (torchtitan's ChunkedLossWrapper accumulates
the hidden-state gradient this way: every gradient but lm_head's was zero under TP). Each
program here runs on a DTensor and on the plain tensor (the single-device reference), on meshes
(4,) and (2, 2), with dims that split evenly (64) and unevenly (10 over 4 ranks):
- setitem into a moved slice, for each layout of the base and of the value (Partial included);
- the other in-place ops (`add_`, `mul_`, `zero_`, `fill_`, `out=`, `index_put_`) on a moved slice;
- `select`, `split`, `unbind`, `chunk`, `narrow`, `diagonal` written, and chains of views;
- a flattening `view` that moves, written (its inverse is a reshape);
- a moved view with no way back (`unfold`, `as_strided`) written: a ValueError naming the op;
- autograd through `x[:, a:b] = y`: the gradients of both are the reference's;
- a view that needed no move aliases its base and leaves no link, and links die with the view;
- torch's own DTensor, side by side, still loses the write.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise._tensor import _view_links
from shardwise.testing import distributed

from ..dist_helpers import make_dtensor, seeded

MESHES = [(4,), (2, 2)]
SIZES = [64, 10]  # splits evenly over 4 ranks (and 2 x 2); 10 splits 3, 3, 3, 1

# the layouts of the written DTensor, per mesh
BASES: dict[tuple[int, ...], list[tuple[Placement, ...]]] = {
    (4,): [(Shard(1),), (Shard(0),), (Replicate(),)],
    (2, 2): [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(1)), (Shard(1), Shard(1))],
}
# the layouts of the value written into it
VALUES: dict[tuple[int, ...], list[tuple[Placement, ...]]] = {
    (4,): [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)],
    (2, 2): [(Shard(0), Shard(1)), (Replicate(), Replicate()), (Partial(), Shard(1)), (Shard(0), Partial())],
}


def _bounds(n: int) -> tuple[int, int]:
    """A slice of a dim of size `n` that crosses pieces: 16:32 of 64, 3:7 of 10."""
    return (16, 32) if n == 64 else (3, 7)


def _mesh(shape: tuple[int, ...]) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


def _base(n: int) -> torch.Tensor:
    return torch.arange(n * n, dtype=torch.float64).reshape(n, n)


def _check(got: DTensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=1e-9, msg=lambda m: f"{what}: {m}")


def _run(program: Callable[..., Any], mesh: sw.DeviceMesh, layout: Sequence[Placement], n: int,
         values: Sequence[torch.Tensor] = (), value_layout: Sequence[Placement] = ()) -> list[str]:
    """`program(buf, *values)` on a DTensor laid out `layout` and on the plain tensor: the
    problems (none when the DTensor ends equal to the plain tensor, in its own layout)."""
    ref = _base(n)
    buf = sw.distribute_tensor(ref.clone(), mesh, list(layout))
    dvalues = [make_dtensor(v, mesh, list(value_layout)) for v in values]
    program(ref, *values)
    program(buf, *dvalues)
    what = f"{program.__name__} into {tuple(layout)} of {n}x{n}" + (f" from {tuple(value_layout)}" if values else "")
    if buf.placements != tuple(layout):
        return [f"{what}: re-laid as {buf.placements}"]
    got = buf.full_tensor()
    if not torch.allclose(got, ref, rtol=0, atol=1e-9):
        wrong = (got - ref).abs() > 1e-9
        return [f"{what}: {int(wrong.sum())} elements differ, first at {wrong.nonzero()[0].tolist()}"]
    return []


def _expect_none(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} programs differ from the plain tensor's:\n  " + "\n  ".join(problems)


# -- setitem into a moved slice ----------------------------------------------------------------


def _setitem_columns(a: int, b: int) -> Callable[..., None]:
    def setitem_columns(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[:, a:b] = g
    setitem_columns.__name__ = f"buf[:, {a}:{b}] = g"
    return setitem_columns


def _setitem_rows(a: int, b: int) -> Callable[..., None]:
    def setitem_rows(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[a:b] = g
    setitem_rows.__name__ = f"buf[{a}:{b}] = g"
    return setitem_rows


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_setitem_into_a_slice_that_moved_its_base_reaches_the_base(mesh_shape: tuple[int, ...], n: int) -> None:
    """`buf[:, a:b] = g` and `buf[a:b] = g`, for every layout of `buf` and of `g` (Partial
    from `from_local`): the slice of a Shard(1) `buf` is taken of a gathered copy, and the
    write was lost; `buf[0:1]` of a Shard(0) `buf` moves too (re-split on dim 1)."""
    mesh = _mesh(mesh_shape)
    a, b = _bounds(n)
    problems = []
    for layout in BASES[mesh_shape]:
        for value_layout in VALUES[mesh_shape]:
            columns, rows = seeded(n, b - a, seed=1, dtype=torch.float64), seeded(b - a, n, seed=2, dtype=torch.float64)
            problems += _run(_setitem_columns(a, b), mesh, layout, n, [columns], value_layout)
            problems += _run(_setitem_rows(a, b), mesh, layout, n, [rows], value_layout)
        first = seeded(1, n, seed=3, dtype=torch.float64)
        problems += _run(_setitem_rows(0, 1), mesh, layout, n, [first], (Replicate(),) * mesh.ndim)
    _expect_none(problems)


# -- other in-place ops on a moved slice -------------------------------------------------------


def _in_place_ops(a: int, b: int) -> dict[str, Callable[..., None]]:
    def add_(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[:, a:b].add_(g)

    def mul_(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[:, a:b].mul_(2)

    def zero_(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[:, a:b].zero_()

    def fill_(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[:, a:b].fill_(3)

    def add_out(buf: torch.Tensor, g: torch.Tensor) -> None:
        torch.add(g, 1, out=buf[:, a:b])

    def index_put_(buf: torch.Tensor, g: torch.Tensor) -> None:
        buf[:, a:b][torch.tensor([0, 2])] = 5.0

    def twice(buf: torch.Tensor, g: torch.Tensor) -> None:
        view = buf[:, a:b]
        view.add_(g)
        view.mul_(-1)  # the same view written again: its second value reaches the base too

    return {f.__name__: f for f in (add_, mul_, zero_, fill_, add_out, index_put_, twice)}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_in_place_ops_on_a_moved_slice_reach_the_base(mesh_shape: tuple[int, ...], n: int) -> None:
    """`add_`, `mul_`, `zero_`, `fill_`, `out=`, `index_put_` and a view written twice."""
    mesh = _mesh(mesh_shape)
    a, b = _bounds(n)
    g = seeded(n, b - a, seed=4, dtype=torch.float64)
    problems = []
    for layout in BASES[mesh_shape]:
        for program in _in_place_ops(a, b).values():
            problems += _run(program, mesh, layout, n, [g], (Replicate(),) * mesh.ndim)
        problems += _run(_in_place_ops(a, b)["add_"], mesh, layout, n, [g], VALUES[mesh_shape][-1])  # a Partial value
    _expect_none(problems)


# -- select, split, unbind, chunk, narrow, diagonal, chains ------------------------------------


def _piece_programs(n: int) -> dict[str, Callable[[torch.Tensor], None]]:
    a, b = _bounds(n)
    lo, hi = (8, 40) if n == 64 else (2, 9)

    def select(buf: torch.Tensor) -> None:
        buf[:, 5] = torch.arange(float(n), dtype=torch.float64) * -1

    def select_add_(buf: torch.Tensor) -> None:
        buf[:, n - 1].add_(100)

    def split(buf: torch.Tensor) -> None:
        for k, p in enumerate(buf.split(3, dim=1)):
            p.add_(k + 1)

    def split_with_sizes(buf: torch.Tensor) -> None:
        p, q = buf.split([a, n - a], dim=1)
        q.mul_(-1)

    def unbind(buf: torch.Tensor) -> None:
        for k, p in enumerate(buf.unbind(1)):
            p.fill_(k)

    def chunk(buf: torch.Tensor) -> None:
        for k, p in enumerate(buf.chunk(3, dim=1)):
            p.sub_(10 * (k + 1))

    def narrow(buf: torch.Tensor) -> None:
        buf.narrow(1, a, b - a).fill_(-7)

    def diagonal(buf: torch.Tensor) -> None:
        buf.diagonal().fill_(1)

    def diagonal_offset(buf: torch.Tensor) -> None:
        buf.diagonal(2).mul_(3)

    def chain_setitem(buf: torch.Tensor) -> None:
        buf[:, lo:hi][:, 2:6] = torch.full((n, 4), 9.0, dtype=torch.float64)

    def chain_select(buf: torch.Tensor) -> None:
        buf[:, lo:hi][0].zero_()

    def chain_transpose(buf: torch.Tensor) -> None:
        buf[:, lo:hi].t()[1].fill_(-3)  # a transpose of a moved slice: no move, the link carries on

    def chain_of_moves(buf: torch.Tensor) -> None:
        buf[a:b][:, a:b].fill_(4)  # both slices may move: written back twice, innermost first

    return {f.__name__: f for f in (select, select_add_, split, split_with_sizes, unbind, chunk, narrow, diagonal,
                                    diagonal_offset, chain_setitem, chain_select, chain_transpose, chain_of_moves)}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_select_split_unbind_chunk_narrow_diagonal_and_chains_written_reach_the_base(
        mesh_shape: tuple[int, ...], n: int) -> None:
    mesh = _mesh(mesh_shape)
    _expect_none([p for layout in BASES[mesh_shape] for program in _piece_programs(n).values()
                  for p in _run(program, mesh, layout, n)])


def _flat_fill(buf: torch.Tensor) -> None:
    buf.view(-1)[5:40].fill_(-1)


def _flat_add(buf: torch.Tensor) -> None:
    buf.view(-1).add_(torch.arange(float(buf.numel()), dtype=torch.float64))


def _flat_then_unflatten(buf: torch.Tensor) -> None:
    buf.view(-1).view(buf.shape[0] // 2, 2 * buf.shape[1])[1].fill_(8)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_a_moved_reshaping_view_written_reaches_the_base_through_the_inverse_view(
        mesh_shape: tuple[int, ...], n: int) -> None:
    """`buf.view(-1)` of a `buf` split on dim 1 moves (the flat order needs whole rows)."""
    mesh = _mesh(mesh_shape)
    buf = sw.distribute_tensor(_base(n), mesh, list(BASES[mesh_shape][0]))
    flat = buf.view(-1)
    if mesh_shape == (4,):
        assert id(flat) in _view_links._LINKS, "the test means a view that moved: pick another"
    del flat
    _expect_none([p for layout in BASES[mesh_shape] for program in (_flat_fill, _flat_add, _flat_then_unflatten)
                  for p in _run(program, mesh, layout, n)])


# -- a moved view with no way back ---------------------------------------------------------------


def _unfold(buf: torch.Tensor) -> torch.Tensor:
    return buf.unfold(1, 2, 2)


def _as_strided(buf: torch.Tensor) -> torch.Tensor:
    return buf.as_strided((4, 4), (buf.shape[1], 1))


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_a_write_into_a_moved_view_with_no_way_back_raises_naming_the_op(mesh_shape: tuple[int, ...]) -> None:
    """`unfold` of the split dim and `as_strided` move the base and have no scatter: a write is a
    ValueError naming the op (it was lost without a word), and the base keeps its value."""
    mesh = _mesh(mesh_shape)
    layout = [Shard(1)] * mesh.ndim
    for view_of, op in ((_unfold, "aten.unfold"), (_as_strided, "aten.as_strided")):
        for n in SIZES:
            buf = sw.distribute_tensor(_base(n), mesh, layout)
            view = view_of(buf)
            assert not torch._C._is_alias_of(view.to_local(), buf.to_local()), f"{op} did not move: pick another view"
            with pytest.raises(ValueError, match=op) as caught:
                view.fill_(1)
            assert "redistribute" in str(caught.value)
            _check(buf, _base(n), f"{op} into {layout}")
            assert torch.equal(view_of(_base(n)), view_of(buf).full_tensor())  # a read is fine


# -- autograd ------------------------------------------------------------------------------------


def _loss_program(x: torch.Tensor, y: torch.Tensor, a: int, b: int, weight: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[:, a:b] = y
    return (x.square() * weight).sum()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_setitem_into_a_moved_slice_carries_gradients_to_the_base_and_the_value(
        mesh_shape: tuple[int, ...], n: int) -> None:
    """`x = dt.clone(); x[:, a:b] = y`: the loss, `dt.grad` (zero under the slice) and `y.grad`
    equal the plain-tensor program's."""
    mesh = _mesh(mesh_shape)
    a, b = 2, 5
    full = seeded(n, n, seed=5, dtype=torch.float64)
    yfull = seeded(n, b - a, seed=6, dtype=torch.float64)
    weight = torch.arange(float(n * n), dtype=torch.float64).reshape(n, n) / (n * n)
    ref_x, ref_y = full.clone().requires_grad_(), yfull.clone().requires_grad_()
    ref_loss = _loss_program(ref_x, ref_y, a, b, weight)
    ref_loss.backward()
    for layout in BASES[mesh_shape]:
        for y_layout in ([Replicate()] * mesh.ndim, [Shard(0)] * mesh.ndim):
            dt = sw.distribute_tensor(full, mesh, list(layout)).requires_grad_()
            y = sw.distribute_tensor(yfull, mesh, y_layout).requires_grad_()
            dweight = sw.distribute_tensor(weight, mesh, list(layout))
            loss = _loss_program(dt, y, a, b, dweight)
            loss.backward()
            what = f"{layout} from {y_layout}"
            torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), msg=lambda m: f"loss {what}: {m}")
            assert dt.grad is not None and y.grad is not None, what
            torch.testing.assert_close(dt.grad.full_tensor(), ref_x.grad, msg=lambda m: f"dt.grad {what}: {m}")
            torch.testing.assert_close(y.grad.full_tensor(), ref_y.grad, msg=lambda m: f"y.grad {what}: {m}")


# -- views that need no move, and the life of a link ---------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_a_view_that_needs_no_move_aliases_its_base_and_links_nothing(mesh_shape: tuple[int, ...]) -> None:
    """`buf[0:1]` of a Shard(1) `buf` is a view of each rank's piece: the write is the base's,
    with no link; a moved view's link is dropped when the view is freed, so 100 setitems leave
    the links as they found them."""
    mesh = _mesh(mesh_shape)
    gc.collect()
    before = dict(_view_links._LINKS)
    n = 64
    a, b = _bounds(n)
    buf = sw.distribute_tensor(_base(n), mesh, [Shard(1)] * mesh.ndim)
    row = buf[0:1]
    assert torch._C._is_alias_of(row.to_local(), buf.to_local()), "buf[0:1] of a Shard(1) buf moved: pick another view"
    assert id(row) not in _view_links._LINKS, "buf[0:1] needed no move, yet it was linked to buf"
    row.fill_(-2)
    want = _base(n)
    want[0:1] = -2
    _check(buf, want, "buf[0:1].fill_(-2)")
    del row
    assert _view_links._LINKS == before

    moved = buf[:, a:b]
    assert id(moved) in _view_links._LINKS, "buf[:, a:b] of a Shard(1) buf should move: pick another view"
    del moved
    assert _view_links._LINKS == before, "a link outlived its view"
    g = sw.distribute_tensor(torch.ones(n, b - a, dtype=torch.float64), mesh, [Replicate()] * mesh.ndim)
    for k in range(100):
        buf[:, a:b] = g * k
        assert len(_view_links._LINKS) == len(before), f"setitem {k}: {len(_view_links._LINKS)} links"
    want[:, a:b] = 99.0
    _check(buf, want, "100 setitems")


@distributed(world_size=4)
def test_every_rank_links_a_view_alike_when_some_pieces_are_empty() -> None:
    """Whether a view moved is the plan's answer, the same on every rank: a rank whose piece is
    empty cannot tell from its own memory (its empty piece is a fresh tensor on some ranks and
    a view on others), and a write-back that some ranks skipped would leave the others waiting
    in its collective."""
    import torch.distributed as dist

    mesh = _mesh((2, 2))
    cases = [((Shard(0), Shard(0)), lambda t: t[0]), ((Shard(1), Shard(1)), lambda t: t.view(-1)),
             ((Shard(1), Shard(1)), lambda t: t[:, 0:1])]
    for layout, take in cases:
        ref = torch.arange(6.0, dtype=torch.float64).reshape(1, 6) if layout[0] == Shard(1) else \
            torch.ones(1, 1, dtype=torch.float64)
        buf = sw.distribute_tensor(ref.clone(), mesh, list(layout))
        view = take(buf)
        linked = [None] * 4
        dist.all_gather_object(linked, id(view) in _view_links._LINKS)
        assert len(set(linked)) == 1, (layout, linked)
        view.fill_(5)
        take(ref).fill_(5)
        _check(buf, ref, f"{layout}: a view filled")


# -- torch's DTensor, side by side -----------------------------------------------------------------


@distributed(world_size=4)
def test_torchs_dtensor_loses_a_setitem_into_a_sharded_dim_and_shardwise_keeps_it() -> None:
    """The same `buf[:, 16:32] = g` through torch.distributed.tensor: torch drops it (if this
    fails, torch fixed it: the write-back may no longer be ours alone to keep)."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    n, (a, b) = 64, _bounds(64)
    want = _base(n)
    want[:, a:b] = 7.0
    g = torch.full((n, b - a), 7.0, dtype=torch.float64)

    tmesh = torch_mesh("cpu", (4,))
    tbuf = torch_distribute(_base(n), tmesh, [TorchShard(1)])
    tbuf[:, a:b] = torch_distribute(g, tmesh, [TorchReplicate()])
    assert torch.equal(tbuf.full_tensor(), _base(n)), "torch's DTensor now keeps the write"

    mesh = _mesh((4,))
    buf = sw.distribute_tensor(_base(n), mesh, [Shard(1)])
    buf[:, a:b] = sw.distribute_tensor(g, mesh, [Replicate()])
    _check(buf, want, "shardwise")
