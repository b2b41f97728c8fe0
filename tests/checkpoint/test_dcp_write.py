"""Checkpoints shardwise writes with `FileSystemWriter`, read by torch's DCP and by shardwise.

shardwise saves on 4 ranks: a tensor-parallel MLP on a (2, 2) mesh (Colwise then Rowwise on
"tp", so every piece has a replica on the other "dp" row), its AdamW state, a DTensor of
uneven shape split on both mesh dims, a Partial DTensor, a plain tensor and plain values,
under a nested state dict. torch's `dcp.load` reads it into torch DTensors on a (4,) mesh
(10 rows over 4 ranks: 3, 3, 3, 1) and, in one process, into plain tensors; shardwise's
`FileSystemReader` reads it onto a (4,) mesh: the values equal what was saved. A save that
fails on one rank raises on every rank, and the directory still loads the checkpoint it
held before, with torch's `dcp.load`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard, checkpoint
from shardwise.checkpoint import FileSystemReader, FileSystemWriter
from shardwise.checkpoint import _dcp_write
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

from .test_dcp_format import _assert_same, _flat

EXTRA = torch.arange(70.0).view(10, 7)  # on (2, 2) as [Shard(0), Shard(1)]: columns 4, 3


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))


def _stepped(model: nn.Module, lr: float, forward: bool = True) -> torch.optim.Optimizer:
    """An AdamW over `model` that has taken one step (so its state has tensors to load into);
    without `forward`, on gradients of ones (torch's TP cannot run 10 features over 4 ranks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if forward:
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(0))).sum().backward()
    else:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _shardwise_state(seed: int) -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp(seed)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = _stepped(model, 0.1)
    rank = dist.get_rank()
    partial = sw.DTensor.from_local(torch.full((3,), float(rank % 2 + 1)), mesh, [Replicate(), Partial("sum")])
    extra = {"w": sw.distribute_tensor(EXTRA + seed, mesh, [Shard(0), Shard(1)]), "partial": partial,
             "plain": torch.arange(5.0) + seed, "step": 3 + seed, "lr": 0.25}
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra}


def _shardwise_saves(path: str) -> dict[str, Any]:
    state = _shardwise_state(0)
    checkpoint.save(state, storage_writer=FileSystemWriter(path))
    return _flat(state)


def _torch_target(mesh: Any = None) -> dict[str, Any]:
    """An identical MLP as torch's (DTensors on `mesh` when given), stepped, and zeroed extras."""
    from torch.distributed.tensor import Replicate as TorchReplicate, Shard as TorchShard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise, RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    model = _mlp(1)
    if mesh is not None:
        torch_parallelize(model, mesh, {"0": TorchColwise(), "2": TorchRowwise()})
    opt = _stepped(model, 0.5, forward=False)
    w, partial = torch.zeros(10, 7), torch.zeros(3)
    if mesh is not None:
        w, partial = distribute_tensor(w, mesh, [TorchShard(1)]), distribute_tensor(partial, mesh, [TorchReplicate()])
    extra = {"w": w, "partial": partial, "plain": torch.zeros(5), "step": 0, "lr": 0.0}
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra}


def _torch_loads_on_four(path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    target = _torch_target(mesh)
    dcp.load(target, checkpoint_id=path)
    assert target["model"]["0.weight"].to_local().shape[0] == (3 if dist.get_rank() < 3 else 1)
    return _flat(target)


def _shardwise_loads_on_four(path: str) -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", (4,))
    model = _mlp(1)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    target = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.5),
              "extra": {"w": sw.distribute_tensor(torch.zeros(10, 7), mesh, [Shard(1)]),
                        "partial": sw.distribute_tensor(torch.zeros(3), mesh, [Replicate()]),
                        "plain": torch.zeros(5), "step": 0, "lr": 0.0}}
    checkpoint.load(target, storage_reader=FileSystemReader(path))
    return _flat({"model": model.state_dict(), "optim": target["optim"].state_dict(), "extra": target["extra"]})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("dcp_write")
    return path, run_distributed(_shardwise_saves, 4, str(path))[0]


def test_the_partial_dtensor_is_saved_reduced(saved: tuple[Path, dict[str, Any]]) -> None:
    target = {"extra": {"partial": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(saved[0]), no_dist=True)
    assert torch.equal(target["extra"]["partial"], torch.full((3,), 3.0))


def test_shardwise_tp_on_2x2_loads_into_torch_dtensors_on_4(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    for got in run_distributed(_torch_loads_on_four, 4, str(path)):
        _assert_same(got, want)


def test_it_loads_into_plain_tensors_with_torch_in_one_process(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    target = _torch_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
    _assert_same(_flat(target), want)
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_shardwise_file_system_reader_loads_it_onto_another_mesh(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    for got in run_distributed(_shardwise_loads_on_four, 4, str(path)):
        _assert_same(got, want)


def test_keys_are_flattened_as_torch_flattens_them() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    state = {"a": {0: torch.ones(1), "b": [1, 2], "c": [torch.ones(1), 3], "d": (torch.ones(1),)},
             "e": [{"f": (1, 2)}, [[torch.ones(2)]]], "g": {}, "h": None}
    flat, mapping = flatten_state_dict(state)
    items = _dcp_write.dcp_items(state)
    assert [k for k, _, _ in items] == list(flat)
    assert {k: p for k, p, _ in items} == mapping
    assert all(leaf is flat[k] for k, _, leaf in items)


def _fails_on_rank_one(path: str) -> tuple[dict[str, Any], str, list[str]]:
    """Save seed 0, then a seed-1 save that fails on rank 1 midway through its data file."""
    first = _shardwise_state(0)
    checkpoint.save(first, storage_writer=FileSystemWriter(path))
    want = _flat(first)
    before = sorted(os.listdir(path))
    second = _shardwise_state(1)
    original = _dcp_write._standalone
    calls = []

    def failing(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        if len(calls) == 3:
            raise OSError("no space left on device (simulated)")
        return original(t)

    if dist.get_rank() == 1:
        _dcp_write._standalone = failing  # type: ignore[assignment]
    try:
        with pytest.raises(Exception) as caught:
            checkpoint.save(second, storage_writer=FileSystemWriter(path))
    finally:
        _dcp_write._standalone = original
    dist.barrier()
    assert sorted(os.listdir(path)) == before  # rank 0 removed the failed save's files
    return want, str(caught.value), before


def test_a_save_failing_on_one_rank_raises_everywhere_and_the_previous_checkpoint_still_loads(tmp_path: Path) -> None:
    results = run_distributed(_fails_on_rank_one, 4, str(tmp_path))
    messages = [message for _, message, _ in results]
    assert "simulated" in messages[1]
    assert all("rank 1" in m for r, m in enumerate(messages) if r != 1), messages
    target = _torch_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_same(_flat(target), results[0][0])
    assert target["extra"]["step"] == 3
