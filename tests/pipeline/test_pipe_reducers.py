"""A pipe's gradient sums are registered reducers (issue 46): `gradient_reducers` names them.

On a (pp, dp) = (2, 2) mesh, a weight tied across the two stages has two reducers, both the
pipe's: the average over its dp replicas (level `replicas`) and the sum over the stages that
share it (level `across`, over this rank and its pp partner); an untied parameter has only
the first. After a step the tied copies hold the one-process gradient. A second pipe over the
same live model is refused naming the first (its gradients would be summed twice), and
`close()` gives the parameters back.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.debug import gradient_reducers
from shardwise.pipeline import DistributedPipe
from shardwise.testing import distributed

D = 4


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh()).double()
    model[2].weight = model[0].weight  # stage 0's first layer and stage 1's first layer
    return model


@distributed(world_size=4)
def test_gradient_reducers_names_the_pipes_sum_of_a_weight_tied_across_stages() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    model = _tied()
    reference = copy.deepcopy(model)
    pipe = DistributedPipe(model, [2, 2], mesh, chunks=2, loss_fn=F.mse_loss)
    stage = pipe.partitions[str(pipe.pp_rank)]
    tied = stage[0].weight
    found = gradient_reducers(tied)
    assert [(r.registrant, r.level, r.op, r.over) for r in found] == [
        ("DistributedPipe", "replicas", "avg", "mesh dim 'dp'"),
        ("DistributedPipe", "across", "sum", "the stages sharing it (pp indices [0, 1])")], [str(r) for r in found]
    assert found[0].ranks == mesh.ranks_along("dp") and found[1].ranks == mesh.ranks_along("pp")
    assert all(r.where.startswith("test_pipe_reducers.py:") for r in found), [r.where for r in found]
    assert [r.level for r in gradient_reducers(stage[0].bias)] == ["replicas"]

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, D, generator=g, dtype=torch.float64), torch.randn(6, D, generator=g, dtype=torch.float64)
    pipe.step(x, y)  # every dp replica steps the same batch: the average is the one-process gradient
    F.mse_loss(reference(x), y).backward()
    torch.testing.assert_close(tied.grad, reference[0].weight.grad, rtol=0, atol=1e-12)

    with pytest.raises(ValueError, match=r"already reduced by DistributedPipe: avg over mesh dim 'dp'") as info:
        DistributedPipe(model, [2, 2], mesh, chunks=2, loss_fn=F.mse_loss)
    assert "close() an earlier pipe over the same model" in str(info.value)
    pipe.close()
    assert gradient_reducers(tied) == ()
    DistributedPipe(model, [2, 2], mesh, chunks=2, loss_fn=F.mse_loss).close()
