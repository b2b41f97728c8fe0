"""Matmul-family and convolution strategies on real ranks: a 2-layer MLP and a conv2d,
forward and backward, against the single-device reference (outputs and every gradient)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import seeded

MESHES = [(4,), (2, 2)]
R, S = Replicate(), Shard
TOL: dict[str, Any] = {"atol": 1e-4, "rtol": 1e-4}

Placements = Sequence[Placement]


def _check_against_single_device(
    mesh: sw.DeviceMesh, fn: Callable[..., torch.Tensor], fulls: Sequence[Optional[torch.Tensor]],
    layouts: Sequence[Optional[Placements]], what: str,
) -> DTensor:
    """Run `fn` on DTensor leaves laid out by `layouts` and on the full tensors; compare the
    output and the gradient of every leaf (loss: sum of squares of the gathered output)."""
    refs = [None if t is None else t.clone().requires_grad_(True) for t in fulls]
    want = fn(*refs)
    want.pow(2).sum().backward()  # type: ignore[no-untyped-call]
    leaves = [None if t is None or lay is None else sw.distribute_tensor(t.clone().requires_grad_(True), mesh, lay)
              for t, lay in zip(fulls, layouts)]
    got = fn(*leaves)
    assert isinstance(got, DTensor)
    torch.testing.assert_close(got.full_tensor(), want, **TOL, msg=lambda m: f"{what}: output\n{m}")
    got.full_tensor().pow(2).sum().backward()
    for k, (leaf, ref) in enumerate(zip(leaves, refs)):
        if leaf is None or ref is None:
            continue
        assert isinstance(leaf.grad, DTensor), f"{what}: leaf {k} got no DTensor grad"
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL, msg=lambda m: f"{what}: grad {k}\n{m}")
    return got


def _mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
         b2: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@distributed(world_size=4)
def test_two_layer_mlp_forward_and_backward_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    # hidden 10 over 4 ranks and batch 6 over 4 ranks are uneven (the last rank may be empty)
    x, w1, b1 = seeded(6, 5, seed=1), seeded(10, 5, seed=2), seeded(10, seed=3)
    w2, b2 = seeded(5, 10, seed=4), seeded(5, seed=5)
    x3 = seeded(2, 3, 5, seed=6)  # (batch, sequence, features): linear flattens it into mm/addmm
    if mesh_shape == (4,):
        cases: dict[str, list[Optional[Placements]]] = {
            "megatron": [[R], [S(0)], [S(0)], [S(1)], [R]],  # f: column parallel, g: row parallel
            "data_parallel": [[S(0)], [R], [R], [R], [R]],
            "column_then_row_with_sharded_input": [[S(1)], [S(0)], [S(0)], [S(1)], [R]],
        }
    else:
        cases = {
            "dp_x_tp": [[S(0), R], [R, S(0)], [R, S(0)], [R, S(1)], [R, R]],
            "data_parallel_2d": [[S(0), S(0)], [R, R], [R, R], [R, R], [R, R]],
        }
    for name, layouts in cases.items():
        _check_against_single_device(mesh, _mlp, [x, w1, b1, w2, b2], layouts, name)
        if layouts[0] != [S(1)]:  # the same layouts for a (batch, sequence, features) input
            _check_against_single_device(mesh, _mlp, [x3, w1, b1, w2, b2], layouts, name + "_3d")
    # Megatron f/g without a second bias: no collective until the row-parallel partial sums
    tp = [R] * (len(mesh_shape) - 1)
    xd = sw.distribute_tensor(x, mesh, [R] * len(mesh_shape))
    w1d, b1d = (sw.distribute_tensor(t, mesh, tp + [S(0)]) for t in (w1, b1))
    w2d = sw.distribute_tensor(w2, mesh, tp + [S(1)])
    with sw.comm_log() as log:
        h = F.gelu(F.linear(xd, w1d, b1d))
        y = F.linear(h, w2d)
    assert isinstance(h, DTensor) and isinstance(y, DTensor)
    assert h.placements == tuple(tp + [S(1)]) and y.placements == tuple(tp + [Partial()])
    assert [c.op for c in log] == [], [c.op for c in log]
    torch.testing.assert_close(y.full_tensor(), _mlp(x, w1, b1, w2, None), **TOL)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@distributed(world_size=4)
def test_conv2d_forward_and_backward_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x, w, b = seeded(6, 4, 7, 7, seed=1), seeded(8, 4, 3, 3, seed=2), seeded(8, seed=3)

    def net(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        return F.conv2d(x, w, b, stride=2, padding=1).relu()

    if mesh_shape == (4,):
        cases: dict[str, tuple[list[Optional[Placements]], tuple[Placement, ...]]] = {
            "batch": ([[S(0)], [R], [R]], (S(0),)),
            "out_channels": ([[R], [S(0)], [S(0)]], (S(1),)),
            "in_channels_no_bias": ([[S(1)], [S(1)], None], (Partial(),)),
        }
    else:
        cases = {
            "batch_x_out_channels": ([[S(0), R], [R, S(0)], [R, S(0)]], (S(0), S(1))),
            "batch_2d": ([[S(0), S(0)], [R, R], [R, R]], (S(0), S(0))),
        }
    for name, (layouts, conv_out) in cases.items():
        fulls = [x, w, b if layouts[2] is not None else None]
        _check_against_single_device(mesh, net, fulls, layouts, name)
        leaves = [None if lay is None else sw.distribute_tensor(t, mesh, lay) for t, lay in zip(fulls, layouts)]
        with sw.comm_log() as log:
            out = F.conv2d(leaves[0], leaves[1], leaves[2], stride=2, padding=1)
        assert isinstance(out, DTensor) and out.placements == conv_out and not list(log), (name, out.placements)
