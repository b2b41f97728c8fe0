"""torch's own objects handed to shardwise are refused by name (issue 50).

torch's `DeviceMesh`, placements, `DTensor` and parallel styles have shardwise namesakes
but are other classes. Before, shardwise's errors for them read as if the object were of
the wrong kind altogether ("placements[0] is Shard(dim=0) of type Shard: use Shard(dim),
..."), `DTensor.from_local` took torch's DTensor for a plain piece, and `distribute_tensor`
of torch's DTensor waited in a collective until the timeout. Now every entry point raises a
TypeError that names the object as torch's and what to use instead, on every rank, before
any collective.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise._describe import describe, torch_twin
from shardwise.testing import distributed

MESH = r"got torch\.distributed\.device_mesh\.DeviceMesh \(torch's\); use shardwise\.init_device_mesh\(\.\.\.\) / shardwise\.DeviceMesh"
DTENSOR = r"got torch\.distributed\.tensor\.DTensor \(torch's\); use a shardwise DTensor \(shardwise\.distribute_tensor"


def _placement(cls: str, fix: str) -> str:
    return rf"got torch\.distributed\.tensor\.placement_types\.{cls} \(torch's\); use {fix}"


def test_torchs_placements_and_styles_are_named_with_shardwises() -> None:
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as tp

    assert torch_twin(tdt.Shard(1)) == ("torch.distributed.tensor.placement_types.Shard", "shardwise.Shard(1)")
    assert torch_twin(tdt.Partial("max"))[1] == "shardwise.Partial('max')"
    assert torch_twin(tdt.Replicate())[1] == "shardwise.Replicate()"
    assert torch_twin(tp.RowwiseParallel())[1] == "shardwise.parallel.RowwiseParallel"
    for ours in (sw.Shard(1), sw.Replicate(), sw.Partial(), sw.parallel.RowwiseParallel(), torch.zeros(1), "tp"):
        assert torch_twin(ours) is None
    assert describe(tdt.Shard(0)) == ("Shard(dim=0) (torch.distributed.tensor.placement_types.Shard, torch's: use "
                                      "shardwise.Shard(0))")
    with pytest.raises(TypeError, match=r"input_layouts\[1\] " + _placement("Shard", r"shardwise\.Shard\(0\)")):
        sw.parallel.PrepareModuleInput(input_layouts=(None, tdt.Shard(0)), desired_input_layouts=(None, sw.Replicate()))
    with pytest.raises(TypeError, match=r"input_kwarg_layouts\['mask'\] " + _placement("Replicate", r"shardwise\.Replicate\(\)")):
        sw.parallel.PrepareModuleInput(input_kwarg_layouts={"mask": tdt.Replicate()},
                                       desired_input_kwarg_layouts={"mask": sw.Replicate()})
    with pytest.raises(TypeError, match=r"output_layouts " + _placement("Shard", r"shardwise\.Shard\(0\)")):
        sw.parallel.ColwiseParallel(output_layouts=tdt.Shard(0))


@distributed(world_size=4)
def test_torchs_mesh_placements_dtensor_and_styles_given_to_shardwise_name_torch_and_the_fix() -> None:
    import torch.distributed as dist
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.fsdp import fully_shard
    from shardwise.parallel import ColwiseParallel, parallelize_module

    theirs_mesh, mesh = init_device_mesh("cpu", (4,)), sw.init_device_mesh("cpu", (4,))
    x = torch.ones(8, 4)
    theirs = tdt.distribute_tensor(x, theirs_mesh, [tdt.Shard(0)])
    ours = sw.distribute_tensor(x, mesh, [sw.Shard(0)])
    cases: list[tuple[str, Callable[[], Any]]] = [
        (r"distribute_tensor\(device_mesh=\.\.\.\) " + MESH, lambda: sw.distribute_tensor(x, theirs_mesh, [sw.Shard(0)])),
        (r"placements\[0\] " + _placement("Shard", r"shardwise\.Shard\(0\)"),
         lambda: sw.distribute_tensor(x, mesh, [tdt.Shard(0)])),
        (r"distribute_tensor\(tensor=\.\.\.\) " + DTENSOR, lambda: sw.distribute_tensor(theirs, mesh, [sw.Shard(0)])),
        (r"from_local\(device_mesh=\.\.\.\) " + MESH, lambda: sw.DTensor.from_local(x, theirs_mesh, [sw.Shard(0)])),
        (r"placements\[0\] " + _placement("Partial", r"shardwise\.Partial\('sum'\)"),
         lambda: sw.DTensor.from_local(x, mesh, [tdt.Partial()])),
        (r"from_local\(local_tensor=\.\.\.\) " + DTENSOR, lambda: sw.DTensor.from_local(theirs, mesh, [sw.Replicate()])),
        (r"zeros/ones/empty/full/rand/randn\(device_mesh=\.\.\.\) " + MESH,
         lambda: sw.zeros(8, 4, device_mesh=theirs_mesh, placements=[sw.Shard(0)])),
        (r"redistribute\(device_mesh=\.\.\.\) " + MESH, lambda: ours.redistribute(theirs_mesh, [sw.Replicate()])),
        (r"placements\[0\] " + _placement("Replicate", r"shardwise\.Replicate\(\)"),
         lambda: ours.redistribute(mesh, [tdt.Replicate()])),
        (r"distribute_module\(device_mesh=\.\.\.\) " + MESH, lambda: sw.distribute_module(nn.Linear(4, 4), theirs_mesh)),
        (r"parallelize_module\(device_mesh=\.\.\.\) " + MESH,
         lambda: parallelize_module(nn.Linear(4, 4), theirs_mesh, ColwiseParallel())),
        (r"parallelize_module\(parallelize_plan=\.\.\.\) got torch\.distributed\.tensor\.parallel\.style\.ColwiseParallel "
         r"\(torch's\); use shardwise\.parallel\.ColwiseParallel",
         lambda: parallelize_module(nn.Linear(4, 4), mesh, tp.ColwiseParallel())),
        (r"'fc': .*\(torch\.distributed\.tensor\.parallel\.style\.RowwiseParallel, torch's: use "
         r"shardwise\.parallel\.RowwiseParallel\)",
         lambda: parallelize_module(nn.Sequential(), mesh, {"fc": tp.RowwiseParallel()})),
        (r"fully_shard\(mesh=\.\.\.\).*\(torch\.distributed\.device_mesh\.DeviceMesh, torch's: use "
         r"shardwise\.init_device_mesh\(\.\.\.\) / shardwise\.DeviceMesh\)",
         lambda: fully_shard(nn.Linear(4, 4), mesh=theirs_mesh)),
        (r"the torch\.distributed\.tensor\.DTensor in argument 1 .* meets a shardwise DTensor .*Make every DTensor with "
         r"shardwise", lambda: torch.mul(ours, theirs)),
    ]
    problems = []
    with sw.comm_log() as log:
        for pattern, call in cases:
            try:
                call()
            except TypeError as exc:
                if not re.search(pattern, str(exc)):
                    problems.append(f"{pattern}\n  got: {exc}")
            else:
                problems.append(f"{pattern}\n  got no error")
    assert not problems, "\n".join(problems)
    assert log == []  # refused before any collective
    dist.barrier()  # every rank raised at the same points: none is left inside a collective
