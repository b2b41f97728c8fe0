"""A tour of layouts: distribute, compute, redistribute and differentiate on a (2, 2) mesh.

`shardwise demo --tour` runs it on four local gloo processes (shardwise's own harness).
Every result is checked against the same computation on one device; rank 0 prints what
happened.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Replicate, Shard

__all__ = ["run_tour", "tour"]


def _say(lines: list[str], text: str) -> None:
    lines.append(text)


def run_tour() -> list[str]:
    """The demo body, run on every rank; returns rank 0's report (other ranks return [])."""
    lines: list[str] = []
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(8, 6, generator=g)  # (batch, features)
    w_full = torch.randn(6, 10, generator=g)  # (features, hidden)

    _say(lines, f"mesh {mesh}: {dist.get_world_size()} gloo processes")
    x = sw.distribute_tensor(x_full, mesh, [Shard(0), Replicate()])  # batch split over dp
    w = sw.distribute_tensor(w_full, mesh, [Replicate(), Shard(1)])  # hidden split over tp
    _say(lines, f"x {tuple(x.shape)} as {x._spec.layout_str()}: rank {rank} holds {tuple(x.to_local().shape)}")
    _say(lines, f"w {tuple(w.shape)} as {w._spec.layout_str()}: rank {rank} holds {tuple(w.to_local().shape)}")

    with sw.comm_log() as log:
        h: DTensor = (x @ w).relu() * 2  # type: ignore[assignment]  # (8/dp, 10/tp) per rank, no comm
    _say(lines, f"h = relu(x @ w) * 2 -> {h._spec.layout_str()}, collectives: {[r.op for r in log] or 'none'}")
    assert torch.allclose(h.full_tensor(), (x_full @ w_full).relu() * 2, atol=1e-5)

    # Row-parallel: contract over the sharded hidden dim -> partial sums, reduced once.
    v_full = torch.randn(10, 4, generator=g)
    v = sw.distribute_tensor(v_full, mesh, [Replicate(), Shard(0)])
    y: DTensor = h @ v  # type: ignore[assignment]
    _say(lines, f"y = h @ v with v as {v._spec.layout_str()} -> {y._spec.layout_str()} (partial sums over tp)")
    for target in ([Shard(0), Shard(0)], [Shard(0), Replicate()]):
        plan = sw.plan_for(mesh, y.shape, y.placements, target)
        with sw.comm_log() as log:
            z = y.redistribute(mesh, target)
        moved = sum(r.bytes_received for r in log)
        _say(lines, f"  -> {z._spec.layout_str()} by {[s.kind for s in plan.steps]}: {moved} B received (plan: {plan.bytes} B)")
        assert torch.allclose(z.full_tensor(), (x_full @ w_full).relu() * 2 @ v_full, atol=1e-4)

    # Shard(0) -> Shard(1) is a real all_to_all: (n-1)/n of the local piece, not an all_gather.
    big = sw.distribute_tensor(torch.randn(64, 64, generator=g), mesh["tp"], [Shard(0)])
    with sw.comm_log() as log:
        big.redistribute(mesh["tp"], [Shard(1)])
    _say(lines, f"64x64 fp32 S(0) -> S(1) on tp: {[r.op for r in log]}, {sum(r.bytes_received for r in log)} B "
                f"(an all_gather would receive {64 * 64 * 4 // 2} B)")

    # Gradients through from_local -> ops -> full_tensor equal the single-device ones.
    xr, wr = x_full.clone().requires_grad_(True), w_full.clone().requires_grad_(True)
    ((xr @ wr).tanh().sum(1) ** 2).sum().backward()  # type: ignore[no-untyped-call]
    wl = w.to_local().detach().clone().requires_grad_(True)
    wd = sw.DTensor.from_local(wl, mesh, w.placements, shape=w.shape, stride=w.stride())
    out: DTensor = (x @ wd).tanh().sum(1) ** 2  # type: ignore[assignment]
    loss = out.full_tensor().sum()
    loss.backward()  # type: ignore[no-untyped-call]
    coord = mesh.get_coordinate()
    assert coord is not None
    want = torch.chunk(wr.grad, 2, dim=1)[coord[1]]  # type: ignore[arg-type]
    assert wl.grad is not None and torch.allclose(wl.grad, want, atol=1e-4)
    _say(lines, f"grad of w matches single device on every rank (max err {float((wl.grad - want).abs().max()):.1e})")

    torch.manual_seed(42)
    r1 = sw.randn(6, 6, device_mesh=mesh, placements=[Shard(0), Shard(1)]).full_tensor()
    torch.manual_seed(42)
    r2 = sw.randn(6, 6, device_mesh=mesh, placements=[Replicate(), Replicate()]).full_tensor()
    assert torch.equal(r1, r2)
    _say(lines, "randn under (S(0), S(1)) and (R, R) with one seed: the same global tensor")
    _say(lines, "")
    _say(lines, sw.explain_redistribute(mesh, (1024, 1024), [Shard(0), Shard(1)], [Shard(1), Shard(0)]))
    return lines if rank == 0 else []


def tour() -> int:
    """Run the tour on 4 local processes and print rank 0's report."""
    from shardwise.testing import run_distributed, shutdown_pools

    try:
        report = run_distributed(run_tour, 4, timeout=300)[0]
    finally:
        shutdown_pools()
    for line in report:
        print(line)
    print("tour finished: every result equals the single-device computation")
    return 0
