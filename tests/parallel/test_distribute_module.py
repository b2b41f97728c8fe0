"""distribute_module: partition_fn on every submodule, replication of the rest, tied weights, hooks.

The multi-rank test shards a small model whose shapes do not divide the mesh, runs it
forward and backward next to the single-device reference, and checks outputs and
gradients; it also pins that a tied weight stays one parameter.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.parallel import distribute_module
from shardwise.testing import distributed


class Tied(nn.Module):
    """embedding -> linear (7 hidden, uneven on 4 ranks) -> norm -> output tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 5)
        self.fc = nn.Linear(5, 7)
        self.norm = nn.BatchNorm1d(7)
        self.back = nn.Linear(7, 5)
        self.out = nn.Linear(5, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.emb(ids))  # (n, 7)
        return self.out(self.back(torch.relu(self.norm(h))))  # (n, 10)


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# -- unit: no processes ------------------------------------------------------------------------


def test_hook_with_wrong_arity_is_a_value_error_naming_the_arity() -> None:
    def four(a: Any, b: Any, c: Any, d: Any) -> None: ...

    with pytest.raises(ValueError, match=r"input_fn takes 4 argument\(s\) \(a, b, c, d\): it must take \(module, inputs, device_mesh\)"):
        distribute_module(nn.Linear(2, 2), None, None, input_fn=four)
    with pytest.raises(ValueError, match=r"output_fn takes 1 argument\(s\) \(a\)"):
        distribute_module(nn.Linear(2, 2), None, None, output_fn=lambda a: a)


# -- multi-rank ---------------------------------------------------------------------------------

MESHES = {"(4,)": ((4,), None), "(2, 2)": ((2, 2), ("dp", "tp"))}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@distributed(world_size=4)
def test_distribute_module_matches_single_device(mesh_name: str) -> None:
    shape, names = MESHES[mesh_name]
    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    ref = Tied()
    model = copy.deepcopy(ref)
    n_params = len(list(model.parameters()))
    split = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)  # shape (2, 2): split on dp, replicated on tp

    seen: list[str] = []

    def partition(name: str, m: nn.Module, dm: sw.DeviceMesh) -> None:
        seen.append(name)
        if name == "fc":  # Linear(5, 7): 7 output rows over 4 (or 2) ranks, uneven
            m.register_parameter("weight", nn.Parameter(sw.distribute_tensor(m.weight.detach(), dm, split)))
        if name == "out":  # the tied weight, placed through its second owner
            m.register_parameter("weight", nn.Parameter(sw.distribute_tensor(m.weight.detach(), dm, split)))

    calls: list[str] = []

    def input_fn(mod: nn.Module, inputs: tuple[Any, ...], dm: sw.DeviceMesh) -> tuple[Any, ...]:
        calls.append(f"in {type(mod).__name__}")
        return (DTensor.from_local(inputs[0], dm, [Replicate()] * dm.ndim),)

    def output_fn(mod: nn.Module, outputs: Any, dm: sw.DeviceMesh) -> torch.Tensor:
        calls.append("out")
        return outputs.full_tensor()

    distribute_module(model, mesh, partition, input_fn, output_fn)

    assert seen == [n for n, _ in ref.named_modules()]
    assert model.out.weight is model.emb.weight, "the tied weight must stay one parameter"
    assert len(list(model.parameters())) == n_params
    layouts = {n: p.placements for n, p in model.named_parameters(remove_duplicate=False)}
    assert layouts["fc.weight"] == tuple(split) and layouts["out.weight"] == tuple(split) == layouts["emb.weight"]
    assert layouts["fc.bias"] == layouts["back.weight"] == (Replicate(),) * mesh.ndim
    assert all(isinstance(b, DTensor) for b in model.buffers())
    assert all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in model.parameters())

    ids = torch.tensor([3, 1, 4, 1, 5, 9])
    with sw.implicit_replication():  # batch norm's running-stat update mixes in plain scalars
        got = model(ids)
        got.sum().backward()
    want = ref(ids)
    want.sum().backward()
    assert calls == ["in Tied", "out"]
    assert not isinstance(got, DTensor)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad {name}: {m}")
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(_full(b), rb, msg=lambda m: f"buffer {name}: {m}")


@distributed(world_size=4)
def test_two_argument_hooks_still_work_with_a_future_warning() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = nn.Linear(3, 6)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribute_module(
            model,
            mesh,
            lambda name, m, dm: m.register_parameter(
                "weight", nn.Parameter(sw.distribute_tensor(m.weight.detach(), dm, [Shard(0)]))
            ),
            lambda inputs, dm: (DTensor.from_local(inputs[0], dm, [Replicate()]),),
            lambda outputs, dm: outputs.redistribute(dm, [Replicate()]).to_local(),
        )
    assert sorted(str(w.message).split(" taking")[0] for w in caught if w.category is FutureWarning) == ["input_fn", "output_fn"]
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x), ref(x))


@distributed(world_size=4)
def test_current_mesh_is_used_when_none_is_given() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    with mesh:
        model = distribute_module(nn.Linear(2, 3))
    assert all(isinstance(p, DTensor) and p.device_mesh == mesh for p in model.parameters())
