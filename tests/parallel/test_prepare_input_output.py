"""`PrepareModuleInputOutput` as torch has it (issue 50): the same signature, and the same program.

torch's own tensor-parallel tests use `PrepareModuleInputOutput`. Here its signature is
torch 2.13's, argument for argument, and one program runs twice on 4 gloo ranks, once
with torch's DTensor (`torch.distributed.tensor.parallel`) and once with shardwise's, the
imports the only change: a positional input split by rows and gathered, a keyword input
likewise, a positional input left alone (`None`), and the output declared replicated and
handed on split by rows, with every combination of local inputs and local outputs. The
outputs (each rank's piece and the whole) and the gradients of the inputs and of the
module's weights are torch's.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
import shardwise.parallel as swp
from shardwise.testing import distributed

TOL = {"rtol": 1e-12, "atol": 1e-12}


def test_the_signatures_are_torchs() -> None:
    import torch.distributed.tensor.parallel as tp

    for name in ("PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"):
        theirs = list(inspect.signature(getattr(tp, name).__init__).parameters.values())[1:]  # less self
        ours = list(inspect.signature(getattr(swp, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs], name
        assert name in swp.__all__
    style = swp.PrepareModuleInputOutput(input_layouts=sw.Shard(0), desired_input_layouts=sw.Replicate(),
                                         use_local_input=True, output_layouts=sw.Replicate(),
                                         desired_output_layouts=sw.Shard(0))
    # torch's two attributes, each side as its own style
    assert style.prepare_module_input == swp.PrepareModuleInput(
        input_layouts=sw.Shard(0), desired_input_layouts=sw.Replicate(), use_local_output=True)
    assert style.prepare_module_output == swp.PrepareModuleOutput(
        output_layouts=sw.Replicate(), desired_output_layouts=sw.Shard(0), use_local_output=True)


class Scaled(nn.Module):
    """`x * scale + shift`, then a replicated linear layer when handed local tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: Any, shift: float, *, scale: Any) -> Any:
        y = x * scale + shift
        return self.proj(y) if type(y) is torch.Tensor else y


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Scaled()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> Any:
        return self.inner(x, 0.5, scale=scale)


def _run(lib: str, use_local_input: bool, use_local_output: bool) -> dict[str, torch.Tensor]:
    """The program with `lib`'s imports; this rank's results."""
    if lib == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module
    else:
        from shardwise import Replicate, Shard, init_device_mesh
        from shardwise.parallel import PrepareModuleInputOutput, parallelize_module
    mesh = init_device_mesh("cpu", (4,))
    rank = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    block = Block()
    parallelize_module(block, mesh, {"inner": PrepareModuleInputOutput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"scale": Shard(0)}, desired_input_kwarg_layouts={"scale": Replicate()},
        use_local_input=use_local_input,
        output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=use_local_output)})
    x = torch.arange(32, dtype=torch.float64).view(8, 4).chunk(4)[rank].clone().requires_grad_(True)
    scale = (1 + torch.arange(32, dtype=torch.float64).view(8, 4) / 10).chunk(4)[rank].clone().requires_grad_(True)
    out = block(x, scale)
    local = out if type(out) is torch.Tensor else out.to_local()
    weight = torch.arange(8, dtype=torch.float64).view(2, 4) + 10 * rank
    (local * weight).sum().backward()
    found = {"type": torch.tensor(type(out) is torch.Tensor), "out": local.detach(), "x.grad": x.grad,
             "scale.grad": scale.grad}
    if type(out) is not torch.Tensor:
        found["whole"] = out.full_tensor().detach()
    for name, p in block.named_parameters():
        if p.grad is not None:
            found[name + ".grad"] = p.grad
    return found


@pytest.mark.parametrize("use_local_input", [True, False])
@pytest.mark.parametrize("use_local_output", [True, False])
@distributed(world_size=4)
def test_prepare_module_input_output_runs_as_torchs(use_local_input: bool, use_local_output: bool) -> None:
    theirs = _run("torch", use_local_input, use_local_output)
    ours = _run("shardwise", use_local_input, use_local_output)
    assert sorted(ours) == sorted(theirs)
    assert ours["type"].item() == use_local_output
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
