"""torch's own `fully_shard` on shardwise DTensors is refused with the fix (issue 31).

A model given shardwise tensor parallelism (`shardwise.parallel.parallelize_module`) and
then torch's `torch.distributed.fsdp.fully_shard` failed at the first forward: torch's FSDP
all-gathered the shardwise parameters as plain tensors, and some ranks raised shardwise's
plain-tensor error (a misleading hint to wrap a tensor with `from_local`) while the others
waited in the all-gather until gloo timed out. Now every rank raises the same TypeError,
before any collective, naming the parameter and `shardwise.fsdp.fully_shard`. A torch
DTensor meeting a shardwise one in an op is refused the same way.

The programs run in 4 gloo processes, as a user's would.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import distributed

FIX = r"[Uu]se shardwise\.fsdp\.fully_shard \(same signature\), as in `from shardwise\.fsdp import fully_shard`"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _all_ranks_still_in_step() -> None:
    import torch.distributed as dist

    dist.barrier()  # every rank raised at the same point: none is left inside a collective


@pytest.mark.parametrize("mesh_kind", ["torch", "shardwise"])
@distributed(world_size=4)
def test_torch_fully_shard_after_shardwise_tp_hinted_from_local_or_hung_now_names_shardwise_fsdp(mesh_kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"] if mesh_kind == "torch" else mesh["dp"]
    torch_fully_shard(model, mesh=dp)  # what a torch user keeps from a torch-only recipe
    with pytest.raises(TypeError, match=r"torch\.distributed\.fsdp\.fully_shard does not know shardwise DTensors: "
                                        r"before the forward, its all-gather over .* met parameter 'weight' of a Linear "
                                        r"\(global shape \(16, 8\)\), a shardwise DTensor on .*'tp'.*" + FIX):
        model(torch.randn(3, 8))
    _all_ranks_still_in_step()


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
@distributed(world_size=4)
def test_torch_fully_shard_on_distribute_tensor_parameters_names_shardwise_fsdp(param_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = MLP()
    for layer in (model.fc1, model.fc2):
        layer.weight = nn.Parameter(sw.distribute_tensor(layer.weight.detach(), mesh, [sw.Shard(0)]))
        layer.bias = nn.Parameter(sw.distribute_tensor(layer.bias.detach(), mesh, [sw.Replicate()]))
    # a bf16 param_dtype takes torch's other path to the all-gather (a foreach copy): refused the same
    torch_fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    x = sw.distribute_tensor(torch.randn(3, 8), mesh, [sw.Replicate()])
    with pytest.raises(TypeError, match=r"met parameter '(weight|bias)' of a Linear .*, a shardwise DTensor.*" + FIX):
        model(x)
    _all_ranks_still_in_step()


@distributed(world_size=4)
def test_torch_dtensor_meeting_a_shardwise_dtensor_failed_inside_a_fingerprint_now_names_both() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    ours = sw.distribute_tensor(torch.ones(4, 4), sw.init_device_mesh("cpu", (4,)), [sw.Shard(0)])
    theirs = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (4,)), [Replicate()])
    # (`ours + theirs` never reaches shardwise: torch's DTensor answers it with its own error)
    with pytest.raises(TypeError, match=r"aten\.mul\.Tensor: the torch\.distributed\.tensor\.DTensor in argument 1 "
                                        r"\(\[Replicate\(\)\]\[4, 4\] on .*\) meets a shardwise DTensor \(\(S\(0\)\)\[4, 4\] "
                                        r"on .*\); the two classes do not mix.*shardwise\.fsdp\.fully_shard"):
        torch.mul(ours, theirs)
    _all_ranks_still_in_step()
