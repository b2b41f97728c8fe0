"""`_StridedShard`: a dim holding equal parts side by side (a fused q|k|v), each part split.

Checked on meshes (4,) and (2, 2) against the same computation on one device: the pieces
each rank holds; moves to and from every other layout (full_tensor, Shard, Replicate,
Partial beside it); ops that treat every position alike keep the parts split (pointwise,
contractions, views, sums, the optimizer), splitting the parts apart (`split`, `chunk`,
`slice`) moves nothing and its backward (`cat`, `slice_backward`) moves nothing either;
any other op gathers first and gives the single-device result, in place too. A checkpoint
of strided tensors loads into plain layouts and back.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard, checkpoint
from shardwise._placement import _StridedShard
from shardwise.parallel import FusedColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import distributed

S3 = _StridedShard(1, split_factor=3)


def _expected(full: torch.Tensor, dim: int, parts: int, n: int, r: int) -> torch.Tensor:
    return torch.cat([p.chunk(n, dim=dim)[r] for p in full.chunk(parts, dim=dim)], dim=dim)


def _mesh(shape: tuple[int, ...]) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_pieces_and_moves_to_and_from_every_layout(shape: tuple[int, ...]) -> None:
    mesh = _mesh(shape)
    torch.manual_seed(0)
    full = torch.randn(6, 24, dtype=torch.float64)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    m = len(shape) - 1  # the strided mesh dim: the last
    others = [[Replicate()], [Shard(0)]] if len(shape) == 2 else [[]]
    for other in others:
        placements = [*other, S3]
        d = sw.distribute_tensor(full, mesh, placements)
        piece = _expected(full, 1, 3, shape[m], coordinate[m])
        if other and isinstance(other[0], Shard):
            piece = piece.chunk(shape[0], dim=0)[coordinate[0]]
        assert torch.equal(d.to_local(), piece), placements
        assert torch.equal(d.full_tensor(), full)
        for target in ([*other, Shard(1)], [*other, Replicate()], [*other, Shard(0)], [Replicate()] * len(shape),
                       [Shard(1)] + [Replicate()] * (len(shape) - 1)):
            moved = d.redistribute(mesh, target)
            assert torch.equal(moved.full_tensor(), full), (placements, target)
            back = moved.redistribute(mesh, placements)
            assert torch.equal(back.to_local(), piece), (placements, target)
    if len(shape) == 2:  # a Partial beside it: reduced, the parts stay split
        terms = sw.DTensor.from_local(_expected(full, 1, 3, 2, coordinate[1]), mesh, [Partial(), S3])
        assert torch.equal(terms.full_tensor(), 2 * full)
        assert torch.equal(terms.redistribute(mesh, [Replicate(), S3]).to_local(), 2 * _expected(full, 1, 3, 2, coordinate[1]))


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_fused_projection_forward_and_backward_match_one_device_and_move_nothing_at_the_split(shape: tuple[int, ...]) -> None:
    torch.set_default_dtype(torch.float64)
    mesh = _mesh(shape)
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8)
    w = torch.randn(8, 24, requires_grad=True)  # Conv1D layout: (in, 3 * out)
    b = torch.randn(24, requires_grad=True)
    w2 = torch.randn(8, 16, requires_grad=True)  # a fused gate|up
    batch = [Shard(0)] if len(shape) == 2 else []
    dw = sw.distribute_tensor(w.detach(), mesh, [Replicate()] * len(batch) + [S3]).requires_grad_()
    db = sw.distribute_tensor(b.detach(), mesh, [Replicate()] * len(batch) + [_StridedShard(0, split_factor=3)]).requires_grad_()
    dw2 = sw.distribute_tensor(w2.detach(), mesh, [Replicate()] * len(batch) + [_StridedShard(1, split_factor=2)])
    dw2.requires_grad_()
    dx = sw.distribute_tensor(x, mesh, [*batch, Replicate()])

    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(b, x.view(-1, 8), w).view(4, 5, 24)
        q, k, v = y.split(8, dim=2)  # GPT-2's split
        g, u = (x @ w2).chunk(2, dim=-1)  # gate|up
        s = y[..., 16:24] * 2  # a slice of one whole part: Phi-3's
        return (q * torch.sigmoid(k) + v.tanh() + g * u - s).sum(dim=1)

    want = forward(x, w, b, w2)
    want.pow(2).sum().backward()
    with sw.comm_log() as log:
        got = forward(dx, dw, db, dw2)
    assert got.placements[-1] == Shard(1), got.placements
    assert not log, [r.op for r in log]  # the split into parts moved nothing
    torch.testing.assert_close(got.full_tensor(), want, atol=1e-12, rtol=0)
    with sw.comm_log() as log:
        got.pow(2).sum().backward()
    assert dw.grad.placements == dw.placements and db.grad.placements == db.placements
    assert {r.op for r in log} <= {"all_reduce"}, [r.op for r in log]  # the scalar loss and Partial gradients only
    torch.testing.assert_close(dw.grad.full_tensor(), w.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(db.grad.full_tensor(), b.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(dw2.grad.full_tensor(), w2.grad, atol=1e-12, rtol=0)


@distributed(world_size=4)
def test_ops_that_need_the_order_gather_and_give_the_one_device_result() -> None:
    torch.set_default_dtype(torch.float64)
    mesh = _mesh((4,))
    torch.manual_seed(0)
    full = torch.randn(3, 24)
    d = sw.distribute_tensor(full, mesh, [S3])
    torch.testing.assert_close(d.cumsum(1).full_tensor(), full.cumsum(1), atol=1e-12, rtol=0)
    torch.testing.assert_close(d.flip(1).full_tensor(), full.flip(1))
    assert torch.equal(d.argmax(1).full_tensor(), full.argmax(1))
    torch.testing.assert_close(d[:, 3:9].full_tensor(), full[:, 3:9])  # not at part boundaries
    assert torch.equal(d.view(3, 3, 8).full_tensor(), full.view(3, 3, 8))  # the parts as a dim
    # beside a plain Shard of the same dim on the same mesh dim: laid alike first
    plain = sw.distribute_tensor(full, mesh, [Shard(1)])
    torch.testing.assert_close((d + plain).full_tensor(), 2 * full)
    torch.testing.assert_close(torch.cat([d, plain], dim=0).full_tensor(), torch.cat([full, full], dim=0))
    # an op without a strided reading that writes in place: written back into the parts' layout
    e = sw.distribute_tensor(full, mesh, [S3])
    e.cumsum_(1)
    assert e.placements == (S3,)
    torch.testing.assert_close(e.full_tensor(), full.cumsum(1), atol=1e-12, rtol=0)
    # sums over the strided dim are Partial: reduced to the one-device value
    torch.testing.assert_close(d.sum(1).full_tensor(), full.sum(1), atol=1e-12, rtol=0)
    torch.testing.assert_close(d.mean().full_tensor(), full.mean(), atol=1e-12, rtol=0)
    torch.testing.assert_close(d.norm().full_tensor(), full.norm(), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="divisible by 12"):
        sw.distribute_tensor(torch.randn(3, 18), mesh, [S3])


@distributed(world_size=4)
def test_fused_colwise_trains_like_one_device_and_checkpoints_round_trip() -> None:
    torch.set_default_dtype(torch.float64)
    mesh = _mesh((4,))

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)

    torch.manual_seed(0)
    ref = Attn()
    model = Attn()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, {"qkv": FusedColwiseParallel(parts=3, use_local_output=False),
                                     "out": RowwiseParallel(use_local_output=False)})
    assert model.qkv.weight.placements == (_StridedShard(0, split_factor=3),)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, model), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), atol=1e-10, rtol=0, msg=name)
    assert opts[1].state[model.qkv.weight]["exp_avg"].placements == (_StridedShard(0, split_factor=3),)

    # save the strided model; load it into plain layouts, one process's tensors, and back
    where = [tempfile.mkdtemp(prefix="sw_strided_")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(where)
    directory = str(where[0])
    checkpoint.save({"model": model.state_dict()}, checkpoint_id=directory)
    plain = {k: sw.distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in ref.state_dict().items()}
    checkpoint.load({"model": plain}, checkpoint_id=directory)
    ones = {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}
    checkpoint.load({"model": ones}, checkpoint_id=directory)
    for k, v in model.state_dict().items():
        assert torch.equal(plain[k].full_tensor(), v.full_tensor()) and torch.equal(ones[k], v.full_tensor()), k
    fresh = Attn()
    parallelize_module(fresh, mesh, {"qkv": FusedColwiseParallel(parts=3, use_local_output=False)})
    checkpoint.save({"model": plain}, checkpoint_id=directory + "_plain")
    checkpoint.load({"model": fresh.state_dict()}, checkpoint_id=directory + "_plain")
    assert torch.equal(fresh.qkv.weight.to_local(), model.qkv.weight.to_local())


@distributed(world_size=4)
def test_fused_colwise_with_parts_that_do_not_split_evenly_splits_by_columns() -> None:
    mesh = _mesh((4,))
    layer = nn.Linear(4, 15)  # 3 parts of 5: not divisible by 4 ranks
    parallelize_module(layer, mesh, FusedColwiseParallel(parts=3))
    assert layer.weight.placements == (Shard(0),)
    with pytest.raises(ValueError, match="at least 2"):
        FusedColwiseParallel(parts=1)
