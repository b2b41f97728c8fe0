"""DTensor ops and autograd against the single-device reference, on meshes (4,) and (2, 2)."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, layouts, make_dtensor, seeded

MESHES = [(4,), (2, 2)]


def _assert_holds(got: DTensor, want: torch.Tensor, msg: str) -> None:
    """`got`'s global value is `want`. Each rank compares its own piece with the oracle's piece
    of `want` (`torch.chunk` by `got`'s placements and split order): the ranks together check
    every element `full_tensor()` would gather, without its collectives, which cost more than
    the ops under test. A Partial result holds no piece of the value, so it is reduced."""
    assert got.shape == want.shape and got.dtype == want.dtype, (msg, got.shape, got.dtype, want.shape, want.dtype)
    if any(isinstance(p, Partial) for p in got.placements):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-5, msg=msg)
        return
    mesh = got.device_mesh
    piece = expected_piece(want, mesh.shape, got.placements, mesh.get_coordinate(), dict(got.shard_order))
    torch.testing.assert_close(got.to_local(), piece, rtol=1e-4, atol=1e-5, msg=f"{msg} ({got.placements})")


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_pointwise_ops_match_single_device_for_every_layout_pair(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    a, b = seeded(7, 6, seed=1), seeded(7, 6, seed=2)
    cases = {
        "add": (lambda x, y: x + y),
        "sub_alpha": (lambda x, y: torch.sub(x, y, alpha=3)),
        "mul": (lambda x, y: x * y),
        "div": (lambda x, y: x / (y.abs() + 1)),
        "where": (lambda x, y: torch.where(x > y, x, y * 2)),
        "maximum": (lambda x, y: torch.maximum(x, y)),
    }
    for la, oa in layouts(len(mesh_shape), 2):
        for lb, ob in layouts(len(mesh_shape), 2):
            x, y = make_dtensor(a, mesh, la, oa), make_dtensor(b, mesh, lb, ob)
            for name, fn in cases.items():
                _assert_holds(fn(x, y), fn(a, b), f"{name} {la} {lb}")


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_unary_scalar_and_broadcast_ops(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    a, row = seeded(9, 5, seed=3), seeded(5, seed=4)
    for la, oa in layouts(len(mesh_shape), 2, partials=("sum", "avg", "max")):
        x = make_dtensor(a, mesh, la, oa)
        r = sw.distribute_tensor(row, mesh, [Replicate()] * mesh.ndim)
        for name, fn in {
            "relu": lambda t: t.relu(),
            "neg": lambda t: -t,
            "mul_scalar": lambda t: t * 2.5,
            "add_scalar": lambda t: t + 1,
            "exp": lambda t: t.exp(),
            "pow": lambda t: t ** 2,
            "cast": lambda t: t.to(torch.float64),
            "bcast_row": lambda t: t * r if isinstance(t, DTensor) else t * row,
            "scalar_tensor": lambda t: t * torch.tensor(3.0),
            "sum": lambda t: t.sum(),
            "sum_dim": lambda t: t.sum(0),
            "sum_keepdim": lambda t: t.sum(1, keepdim=True),
        }.items():
            torch.testing.assert_close(fn(x).full_tensor(), fn(a), rtol=1e-4, atol=1e-5, msg=f"{name} {la} {oa}")


@distributed(world_size=4)
def test_partial_layouts_stay_partial_only_when_linear() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    a, b = seeded(4, 4, seed=5), seeded(4, 4, seed=6)
    p, q = make_dtensor(a, mesh, [Partial()]), make_dtensor(b, mesh, [Partial()])
    r = make_dtensor(b, mesh, [Replicate()])
    assert (p + q).placements == (Partial(),)  # P(sum) + P(sum) stays partial, no communication
    assert (p * r).placements == (Partial(),)  # linear in one argument
    assert (p * 2).placements == (Partial(),)
    # P(sum) + R must not add R on every rank (that would count it 4 times): it goes to one
    # term (free), and the sum stays Partial, as torch's P + R
    with sw.comm_log() as log:
        s = p + r
    assert log == [] and s.placements == (Partial(),)
    torch.testing.assert_close(s.full_tensor(), a + b)
    torch.testing.assert_close((p + 1).full_tensor(), a + 1)
    torch.testing.assert_close((p * q).full_tensor(), a * b)  # non-linear in both: one reduced first
    torch.testing.assert_close(p.relu().full_tensor(), a.relu())


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_in_place_ops_keep_their_layout_and_values(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    a, b = seeded(6, 8, seed=7), seeded(6, 8, seed=8)
    for la, oa in layouts(len(mesh_shape), 2, partials=()):
        for lb, ob in layouts(len(mesh_shape), 2):
            x, y = make_dtensor(a, mesh, la, oa), make_dtensor(b, mesh, lb, ob)
            x.mul_(2).add_(y)
            assert x.placements == la
            torch.testing.assert_close(x.full_tensor(), a * 2 + b)


@distributed(world_size=4)
def test_in_place_op_on_a_partial_self_is_written_back_into_its_layout() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    a = seeded(4, 4)
    p = make_dtensor(a, mesh, [Partial()])
    local = p._local_tensor
    out = p.add_(1)  # not linear in a partial sum: reduce, add, write back as P(sum)
    assert out is p and p.placements == (Partial(),) and p._local_tensor is local
    torch.testing.assert_close(p.full_tensor(), a + 1)


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_in_place_view_ops_give_self_the_new_shape_and_layout(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = seeded(5, 1, 6)
    nd = len(mesh_shape)
    for placements in [(Shard(0),) * nd, (Shard(2),) + (Replicate(),) * (nd - 1), (Replicate(),) * nd]:
        x = sw.distribute_tensor(full, mesh, placements)
        want = full.clone()
        for step in [
            lambda t: t.squeeze_(1), lambda t: t.transpose_(0, 1), lambda t: t.unsqueeze_(2), lambda t: t.t_()
            if t.ndim == 2 else t.squeeze_(2), lambda t: t.resize_(10, 3),
        ]:
            out, want = step(x), step(want)
            assert out is x and x.shape == want.shape and x.stride() == want.stride()
            torch.testing.assert_close(x.full_tensor(), want)
            assert x.to_local().shape == expected_piece(want, mesh.shape, x.placements, mesh.get_coordinate()).shape
    x = sw.distribute_tensor(seeded(4, 4), mesh, [Shard(0)] * nd)
    with pytest.raises(ValueError, match=r"resize_.*grow a DTensor from shape \(4, 4\) to \(8, 4\)"):
        x.resize_(8, 4)


@distributed(world_size=4)
def test_ops_without_a_strategy_run_as_their_decomposition_and_one_element_tensors_count_as_replicated() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    full = seeded(8, 6)
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    sw.set_strict(True)  # no op may fall back
    try:
        # _chunk_cat has no strategy; PyTorch's decomposition of it (views + cat) runs sharded
        y = torch._chunk_cat([x, x * 2], dim=1, num_chunks=2)
        torch.testing.assert_close(y.full_tensor(), torch._chunk_cat([full, full * 2], dim=1, num_chunks=2))
        assert y.placements == (Shard(0),)
        # a one-element plain tensor is a scalar in a tensor's clothes, as in torch's DTensor
        z = x * torch.tensor([2.0])
        torch.testing.assert_close(z.full_tensor(), full * 2)
    finally:
        sw.set_strict(False)


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_gradients_through_from_local_ops_redistribute_full_tensor_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x_full, w_full, b_full = seeded(10, 6, seed=9), seeded(6, 4, seed=10), seeded(4, seed=11)
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x_full, w_full, b_full))
    ((xr @ wr + br).tanh() * 3).pow(2).sum().backward()

    coord = mesh.get_coordinate()
    nd = len(mesh_shape)
    for (lx, ox) in [((Shard(0),) * nd, None), ((Shard(0), Replicate())[:nd], None), ((Replicate(),) * nd, None)]:
        for lw in [(Replicate(),) * nd, ((Shard(1),) + (Replicate(),) * (nd - 1))]:
            # plain leaves: from_local -> ops -> redistribute -> full_tensor
            xl = expected_piece(x_full, mesh.shape, lx, coord, ox).clone().requires_grad_(True)
            wl = expected_piece(w_full, mesh.shape, lw, coord).clone().requires_grad_(True)
            x = DTensor.from_local(xl, mesh, lx, shape=x_full.shape, stride=x_full.stride())
            w = DTensor.from_local(wl, mesh, lw, shape=w_full.shape, stride=w_full.stride())
            b = sw.distribute_tensor(b_full, mesh, [Replicate()] * nd)
            out = ((x @ w + b).tanh() * 3).redistribute(mesh, [Replicate()] * nd)
            out.full_tensor().pow(2).sum().backward()
            torch.testing.assert_close(xl.grad, expected_piece(xr.grad, mesh.shape, lx, coord))
            torch.testing.assert_close(wl.grad, expected_piece(wr.grad, mesh.shape, lw, coord))


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_gradients_through_to_local_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = seeded(9, 7, seed=12)
    ref = full.clone().requires_grad_(True)
    (ref.sin() * 2).sum().backward()
    coord = mesh.get_coordinate()
    for placements, order in layouts(len(mesh_shape), 2, partials=()):
        leaf = expected_piece(full, mesh.shape, placements, coord, order).clone().requires_grad_(True)
        dt = DTensor.from_local(leaf, mesh, placements, shape=full.shape, stride=full.stride(), shard_order=order)
        moved = (dt.sin() * 2).redistribute(mesh, [Shard(1)] + [Replicate()] * (mesh.ndim - 1))
        # each rank's loss covers only its own piece: the grad of a sum of pieces is the full grad
        moved.to_local().sum().backward()
        torch.testing.assert_close(leaf.grad, expected_piece(ref.grad, mesh.shape, placements, coord, order))


@distributed(world_size=4)
def test_distribute_tensor_leaf_accumulates_grad_as_dtensor() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    w_full = seeded(8, 4, seed=13)
    w = sw.distribute_tensor(w_full.clone().requires_grad_(True), mesh, [Shard(0), Replicate()])
    assert w.is_leaf and w.requires_grad
    (w * w).full_tensor().sum().backward()
    assert isinstance(w.grad, DTensor) and w.grad.placements == w.placements
    torch.testing.assert_close(w.grad.full_tensor(), 2 * w_full)


@distributed(world_size=4)
def test_mm_shardings_match_single_device() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    a, b = seeded(8, 12, seed=14), seeded(12, 6, seed=15)
    for la in ([Shard(0)], [Shard(1)], [Replicate()], [Partial()]):
        for lb in ([Shard(0)], [Shard(1)], [Replicate()]):
            out = make_dtensor(a, mesh, la) @ make_dtensor(b, mesh, lb)
            torch.testing.assert_close(out.full_tensor(), a @ b, msg=f"{la} {lb}")
    out = make_dtensor(a, mesh, [Shard(1)]) @ make_dtensor(b, mesh, [Shard(0)])
    assert out.placements == (Partial(),)  # contraction over the sharded dim: partial sums, no comm


@distributed(world_size=4)
def test_views_and_transposes() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = seeded(6, 4, 5, seed=16)
    for placements, order in layouts(2, 3, partials=()):
        x = make_dtensor(full, mesh, placements, order)
        torch.testing.assert_close(x.transpose(0, 2).full_tensor(), full.transpose(0, 2))
        torch.testing.assert_close(x.permute(1, 2, 0).full_tensor(), full.permute(1, 2, 0))
        torch.testing.assert_close(x.view(6, 20).full_tensor(), full.view(6, 20))
        torch.testing.assert_close(x.reshape(24, 5).full_tensor(), full.reshape(24, 5))
        s = x.sum(1, keepdim=True)
        torch.testing.assert_close(s.expand(6, 4, 5).full_tensor(), full.sum(1, keepdim=True).expand(6, 4, 5))


@distributed(world_size=4)
def test_op_without_strategy_falls_back_to_replicated_with_one_warning_or_errors_in_strict_mode() -> None:
    import warnings

    mesh = sw.init_device_mesh("cpu", (4,))
    full = seeded(8, 8)
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    lengths = sw.distribute_tensor(torch.tensor([4, 4]), mesh, [Replicate()])
    # the warning is once per process, and this worker may have run the op in an earlier test
    # (the OpInfo sweep does): forget that it warned
    from shardwise._ops._propagate import _WARNED

    _WARNED.discard(torch.ops.aten.segment_reduce.default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.segment_reduce(x, "sum", lengths=lengths)
        torch.segment_reduce(x, "sum", lengths=lengths)
    assert len([w for w in caught if "segment_reduce" in str(w.message)]) == 1
    assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), torch.segment_reduce(full, "sum", lengths=torch.tensor([4, 4])))
    sw.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match=r"no sharding strategy for aten\.segment_reduce.*S\(1\)"):
            with sw.implicit_replication():  # a layout not seen yet (plans are cached per layout)
                torch.segment_reduce(x.redistribute(mesh, [Shard(1)]), "sum", lengths=torch.tensor([4, 4]))
    finally:
        sw.set_strict(False)


@distributed(world_size=2)
def test_an_error_inside_a_local_op_names_the_op_the_rank_and_the_input_layouts() -> None:
    # regression: an error from a local kernel came without the op's layouts or the rank
    mesh = sw.init_device_mesh("cpu", (2,))
    log_probs = sw.distribute_tensor(torch.randn(4, 5).log_softmax(1), mesh, [Shard(0)])
    target = sw.distribute_tensor(torch.tensor([7, 0, 7, 1]), mesh, [Shard(0)])  # 7: no such class, on each rank
    with pytest.raises((IndexError, RuntimeError), match="out of bounds") as caught:
        torch.nn.functional.nll_loss(log_probs, target, reduction="none")
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1, notes  # one note: the innermost op, not every op around it
    rank = torch.distributed.get_rank()
    assert f"raised by aten.nll_loss_forward.default on rank {rank}" in notes[0], notes
    assert "(S(0))[4, 5] (local [2, 5]), (S(0))[4] (local [2])" in notes[0], notes


@distributed(world_size=4)
def test_regression_to_local_output_mixed_back_in_gave_a_dtensor_inside_a_dtensor() -> None:
    # A local tensor taken with to_local() and then mixed with DTensors as a replicated plain
    # tensor (a RowwiseParallel local output feeding a residual add) got its gradient as a
    # DTensor, which to_local's backward wrapped again: a DTensor inside a DTensor.
    mesh = sw.init_device_mesh("cpu", (4,))
    d_full, w_full = seeded(4, 3, seed=1), seeded(4, 3, seed=2)
    d = sw.distribute_tensor(d_full, mesh, [Replicate()]).requires_grad_()
    w = sw.distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    with sw.implicit_replication():
        ((d + w.to_local()) * d).sum().backward()
    assert isinstance(w.grad, DTensor) and not isinstance(w.grad._local_tensor, DTensor)
    torch.testing.assert_close(w.grad.full_tensor(), d_full)


@distributed(world_size=4)
def test_regression_from_local_partial_avg_gave_each_term_the_full_gradient() -> None:
    # y = from_local(x, [Partial("avg")]) is the mean of the 4 ranks' x: dy/dx_r = 1/4.
    mesh = sw.init_device_mesh("cpu", (4,))
    x = torch.full((3,), float(mesh.get_coordinate()[0] + 1), requires_grad=True)
    y = DTensor.from_local(x, mesh, [Partial("avg")])
    (y.full_tensor() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0, 3.0]) / 4)


@distributed(world_size=4)
def test_regression_to_local_grad_placements_dropped_the_split_order() -> None:
    # A (S(0), S(0)) tensor split by mesh dim 1 first: the gradient pieces came back in the
    # default order (rank pieces [0,1,4,5,2,3,6,7] instead of [0..7]).
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = torch.arange(8.0).reshape(8, 1)
    x = sw.distribute_tensor(full, mesh, [Shard(0), Shard(0)], shard_order={0: (1, 0)}).requires_grad_()
    local = x.to_local(grad_placements=[Shard(0), Shard(0)])
    (local * local.detach()).sum().backward()  # d/dx = x, piece by piece
    assert x.grad.shard_order == ((0, (1, 0)),)
    torch.testing.assert_close(x.grad.full_tensor(), full)
