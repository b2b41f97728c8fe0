"""`redistribute(device_mesh=B)`: a DTensor moves from one mesh to another.

On 4 gloo ranks, every ordered pair of meshes among (4,), (2, 2), its transpose, and the
2-rank meshes [0, 1], [2, 3] (disjoint) and [1, 2] (overlapping both), each with a set of
layouts per mesh, on an even and an uneven shape: the moved tensor's value is exact, the
gradient that comes back (through `to_local` weighted by a known tensor) is exact, and the
bytes every rank receives and sends, counted at the comm layer, are the planner's figures,
and what each rank receives is the lower bound (its target piece less what it held).
Partial sources are reduced on their own mesh (the busiest rank's bytes never exceed those
of an all_reduce there plus the crossing).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard, comm_log
from shardwise._comm import P2PRecord
from shardwise._tensor._cross import cross_move
from shardwise.testing import run_distributed

SHAPES = [(8, 4), (7, 5)]  # even, uneven (and a dim of 5 over 4 ranks: one empty piece on (4,))
LAYOUTS_1D: list[tuple[Placement, ...]] = [(Shard(0),), (Shard(1),), (Replicate(),)]
LAYOUTS_2D: list[tuple[Placement, ...]] = [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()),
                                           (Shard(0), Shard(0))]


def _meshes() -> dict[str, DeviceMesh]:
    return {
        "(4,)": DeviceMesh("cpu", [0, 1, 2, 3]),
        "(2, 2)": DeviceMesh("cpu", [[0, 1], [2, 3]]),
        "(2, 2)T": DeviceMesh("cpu", [[0, 2], [1, 3]]),
        "[0, 1]": DeviceMesh("cpu", [0, 1]),
        "[2, 3]": DeviceMesh("cpu", [2, 3]),
        "[1, 2]": DeviceMesh("cpu", [1, 2]),
    }


def _layouts(mesh: DeviceMesh) -> list[tuple[Placement, ...]]:
    return LAYOUTS_1D if mesh.ndim == 1 else LAYOUTS_2D


def _piece(full: torch.Tensor, t: DTensor) -> torch.Tensor:
    """This rank's piece of `full` in `t`'s layout (empty outside its mesh)."""
    return sw.distribute_tensor(full, t.device_mesh, list(t.placements)).to_local()


def _every_pair(shape: tuple[int, int]) -> list[str]:
    rank = dist.get_rank()
    meshes = _meshes()
    g = torch.Generator().manual_seed(sum(shape))
    full = torch.randn(shape, generator=g, dtype=torch.float64)
    weight = torch.randn(shape, generator=g, dtype=torch.float64)
    problems: list[str] = []
    for (a_name, a), (b_name, b) in itertools.permutations(meshes.items(), 2):
        for src, dst in itertools.product(_layouts(a), _layouts(b)):
            case = f"{a_name} {src} -> {b_name} {dst}"
            x = sw.distribute_tensor(full, a, list(src)).requires_grad_()
            with comm_log() as records:
                y = x.redistribute(b, list(dst))
            move = cross_move(x._spec, y._spec)
            received = sum(r.bytes_received for r in records if isinstance(r, P2PRecord))
            sent = sum(r.bytes_sent for r in records if isinstance(r, P2PRecord))
            if any(not isinstance(r, P2PRecord) for r in records):
                problems.append(f"{case}: a collective besides the point-to-point crossing")
            planned, bound = move.plan.received().get(rank, 0), move.plan.lower_bound().get(rank, 0)  # 0: in neither
            if received != planned or received != bound:
                problems.append(f"{case}: rank {rank} received {received} B, planned {planned}, lower bound {bound}")
            if sent != move.plan.sent().get(rank, 0):
                problems.append(f"{case}: rank {rank} sent {sent} B, planned {move.plan.sent().get(rank, 0)}")
            if y.device_mesh != b or y.placements != dst:
                problems.append(f"{case}: result on {y.device_mesh} {y.placements}")
            if not torch.equal(y.to_local(), _piece(full, y)):
                problems.append(f"{case}: rank {rank} holds a wrong piece")
            (y.to_local() * _piece(weight, y)).sum().backward()
            if not torch.equal(x.grad.to_local(), _piece(weight, x)):  # type: ignore[union-attr]
                problems.append(f"{case}: rank {rank} got a wrong gradient piece")
    return problems


@pytest.mark.parametrize("shape", SHAPES, ids=["even", "uneven"])
def test_every_pair_of_meshes_and_layouts_moves_exactly_the_lower_bound(shape: tuple[int, int]) -> None:
    results = run_distributed(_every_pair, 4, shape, timeout=300)
    problems = [p for rank_problems in results for p in rank_problems]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:30])


def _partial_sources() -> list[str]:
    rank = dist.get_rank()
    meshes = _meshes()
    full = torch.arange(40, dtype=torch.float64).view(8, 5)
    problems = []
    for (a_name, a), (b_name, b) in [(("(4,)", meshes["(4,)"]), ("[2, 3]", meshes["[2, 3]"])),
                                     (("(2, 2)", meshes["(2, 2)"]), ("(2, 2)T", meshes["(2, 2)T"])),
                                     (("[0, 1]", meshes["[0, 1]"]), ("(4,)", meshes["(4,)"]))]:
        src = [Partial()] * a.ndim
        for dst in _layouts(b):
            terms = a.size()
            x = DTensor.from_local(full / terms, a, src)  # outside `a` the piece is dropped (its shape says the global)
            with comm_log() as records:
                y = x.redistribute(b, list(dst))
            if not torch.equal(y.to_local(), _piece(full, y)):
                problems.append(f"{a_name} P -> {b_name} {dst}: rank {rank} holds a wrong piece")
            move = cross_move(x._spec, y._spec)
            all_reduce = 2 * (terms - 1) / terms * full.numel() * 8  # what reducing to Replicate would take
            total = sum(r.bytes_received for r in records)
            if total > all_reduce + move.plan.lower_bound().get(rank, 0) + 1e-9:
                problems.append(f"{a_name} P -> {b_name} {dst}: rank {rank} received {total} B, more than an "
                                f"all_reduce plus its lower bound")
    return problems


def test_partial_sources_are_reduced_on_their_mesh_then_moved() -> None:
    problems = [p for r in run_distributed(_partial_sources, 4, timeout=120) for p in r]
    assert not problems, "\n".join(problems)


def _explained_and_refused() -> str:
    meshes = _meshes()
    x = sw.distribute_tensor(torch.ones(8, 4), meshes["(4,)"], [Shard(0)])
    with pytest.raises(ValueError, match=r"needs placements for the new mesh \(2 of them\)"):
        x.redistribute(meshes["(2, 2)"])
    with pytest.raises(TypeError, match=r"redistribute\(device_mesh=...\) takes a DeviceMesh, got 'tp' of type str"):
        x.redistribute("tp", [Replicate()])  # type: ignore[arg-type]
    # a Partial target on another mesh: moved there replicated, then split into terms
    terms = x.redistribute(meshes["(2, 2)"], [Partial(), Replicate()])
    assert terms.placements == (Partial(), Replicate()) and torch.equal(terms.full_tensor(), torch.ones(8, 4))
    y = x.redistribute(meshes["[2, 3]"], [Replicate()])
    return cross_move(x._spec, y._spec).explain()


def test_a_move_explains_itself_and_bad_targets_are_refused() -> None:
    text = run_distributed(_explained_and_refused, 4, timeout=60)[0]
    assert "redistribute (S(0)) on mesh (4,) of ranks [0, 1, 2, 3] -> (R) on mesh (2,) of ranks [2, 3]" in text, text
    # ranks 2 and 3 each need the 3 quarters they lack (96 B of 128 B); ranks 0 and 1 receive nothing
    assert "rank 2: receives 96 B from ranks 0, 1, 3 (lower bound 96 B)" in text, text
    assert "rank 0: receives 0 B (lower bound 0 B)" in text, text
    assert math.isclose(float(text.split("total: ")[1].split(" B")[0]), 192), text


def _asynchronous() -> None:
    meshes = _meshes()
    full = torch.arange(56, dtype=torch.float64).view(7, 8)
    x = sw.distribute_tensor(full, meshes["(2, 2)"], [Shard(1), Shard(0)]).requires_grad_()
    y = x.redistribute(meshes["[1, 2]"], [Shard(1)], async_op=True)  # returns before the pieces arrive
    z = y * 2  # the first use waits
    assert torch.equal(z.to_local(), 2 * _piece(full, y))
    z.to_local().sum().backward()
    assert torch.equal(x.grad.to_local(), _piece(torch.full_like(full, 2.0), x))  # type: ignore[union-attr]


def test_an_async_move_waits_at_first_use() -> None:
    run_distributed(_asynchronous, 4, timeout=60)
