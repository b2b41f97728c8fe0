"""Reductions, softmax and normalization layers on real ranks, against one device:
outputs and every gradient, and batch norm's running statistics after training steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import make_dtensor, seeded

MESHES = [(4,), (2, 2)]
R = Replicate()
TOL: dict[str, Any] = {"atol": 1e-4, "rtol": 1e-4}


def _leaves(mesh: sw.DeviceMesh, fulls: Sequence[torch.Tensor], layouts: Sequence[Sequence[Placement]]) -> list[DTensor]:
    return [sw.distribute_tensor(t.clone().requires_grad_(True), mesh, list(lay)) for t, lay in zip(fulls, layouts)]


def _compare_grads(leaves: Sequence[DTensor], refs: Sequence[torch.Tensor], what: str) -> None:
    for k, (leaf, ref) in enumerate(zip(leaves, refs)):
        assert isinstance(leaf.grad, DTensor), f"{what}: leaf {k} got no DTensor grad"
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL, msg=lambda m: f"{what}: grad {k}\n{m}")


def _net(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    h = x @ w + b  # (B, T, 8)
    h = F.layer_norm(h, (8,), g, beta)
    p = h.softmax(-1)
    lp = h.log_softmax(1)
    return (p * p).sum() + lp.mean() + h.amax(-1).sum() + h.logsumexp(-1).sum()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@distributed(world_size=4)
def test_linear_layer_norm_softmax_net_forward_and_backward_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    # batch 6 and sequence 5 split unevenly over 4 ranks (the last rank may hold nothing)
    fulls = [seeded(6, 5, 8, seed=1), seeded(8, 8, seed=2), seeded(8, seed=3), seeded(8, seed=4) + 1, seeded(8, seed=5)]
    refs = [t.clone().requires_grad_(True) for t in fulls]
    want = _net(*refs)
    want.backward()  # type: ignore[no-untyped-call]
    nd = len(mesh_shape)
    rep = (R,) * nd
    x_layouts = [(Shard(0),), (Shard(1),), (R,)] if nd == 1 else [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (R, Shard(0))]
    for x_layout in x_layouts:
        leaves = _leaves(mesh, fulls, [x_layout, rep, rep, rep, rep])
        got = _net(*leaves)
        assert isinstance(got, DTensor)
        torch.testing.assert_close(got.full_tensor(), want, **TOL, msg=lambda m: f"{x_layout}: loss\n{m}")
        got.backward()
        _compare_grads(leaves, refs, str(x_layout))


def _reductions() -> dict[str, Callable[[torch.Tensor], Any]]:
    return {
        "sum": lambda t: t.sum(),
        "sum_dim": lambda t: t.sum(0),
        "mean": lambda t: t.mean(),
        "mean_dim": lambda t: t.mean(1, keepdim=True),
        "amax": lambda t: t.amax(0),
        "max": lambda t: t.max(),
        "min_dim": lambda t: t.min(1).values,
        "argmax": lambda t: t.argmax(0),
        "var": lambda t: t.var(0),
        "std_all": lambda t: t.std(),
        "norm": lambda t: torch.linalg.vector_norm(t, dim=1),
        "norm_inf": lambda t: torch.linalg.vector_norm(t, math.inf),
        "logsumexp": lambda t: t.logsumexp(0),
        "prod": lambda t: t.prod(1),
        "cumsum": lambda t: t.cumsum(0),
        "any": lambda t: (t > 1).any(0),
        "all": lambda t: (t > -2).all(),
        "softmax": lambda t: t.softmax(0),
    }


DIFFERENTIABLE = ("sum", "mean_dim", "amax", "var", "norm", "logsumexp", "cumsum", "softmax")


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@distributed(world_size=4)
def test_reductions_on_every_kind_of_layout_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    nd = len(mesh_shape)
    for full in (seeded(8, 4, seed=6), seeded(5, 3, seed=7)):  # even, and uneven with empty pieces
        if nd == 1:
            layouts = [(Shard(0),), (Shard(1),), (Partial(),), (Partial("avg"),), (Partial("max"),)]
        else:
            layouts = [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0)), (Partial(), Shard(1)),
                       (Shard(0), Partial("avg")), (Partial("min"), R)]
        for lay in layouts:
            x = make_dtensor(full, mesh, lay)
            for name, fn in _reductions().items():
                want, got = fn(full), fn(x)
                assert isinstance(got, DTensor), name
                torch.testing.assert_close(got.full_tensor(), want, **TOL, msg=lambda m: f"{name} {lay}\n{m}")
        for lay in [lay for lay in layouts if not any(p.is_partial() for p in lay)]:
            for name in DIFFERENTIABLE:
                fn = _reductions()[name]
                ref = full.clone().requires_grad_(True)
                weight_full = torch.randn(fn(full).shape, generator=torch.Generator().manual_seed(8))
                (fn(ref) * weight_full).sum().backward()
                leaf = sw.distribute_tensor(full.clone().requires_grad_(True), mesh, list(lay))
                weight = sw.distribute_tensor(weight_full, mesh, [R] * nd)
                (fn(leaf) * weight).sum().backward()
                assert isinstance(leaf.grad, DTensor), name
                torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL, msg=lambda m: f"grad {name} {lay}\n{m}")
    # a reduction's Partial result moves on like any other: P(max) of bools scattered to a shard
    x = sw.distribute_tensor(seeded(8, 4, seed=9), mesh, [Shard(1)] * nd)
    hit = (x > 1).any(1)
    assert hit.placements == (Partial("max"),) * nd
    torch.testing.assert_close(hit.redistribute(mesh, [Shard(0)] * nd).full_tensor(), (seeded(8, 4, seed=9) > 1).any(1))
    s = x.sum(1)
    assert s.placements == (Partial(),) * nd
    torch.testing.assert_close((s * 2).full_tensor(), seeded(8, 4, seed=9).sum(1) * 2)


def _batch_norm_steps(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor,
                      steps: int = 2) -> list[torch.Tensor]:
    """`steps` training steps (forward + backward) and one eval forward; returns each output."""
    outs = []
    for k in range(steps):
        out = F.batch_norm(x * (k + 1), rm, rv, weight, bias, training=True, momentum=0.3, eps=1e-5)
        (out * out).sum().backward()
        outs.append(out)
    outs.append(F.batch_norm(x, rm, rv, weight, bias, training=False, eps=1e-5))
    return outs


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@distributed(world_size=4)
def test_batch_norm_training_steps_update_running_statistics_like_one_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x_full, w_full, b_full = seeded(6, 8, 5, seed=10), seeded(8, seed=11), seeded(8, seed=12)
    rm_full, rv_full = seeded(8, seed=13), seeded(8, seed=14).abs() + 0.5
    refs = [t.clone().requires_grad_(True) for t in (x_full, w_full, b_full)]
    ref_rm, ref_rv = rm_full.clone(), rv_full.clone()
    want = _batch_norm_steps(*refs, ref_rm, ref_rv)
    nd = len(mesh_shape)
    # (input layout, layout of weight / bias / running statistics): channels split, or data parallel
    cases: list[tuple[tuple[Placement, ...], tuple[Placement, ...]]] = (
        [((Shard(1),), (Shard(0),)), ((Shard(0),), (R,)), ((Shard(2),), (R,))] if nd == 1
        else [((Shard(0), Shard(1)), (R, Shard(0))), ((Shard(1), Shard(1)), (Shard(0), Shard(0))), ((Shard(0), R), (R, R))]
    )
    for x_layout, p_layout in cases:
        leaves = _leaves(mesh, [x_full, w_full, b_full], [x_layout, p_layout, p_layout])
        rm = sw.distribute_tensor(rm_full.clone(), mesh, list(p_layout))
        rv = sw.distribute_tensor(rv_full.clone(), mesh, list(p_layout))
        rm_local, rv_local = rm._local_tensor, rv._local_tensor
        got = _batch_norm_steps(*leaves, rm, rv)
        what = f"{x_layout} / {p_layout}"
        for k, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g.full_tensor(), w, **TOL, msg=lambda m: f"{what}: output {k}\n{m}")
        # updated in place, where they live: same layout, same local storage, single-device values
        assert rm.placements == p_layout and rm._local_tensor is rm_local and rv._local_tensor is rv_local
        torch.testing.assert_close(rm.full_tensor(), ref_rm, **TOL, msg=lambda m: f"{what}: running_mean\n{m}")
        torch.testing.assert_close(rv.full_tensor(), ref_rv, **TOL, msg=lambda m: f"{what}: running_var\n{m}")
        _compare_grads(leaves, refs, what)
