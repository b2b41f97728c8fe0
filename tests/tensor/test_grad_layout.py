"""A DTensor leaf's accumulated gradient takes the leaf's layout: Partial terms are reduced
once, when backward accumulates them, not by every optimizer op that reads the gradient
(torch's DTensor leaves it Partial, so an AdamW step reduces each such gradient 3-4 times)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import seeded


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_a_replicated_weight_on_a_split_batch_gets_a_replicated_gradient_once(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    rest = [Replicate()] * (len(mesh_shape) - 1)
    w_full = seeded(6, 5)
    w = nn.Parameter(sw.distribute_tensor(w_full, mesh, rest + [Replicate()]))
    v = nn.Parameter(sw.distribute_tensor(w_full.t().contiguous(), mesh, rest + [Shard(0)]))  # (5, 6) rows split
    ref_w, ref_v = w_full.clone().requires_grad_(True), w_full.t().contiguous().requires_grad_(True)
    x_full = seeded(8, 6, seed=3)
    x = sw.distribute_tensor(x_full, mesh, [Shard(0)] * len(mesh_shape))  # the batch over every mesh dim
    for _ in range(2):  # two backward passes accumulate: each reduces its own term
        with sw.comm_log() as log:
            ((x @ w) @ v).pow(2).sum().backward()
        ((x_full @ ref_w) @ ref_v).pow(2).sum().backward()
        assert "all_reduce" in [r.op for r in log]
    assert w.grad.placements == w.placements and v.grad.placements == v.placements
    torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad)
    torch.testing.assert_close(v.grad.full_tensor(), ref_v.grad)
    opt = torch.optim.AdamW([w, v], lr=0.1)
    with sw.comm_log() as log:
        opt.step()
    assert log == [], [r.op for r in log]


@distributed(world_size=2)
def test_a_partial_leaf_and_a_plain_grad_are_left_as_they_are() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    p = sw.distribute_tensor(seeded(4), mesh, [Replicate()])
    q = sw.DTensor.from_local(seeded(4), mesh, [Partial()]).detach().requires_grad_(True)  # a Partial leaf
    (p.requires_grad_(True) * q).sum().backward()
    assert p.grad.placements == (Replicate(),)
    assert q.grad.placements == (Replicate(),)  # what flows to a Partial term: the whole gradient, as before


@distributed(world_size=2)
def test_deepcopy_of_a_sharded_parameter_works_and_keeps_one_gradient_hook() -> None:
    # Regression: deepcopy of a DTensor copied its spec's mesh, whose process groups cannot be
    # copied (TypeError: cannot pickle ProcessGroup): an EMA copy of a sharded model failed.
    mesh = sw.init_device_mesh("cpu", (2,))
    w = nn.Parameter(sw.distribute_tensor(seeded(3, 3), mesh, [Replicate()]))
    w.requires_grad_(True)
    w.requires_grad_(True)
    assert len(w._post_accumulate_grad_hooks) == 1
    twin = copy.deepcopy(nn.ParameterList([w]))[0]
    x = sw.distribute_tensor(seeded(4, 3), mesh, [Shard(0)])
    (x @ twin).sum().backward()
    assert twin.grad is not None and twin.grad.placements == (Replicate(),)


@distributed(world_size=4)
def test_partial_gradients_of_one_backward_are_reduced_together_in_one_all_reduce() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    weights = [seeded(6, 6, seed=k) for k in range(5)]
    params = [nn.Parameter(sw.distribute_tensor(w, mesh, [Replicate(), Replicate()])) for w in weights]
    sharded = nn.Parameter(sw.distribute_tensor(seeded(6, 6, seed=9), mesh, [Shard(0), Replicate()]))
    refs = [w.clone().requires_grad_(True) for w in weights + [seeded(6, 6, seed=9)]]
    x_full = seeded(8, 6, seed=3)
    x = sw.distribute_tensor(x_full, mesh, [Shard(0), Shard(0)])
    h, h_ref = x, x_full
    for p, r in zip(params + [sharded], refs):
        h, h_ref = torch.tanh(h @ p), torch.tanh(h_ref @ r)
    with sw.comm_log() as log:
        h.pow(2).sum().backward()
    h_ref.pow(2).sum().backward()
    # the five replicated weights' gradients: one all_reduce over the 4 ranks together
    big = [r for r in log if r.op == "all_reduce" and r.bytes_received >= 5 * 36 * 4 * 2 * 3 / 4]
    assert len(big) == 1, [(r.op, r.group_size, r.bytes_received) for r in log]
    for p, r in zip(params + [sharded], refs):
        assert p.grad.placements == p.placements
        torch.testing.assert_close(p.grad.full_tensor(), r.grad)


@distributed(world_size=4)
def test_no_sync_accumulates_partial_gradients_and_the_next_backward_reduces_the_sum_once() -> None:
    from shardwise.parallel import no_sync

    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    for name, p in list(model.named_parameters()):
        layer, attr = name.split(".")
        setattr(model[int(layer)], attr, nn.Parameter(sw.distribute_tensor(p.detach(), mesh, [Replicate()])))
    batches = [seeded(8, 6, seed=s) for s in range(3)]
    split = [sw.distribute_tensor(x, mesh, [Shard(0)]) for x in batches]
    with sw.comm_log() as log:
        with no_sync(model):
            for x in split[:2]:
                model(x).pow(2).sum().backward()
        assert [r.op for r in log] == []  # nothing reduced inside the block
        model(split[2]).pow(2).sum().backward()
    assert [r.op for r in log] == ["all_reduce"]  # the accumulated sum, one bucket
    for x in batches:
        ref(x).pow(2).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.placements == (Replicate(),), name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5)  # sums reassociate


def test_no_sync_on_a_module_without_dtensor_parameters_says_what_to_do() -> None:
    from shardwise.parallel import no_sync

    with pytest.raises(ValueError, match="no DTensor parameters and is not data parallel"):
        with no_sync(nn.Linear(2, 2)):
            pass


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward fails on purpose")


@distributed(world_size=2)
def test_a_backward_that_fails_midway_does_not_stop_later_ones_from_reducing() -> None:
    # Regression: the end-of-backward reduction was queued only while no leaf was pending; a
    # backward that raised after a leaf accumulated left it pending, so no later backward
    # queued its reduction and every gradient after that stayed Partial.
    mesh = sw.init_device_mesh("cpu", (2,))
    w1 = nn.Parameter(sw.distribute_tensor(seeded(4, 4), mesh, [Replicate()]))
    w2 = nn.Parameter(sw.distribute_tensor(seeded(4, 4, seed=1), mesh, [Replicate()]))
    x = sw.distribute_tensor(seeded(6, 4, seed=2), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="on purpose"):
        (_FailsInBackward.apply(x @ w1) @ w2).sum().backward()  # w2's gradient accumulates, then it fails
    w1.grad = w2.grad = None
    ((x @ w1) @ w2).sum().backward()
    ref1, ref2 = seeded(4, 4).requires_grad_(True), seeded(4, 4, seed=1).requires_grad_(True)
    ((seeded(6, 4, seed=2) @ ref1) @ ref2).sum().backward()
    for got, want in ((w1, ref1), (w2, ref2)):
        assert got.grad.placements == (Replicate(),)
        torch.testing.assert_close(got.grad.full_tensor(), want.grad)
