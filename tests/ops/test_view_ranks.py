"""View and shape ops on real ranks: outputs and gradients against the single-device run.

Few tests, many checks each (the simulator in ops/test_view.py covers the strategies one
by one): linear on a 3-D input (the view / _unsafe_view it decomposes into), split/cat
and unbind/stack round trips, and chains of transposes, views and slicing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
import shardwise._ops._shape  # noqa: F401  (registers the shape-op strategies until _ops/__init__ imports it)
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, make_dtensor, seeded, term_grad_scale

MESHES = [(4,), (2, 2)]
Order = Optional[dict[int, tuple[int, ...]]]


def _leaf(
    full: torch.Tensor, mesh: sw.DeviceMesh, placements: Sequence[Placement], order: Order = None
) -> tuple[DTensor, torch.Tensor]:
    """A DTensor of `full` (genuinely different terms on Partial dims) and its local leaf."""
    piece = make_dtensor(full, mesh, placements, order)._local_tensor.detach().clone().requires_grad_(True)
    x = DTensor.from_local(piece, mesh, placements, shape=full.shape, stride=full.stride(), shard_order=order)
    return x, piece


def _grad_layout(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The gradient of a Partial input's terms is the full gradient (/ n for "avg"): Partial -> Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _as_list(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _check(fn: Callable[[Any], Any], full: torch.Tensor, mesh: sw.DeviceMesh, placements: Sequence[Placement],
           order: Order = None, what: str = "") -> None:
    """fn on a DTensor of `full` matches fn on `full`: every output and the input's gradient."""
    ref = full.clone().requires_grad_(True)
    wants = _as_list(fn(ref))
    weights = [seeded(*w.shape, seed=100 + k) for k, w in enumerate(wants)]
    sum(((w * g).sum() for w, g in zip(wants, weights)), torch.zeros(())).backward()

    x, piece = _leaf(full, mesh, placements, order)
    gots = [g.full_tensor() for g in _as_list(fn(x))]
    assert len(gots) == len(wants), what
    for g, w in zip(gots, wants):
        torch.testing.assert_close(g, w.detach(), msg=lambda m: f"{what} {placements} {order} forward\n{m}")
    sum(((w * g).sum() for w, g in zip(gots, weights)), torch.zeros(())).backward()
    assert ref.grad is not None and piece.grad is not None, what
    want_grad = expected_piece(ref.grad, mesh.shape, _grad_layout(placements), mesh.get_coordinate(), order)
    want_grad = want_grad * term_grad_scale(placements, mesh.shape)
    torch.testing.assert_close(piece.grad, want_grad, msg=lambda m: f"{what} {placements} {order} gradient\n{m}")


