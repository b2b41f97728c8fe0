"""A tensor-parallel MLP step, checked against one process. Run: shardwise run -n 2 examples/tensor_parallel_mlp.py

The same file runs on many machines under torchrun (`torchrun --nnodes=2 --nproc-per-node=8 ...`).
"""

import os

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    mesh = sw.init_device_mesh("cpu", (int(os.environ.get("WORLD_SIZE", "1")),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    reference = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    reference.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(8, 16)
    out = model(x)  # plain in, plain out: the styles' hooks convert at the module boundary
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(out, reference(x))
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), reference[0].weight.grad)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"rank 0 of {mesh.size()}: holds {tuple(model[0].weight.to_local().shape)} of "
              f"{tuple(model[0].weight.shape)}; output and gradients equal one process")
    # leave together and shut the group down (torch's gloo can abort at exit otherwise;
    # shardwise also does this at exit for scripts that do not)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
