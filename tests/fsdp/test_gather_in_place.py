"""The units' all_gather writes each rank's piece into its block of the output buffer
(`AllGather(in_place=True)`): the same result as the ordinary form, on uneven pieces too,
and the ordinary form wherever a dry run answers or a hook runs the collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import _comm as comm
from shardwise.testing import distributed

PIECES = (3, 3, 2, 0)  # uneven, and one rank with nothing


def _gathers(group: object, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    mine = torch.arange(PIECES[rank], dtype=torch.float64) + 10 * rank
    ordinary = comm.AllGather(group=group, size=4, shape=(PIECES[rank],), dtype=torch.float64, tensor_dim=0,
                              pieces=PIECES)
    in_place = comm.AllGather(group=group, size=4, shape=(PIECES[rank],), dtype=torch.float64, tensor_dim=0,
                              pieces=PIECES, in_place=True, index=rank)
    buffer = torch.full((4 * max(PIECES),), float("nan"), dtype=torch.float64)
    buffer.narrow(0, rank * max(PIECES), PIECES[rank]).copy_(mine)
    return comm.start(ordinary, mine).result(), comm.start(in_place, buffer).result()


@distributed(world_size=4)
def test_an_in_place_gather_of_uneven_pieces_equals_the_ordinary_one() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    want = torch.cat([torch.arange(p, dtype=torch.float64) + 10 * r for r, p in enumerate(PIECES)])
    ordinary, in_place = _gathers(mesh.get_group(0), rank)
    assert torch.equal(ordinary, want) and torch.equal(in_place, want)
    with sw.comm_log() as log:  # an observer keeps the in-place form; the record is the same
        ordinary, in_place = _gathers(mesh.get_group(0), rank)
    assert torch.equal(in_place, want)
    assert [(r.op, r.bytes_received) for r in log][0] == [(r.op, r.bytes_received) for r in log][1]


def test_a_dry_run_answers_an_in_place_gather_in_its_ordinary_form() -> None:
    from shardwise._mesh import as_device_mesh, simulating

    mesh = as_device_mesh(sw.AbstractMesh((4,)))
    with simulating(2):
        ordinary, in_place = _gathers(mesh.get_group(0), 2)
    assert ordinary.shape == in_place.shape == (8,)