def _layouts(mesh_ndim: int, dims: Sequence[int]) -> list[tuple[tuple[Placement, ...], Order]]:
    """Shard on each of `dims` / Replicate / Partial per mesh dim, and a reversed split order."""
    if mesh_ndim == 1:
        return [((Shard(d),), None) for d in dims] + [((Replicate(),), None), ((Partial(),), None)]
    out: list[tuple[tuple[Placement, ...], Order]] = []
    for d in dims:
        out += [((Shard(d), Shard(d)), None), ((Shard(d), Shard(d)), {d: (1, 0)}), ((Partial(), Shard(d)), None)]
    return out + [((Shard(dims[0]), Shard(dims[-1])), None), ((Replicate(), Partial("avg")), None)]


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_linear_on_a_3d_input_matches_single_device_with_gradients(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    nd = len(mesh_shape)
    w_full, b_full = seeded(7, 5, seed=2), seeded(7, seed=3)
    for x_shape in [(4, 6, 5), (3, 5, 5), (1, 8, 5)]:  # even, uneven (3 rows on 4 ranks), a batch of one
        x_full = seeded(*x_shape, seed=1)
        for lx, ox in _layouts(nd, [0, 1]):
            for lw in [(Replicate(),) * nd, (Shard(0),) + (Replicate(),) * (nd - 1)]:
                w = sw.distribute_tensor(w_full.clone().requires_grad_(True), mesh, lw)
                b = sw.distribute_tensor(b_full.clone().requires_grad_(True), mesh, [Replicate()] * nd)
                wr, br = w_full.clone().requires_grad_(True), b_full.clone().requires_grad_(True)
                _check(lambda t: F.linear(t, w if isinstance(t, DTensor) else wr, b if isinstance(t, DTensor) else br),
                       x_full, mesh, lx, ox, what=f"linear x{x_shape} w{lw}")
                assert w.grad is not None and wr.grad is not None and b.grad is not None and br.grad is not None
                torch.testing.assert_close(w.grad.full_tensor(), wr.grad, msg=lambda m: f"weight grad {lx} {lw}\n{m}")
                torch.testing.assert_close(b.grad.full_tensor(), br.grad, msg=lambda m: f"bias grad {lx} {lw}\n{m}")

    # a batch split that stays a torch.chunk piece through the flatten and back: no communication
    x = sw.distribute_tensor(seeded(8, 6, 5, seed=4), mesh, [Shard(0)] * nd)
    w = sw.distribute_tensor(w_full, mesh, [Replicate()] * nd)
    with sw.comm_log() as log:
        y = F.linear(x, w)
    assert log == [] and y.placements == (Shard(0),) * nd


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_split_cat_unbind_stack_round_trips_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    cases: dict[str, Callable[[Any], Any]] = {
        "split_cat": lambda t: torch.cat([p * (k + 1) for k, p in enumerate(t.split(2, dim=1))], dim=1),
        "split_cat_dim0": lambda t: torch.cat(t.split([1, t.shape[0] - 1], dim=0)[::-1], dim=0),
        "chunk": lambda t: t.chunk(3, dim=-1),
        "cat_other_dim": lambda t: torch.cat([t, t * 2], dim=0),
        "unbind_stack": lambda t: torch.stack([u * (k + 1) for k, u in enumerate(t.unbind(1))], dim=0),
        "unbind": lambda t: t.unbind(0),
        "stack_last": lambda t: torch.stack([t, -t], dim=-1),
        "tensor_split": lambda t: t.tensor_split(3, dim=1),
    }
    for shape in [(5, 6, 3), (8, 4, 4)]:
        full = seeded(*shape, seed=5)
        for placements, order in _layouts(len(mesh_shape), [0, 2]):
            for name, fn in cases.items():
                _check(fn, full, mesh, placements, order, what=f"{name} {shape}")
    # a split on a dim the op leaves whole is kept by every piece, and cat puts it back
    x = sw.distribute_tensor(seeded(8, 6, seed=6), mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    with sw.comm_log() as log:
        parts = x.split(2, dim=1)
        y = torch.cat(list(parts), dim=1)
    assert log == [] and all(p.placements == x.placements for p in parts) and y.placements == x.placements


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_view_transpose_and_slicing_chains_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    cases: dict[str, Callable[[Any], Any]] = {
        "transpose_view": lambda t: t.transpose(1, 2).reshape(t.shape[0], -1),
        "flatten_unflatten": lambda t: t.flatten(0, 1).unflatten(0, (t.shape[0], t.shape[1])).permute(2, 0, 1),
        "squeeze_unsqueeze": lambda t: t.unsqueeze(1).unsqueeze(-1).squeeze(-1).squeeze(1),
        "expand": lambda t: t[:, :1].expand(-1, 3, -1),
        "index": lambda t: t[1:, ::2, -1] + t[:-1, 1::2, 0],
        "select_narrow": lambda t: t.select(2, 1) * t.narrow(1, 1, 2).sum(1, keepdim=False)[:, :1],
        "repeat_flip_roll": lambda t: t.repeat(1, 2, 1).flip(1).roll(2, 0),
        "tril_triu": lambda t: t.tril() - t.transpose(1, 2).triu(1).transpose(1, 2),
        "diagonal": lambda t: t.diagonal(0, 1, 2) * 2 + t.diagonal(1, 0, 2).sum(),
        "unfold": lambda t: t.unfold(1, 2, 1),
        "movedim_mT": lambda t: t.movedim(0, -1).mT,
    }
    for shape in [(6, 4, 3), (5, 3, 3)]:
        full = seeded(*shape, seed=7)
        for placements, order in _layouts(len(mesh_shape), [0, 1]):
            for name, fn in cases.items():
                _check(fn, full, mesh, placements, order, what=f"{name} {shape}")
    # a transpose + view chain on a batch split never gathers
    x = sw.distribute_tensor(seeded(8, 6, 4, seed=8), mesh, [Shard(0)] * mesh.ndim)
    with sw.comm_log() as log:
        y = x.transpose(1, 2).reshape(8, 24).view(8, 4, 6)[:, 1:3].unsqueeze(0).squeeze(0)
    assert log == [] and y.placements == (Shard(0),) * mesh.ndim
