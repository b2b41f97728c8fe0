"""Who reduces each gradient, on real ranks: the end-of-backward registry's answers for data
parallel, `fully_shard` units, `ContextParallel`, `ReplicateParallel` and DTensor leaves; a
second reducer of a parameter refused naming both; one engine callback per backward pass
however many of them take part."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import Replicate
from shardwise._tensor import _end_of_backward as registry
from shardwise.debug import gradient_reducers
from shardwise.fsdp import fully_shard
from shardwise.parallel import (ColwiseParallel, ContextParallel, ReplicateParallel, RowwiseParallel, data_parallel,
                                parallelize_module)
from shardwise.testing import distributed


class Tiny(nn.Module):
    """Token ids (batch, seq) -> logits: enough for the ContextParallel style (no attention)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(self.embed(input_ids))))  # type: ignore[no-any-return]


@contextmanager
def counted_passes() -> Iterator[list[int]]:
    """The graph task of every end-of-backward callback the engine runs inside the block."""
    ended: list[int] = []
    real = registry._end_of_pass

    def counted(task: int) -> None:
        ended.append(task)
        real(task)

    registry._end_of_pass = counted  # type: ignore[assignment]
    try:
        yield ended
    finally:
        registry._end_of_pass = real  # type: ignore[assignment]


def _only(p: torch.Tensor) -> sw.debug.GradientReducer:
    found = gradient_reducers(p)
    assert len(found) == 1, [str(r) for r in found]
    return found[0]


@distributed(world_size=4)
def test_context_parallel_over_a_unit_on_dp_alone_is_refused_naming_both() -> None:
    # Regression (issue 46): the style read fsdp's private state and hooked what a unit over dp
    # alone reduces; those hooks never fired (the unit takes the gradients), so the sum over cp
    # was silently missing. Now the registry refuses the second reducer, naming both.
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = Tiny()
    fully_shard(model, mesh=mesh["dp"])
    parallelize_module(model, mesh["cp"], ContextParallel())
    with pytest.raises(ValueError) as info:
        model(torch.zeros(1, 8, dtype=torch.long))
    message = str(info.value)
    assert "ContextParallel: sum over 'cp'" in message or "ContextParallel: sum over cp" in message, message
    assert "fully_shard unit 'Tiny'" in message and "already reduced by" in message, message
    assert message.count("test_gradient_reducers.py:") == 2, message  # both users' lines
    assert "dp_shard_cp" in message  # and the fix


@distributed(world_size=4)
def test_context_parallel_leaves_to_a_unit_over_dp_x_cp_what_it_reduces() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = Tiny()
    parallelize_module(model, mesh["cp"], ContextParallel())
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()  # the style asks at its first call
    for name, found in gradient_reducers(model).items():
        assert [r.registrant for r in found] == ["fully_shard unit 'Tiny'"], (name, found)
        assert found[0].ranks == (0, 1, 2, 3) and found[0].sets_grad
    assert all(p.grad is not None for p in model.parameters())


@distributed(world_size=2)
def test_context_parallel_alone_reduces_every_parameter_over_cp() -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = Tiny()
    parallelize_module(model, mesh, ContextParallel())
    ids = torch.arange(8).reshape(1, 8)
    with counted_passes() as passes:
        model(ids).sum().backward()
    assert len(passes) == 1
    for name, p in model.named_parameters():
        (record,) = [r for r in gradient_reducers(p) if r.level == "replicas"]  # (plain: a layout default too)
        assert (record.registrant, record.op, record.ranks, record.level) == ("ContextParallel", "sum", (0, 1), "replicas")
        assert record.where.startswith("test_gradient_reducers.py:"), record


@distributed(world_size=4)
def test_data_parallel_names_itself_and_its_zero3_units() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = data_parallel(Tiny(), mesh)
    record = _only(model.up.weight)
    assert (record.registrant, record.op, record.over, record.sets_grad) == ("data_parallel", "avg", "mesh dim 'dp'", True)
    assert record.ranks == tuple(mesh.ranks_along("dp"))
    sharded = data_parallel(Tiny(), mesh, shard_parameters=True)
    assert _only(sharded.up.weight).registrant == "fully_shard unit 'Tiny'"  # ZeRO-3 runs on the units


@distributed(world_size=2)
def test_tensor_parallel_styles_and_the_check_share_one_callback_per_pass() -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = Tiny()
    parallelize_module(model, mesh, {"up": ColwiseParallel(output_layouts=Replicate()), "norm": ReplicateParallel(),
                                     "down": RowwiseParallel(input_layouts=Replicate())})
    norm = _only(model.norm.weight)
    assert (norm.registrant, norm.level, norm.ranks, norm.over) == ("ReplicateParallel", "layout", (0, 1), "mesh dim 'tp'")
    assert _only(model.up.weight).registrant == "its layout (a DTensor leaf)"
    assert [r.registrant for r in gradient_reducers(model.embed.weight)] == ["its layout (a plain leaf beside DTensors)"]
    ids = torch.arange(8).reshape(1, 8)
    with counted_passes() as passes:  # the layout reduction and the first backward's check: one callback
        model(ids).sum().backward()
    assert len(passes) == 1
    assert model.norm.weight.grad.placements == (Replicate(),)
