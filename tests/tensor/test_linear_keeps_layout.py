"""`F.linear` / `torch.matmul` on (B, S, D) activations split along a batch dim keep that split.

Regression for issue 5: linear on a 3-D input decomposes (above __torch_dispatch__) into
view(B*S, D) + mm + view, and a sequence-split input (Shard(1)) could not stay split through
the flatten: the forward all_to_all'd it and returned a Partial output that still needed an
all_reduce. Now DTensor's __torch_function__ runs it as one local linear per rank: no
collective in the forward pass, the output keeps Shard(1) (and Shard(-1) for a weight split
by output features), and outputs and gradients equal single-device ones, on meshes (4,) and
(2, 2), even and uneven shapes.
"""

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

R, S, P = Replicate(), Shard, Partial()
TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
Layout = Optional[Sequence[Placement]]

# (x layout, x split order, weight layout, bias layout or None, expected output layout)
CASES: dict[tuple[int, ...], list[tuple[Layout, Any, Layout, Layout, Sequence[Placement]]]] = {
    (4,): [
        ([S(1)], None, [R], [R], [S(1)]),  # sequence parallel, replicated weight
        ([S(1)], None, [R], None, [S(1)]),
        ([S(0)], None, [R], [R], [S(0)]),  # batch split (uneven batch 3 over 4 ranks)
    ],
    (2, 2): [
        ([S(1), R], None, [R, S(0)], [R, S(0)], [S(1), S(2)]),  # sequence x out-feature split
        ([S(1), S(2)], None, [R, S(1)], None, [S(1), P]),  # sequence x contraction split: partial sums
        ([S(0), S(1)], None, [R, R], [R, R], [S(0), S(1)]),
        ([S(1), S(1)], {1: (1, 0)}, [R, R], [R, R], [S(1), S(1)]),  # sequence split y-major
    ],
}


def _run(mesh: sw.DeviceMesh, op: Callable[..., torch.Tensor], fulls: Sequence[Optional[torch.Tensor]],
         layouts: Sequence[Layout], x_order: Any, expected: Sequence[Placement], what: str) -> None:
    refs = [None if t is None else t.clone().requires_grad_(True) for t in fulls]
    want = op(*refs)
    (want * want).sum().backward()
    leaves = [
        None if t is None or lay is None
        else sw.distribute_tensor(t.clone(), mesh, lay, shard_order=x_order if k == 0 else None).requires_grad_(True)
        for k, (t, lay) in enumerate(zip(fulls, layouts))
    ]
    with sw.comm_log() as log:
        got = op(*leaves)
    assert isinstance(got, DTensor) and got.placements == tuple(expected), f"{what}: output {got.placements}"
    assert not log, f"{what}: the forward pass communicated: {log}"
    if x_order:
        assert dict(got.shard_order)[1] == x_order[1], f"{what}: output split order {got.shard_order}"
    torch.testing.assert_close(got.full_tensor(), want, **TOL, msg=lambda m: f"{what}: output\n{m}")
    full = got.full_tensor()
    (full * full).sum().backward()
    for k, (leaf, ref) in enumerate(zip(leaves, refs)):
        if leaf is None or ref is None:
            continue
        assert isinstance(leaf.grad, DTensor), f"{what}: leaf {k} has no DTensor gradient"
        torch.testing.assert_close(leaf.grad.full_tensor(), ref.grad, **TOL, msg=lambda m: f"{what}: grad {k}\n{m}")


@pytest.mark.parametrize("mesh_shape", list(CASES), ids=str)
@distributed(world_size=4)
def test_linear_on_a_split_batch_dim_keeps_the_layout_without_communicating(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for bsd, n_out in [((2, 8, 4), 6), ((3, 5, 4), 5)]:  # even, then uneven (3 and 5 over 4 or 2 ranks)
        x, w, b = seeded(*bsd, seed=1), seeded(n_out, bsd[-1], seed=2), seeded(n_out, seed=3)
        for x_lay, order, w_lay, b_lay, out in CASES[mesh_shape]:
            tag = f"{mesh_shape} x{bsd} {x_lay} w{w_lay} b{b_lay}"
            if b_lay is None:
                _run(mesh, F.linear, [x, w], [x_lay, w_lay], order, out, "F.linear " + tag)
                # the same product through matmul on the transposed weight, three spellings
                w2 = w.t().contiguous()
                w2_lay = [S(1 - p.dim) if isinstance(p, Shard) else p for p in w_lay]
                _run(mesh, lambda a, c: a @ c, [x, w2], [x_lay, w2_lay], order, out, "@ " + tag)
                _run(mesh, torch.matmul, [x, w2], [x_lay, w2_lay], order, out, "torch.matmul " + tag)
                _run(mesh, lambda a, c: a.matmul(c), [x, w2], [x_lay, w2_lay], order, out, "Tensor.matmul " + tag)
            else:
                _run(mesh, F.linear, [x, w, b], [x_lay, w_lay, b_lay], order, out, "F.linear " + tag)


@distributed(world_size=4)
def test_linear_layouts_it_does_not_handle_run_the_ordinary_way() -> None:
    """A weight split by output features on the mesh dim that splits the sequence cannot be
    local: it takes the composite path (which communicates) and is still exact."""
    mesh = sw.init_device_mesh("cpu", (4,))
    x, w, b = seeded(2, 8, 4, seed=1), seeded(6, 4, seed=2), seeded(6, seed=3)
    want = F.linear(x, w, b)
    xd, wd, bd = (sw.distribute_tensor(t, mesh, [S(k)]) for t, k in ((x, 1), (w, 0), (b, 0)))
    with sw.comm_log() as log:
        got = F.linear(xd, wd, bd)
    assert log, "expected the composite path, which communicates"
    torch.testing.assert_close(got.full_tensor(), want, **TOL)
    # 2-D inputs never flatten: the matmul strategies keep them as before
    x2 = sw.distribute_tensor(seeded(8, 4), mesh, [S(0)])
    assert F.linear(x2, sw.distribute_tensor(w, mesh, [R])).placements == (S(0),)


@distributed(world_size=2)
def test_a_tensor_that_gains_a_split_middle_dim_in_place_takes_the_local_linear_path() -> None:
    # Only DTensors split on a middle dim pay for the linear interception (their own class);
    # an in-place op that moves the split there (unsqueeze_) must switch the class too.
    mesh = sw.init_device_mesh("cpu", (2,))
    full, w_full = seeded(6, 5), seeded(3, 5, seed=2)
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    plain_class = type(x)
    x.unsqueeze_(0)  # (1, 6, 5), split on dim 1 now
    assert x.placements == (Shard(1),) and type(x) is not plain_class
    w = sw.distribute_tensor(w_full, mesh, [Replicate()])
    with sw.comm_log() as log:
        y = F.linear(x, w)
    assert log == [] and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), F.linear(full.unsqueeze(0), w_full))
    x.squeeze_(0)
    assert type(x) is plain_class
