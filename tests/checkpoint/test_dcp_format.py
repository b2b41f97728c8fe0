"""Checkpoints that torch's DCP wrote, loaded by shardwise through `FileSystemReader`.

One checkpoint is saved by torch itself on 4 ranks: a torch DTensor tensor-parallel MLP on
a (2, 2) mesh (torch's `parallelize_module`, Colwise then Rowwise on the "tp" dim), its
AdamW state, a DTensor of uneven shape split on both mesh dims, a plain tensor and plain
values, under a nested state dict, by `torch.distributed.checkpoint.save`. shardwise loads
it onto a (4,) mesh (other pieces, uneven: 10 rows over 4 ranks) and, in one process, into
plain tensors: the values equal torch's. Damaged copies (a `.metadata` that would run code,
a table that no longer tiles a tensor, a truncated, missing or out-of-range data file, a
stream transform) are refused with a ValueError naming the file and the key, nothing runs,
and the state dict is unchanged.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardwise as sw
from shardwise import Shard, checkpoint
from shardwise.checkpoint import FileSystemReader
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

EXTRA = torch.arange(70.0).view(10, 7)  # on (2, 2) as [Shard(0), Shard(1)]: columns 4, 3; on (4,) as Shard(1): 2, 2, 2, 1


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))


def _full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _flat(value: Any, where: str = "") -> dict[str, Any]:
    """Every leaf by dotted path, tensors whole and cloned (so later changes do not show)."""
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        value = value.state_dict()
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{where}.{key}".lstrip(".")).items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{where}.{i}").items()}
    value = _full(value)
    return {where: value.detach().clone() if isinstance(value, torch.Tensor) else value}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _torch_saves(path: str) -> dict[str, Any]:
    """torch's own TP program on (2, 2), saved by torch's DCP; its values, whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TorchShard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise, RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp(0)
    torch_parallelize(model, mesh["tp"], {"0": TorchColwise(), "2": TorchRowwise()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    extra = {"w": distribute_tensor(EXTRA, mesh, [TorchShard(0), TorchShard(1)]), "plain": torch.arange(5.0),
             "step": 3, "lr": 0.25}
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra}
    dcp.save(state, checkpoint_id=path)
    return _flat(state)


def _target(mesh: Any = None) -> dict[str, Any]:
    model = _mlp(1)
    if mesh is not None:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    w = torch.zeros(10, 7) if mesh is None else sw.distribute_tensor(torch.zeros(10, 7), mesh, [Shard(1)])
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.5),
            "extra": {"w": w, "plain": torch.zeros(5), "step": 0, "lr": 0.0}}


def _shardwise_loads_on_four(path: str) -> dict[str, Any]:
    mesh = sw.init_device_mesh("cpu", (4,))
    target = _target(mesh)
    checkpoint.load(target, storage_reader=FileSystemReader(path))
    assert target["model"][0].weight.to_local().shape[0] == (3 if mesh.get_coordinate()[0] < 3 else 1)
    return _flat(target)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("dcp")
    return path, run_distributed(_torch_saves, 4, str(path))[0]


def test_torch_tp_on_2x2_loads_into_shardwise_on_4(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    for got in run_distributed(_shardwise_loads_on_four, 4, str(path)):
        _assert_same(got, want)


def test_torch_tp_checkpoint_loads_into_plain_tensors_in_one_process(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    target = _target()
    checkpoint.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    _assert_same(_flat(target), want)
    assert target["optim"].state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)


def test_a_part_of_the_state_dict_loads_alone(saved: tuple[Path, dict[str, Any]]) -> None:
    path, want = saved
    target = {"extra": _target()["extra"]}
    checkpoint.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    _assert_same(_flat(target), {k: v for k, v in want.items() if k.startswith("extra.")})


# Damaged copies ---------------------------------------------------------------------------


class _RunsCode:
    """A pickle that, if unpickled by plain pickle, creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return os.system, (f"touch {self.marker}",)


def _metadata(path: Path) -> Any:
    return pickle.loads((path / ".metadata").read_bytes())  # the test's own, trusted copy


def _rewrite(path: Path, metadata: Any) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _where(path: Path, key: str) -> Any:
    """The storage info of the first chunk of `key`."""
    return next(info for index, info in _metadata(path).storage_data.items() if index.fqn == key)


def _copy(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[0], copy)
    return copy


def _refused(path: Path, *named: str) -> str:
    """Load `path` into a fresh state dict; assert a ValueError naming `named` and nothing changed."""
    target = _target()
    before = _flat(target)
    with pytest.raises(ValueError) as caught:
        checkpoint.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    _assert_same(_flat(target), before)
    assert not target["optim"].state  # a never-stepped optimizer stays never-stepped
    for name in named:
        assert name in str(caught.value), (name, str(caught.value))
    return str(caught.value)


@pytest.mark.parametrize("where", ["whole", "inside"])
def test_a_metadata_pickle_that_would_run_code_is_refused_and_nothing_runs(
        saved: tuple[Path, dict[str, Any]], tmp_path: Path, where: str) -> None:
    path = _copy(saved, tmp_path)
    marker = tmp_path / "marker"
    if where == "whole":
        _rewrite(path, _RunsCode(marker))
    else:  # hidden in a real table, where a field of an admitted class would be
        metadata = _metadata(path)
        metadata.planner_data = {"model.0.weight": _RunsCode(marker)}
        _rewrite(path, metadata)
    message = _refused(path, ".metadata", "system")
    assert "refused, not run" in message
    assert not marker.exists()


def test_a_table_that_no_longer_tiles_a_tensor_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    metadata = _metadata(path)
    chunk = metadata.state_dict_metadata["model.0.weight"].chunks[0]
    chunk.sizes = torch.Size([chunk.sizes[0] + 1, chunk.sizes[1]])
    _rewrite(path, metadata)
    _refused(path, ".metadata", "model.0.weight", "overlap")


def test_a_truncated_data_file_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    info = _where(path, "model.0.weight")
    os.truncate(path / info.relative_path, info.offset + info.length - 1)
    _refused(path, info.relative_path, "model.0.weight", "truncated")


def test_a_chunk_range_outside_its_file_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    metadata = _metadata(path)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == "extra.w")
    info.offset = (path / info.relative_path).stat().st_size
    _rewrite(path, metadata)
    _refused(path, info.relative_path, "'extra.w'")


def test_a_missing_data_file_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    info = _where(path, "model.2.weight")
    (path / info.relative_path).unlink()
    message = _refused(path, info.relative_path, "does not exist")
    keys = {i.fqn for i, s in _metadata(path).storage_data.items() if s.relative_path == info.relative_path}
    assert any(f"'{key}'" in message for key in keys), message


def test_a_chunk_whose_bytes_are_another_tensor_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    metadata = _metadata(path)
    infos = {i.fqn: s for i, s in metadata.storage_data.items()}
    weight = next(s for i, s in metadata.storage_data.items() if i.fqn == "model.0.weight")
    weight.relative_path, weight.offset, weight.length = (infos["extra.plain"].relative_path, infos["extra.plain"].offset,
                                                          infos["extra.plain"].length)
    _rewrite(path, metadata)
    _refused(path, "'model.0.weight'", "the table says a chunk of shape")


def test_a_stream_transform_is_refused_by_name(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    metadata = _metadata(path)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == "extra.plain")
    info.transform_descriptors = ["zstandard/1"]
    _rewrite(path, metadata)
    _refused(path, "'extra.plain'", "zstandard/1", info.relative_path)


def test_a_directory_without_metadata_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / ".metadata").unlink()
    _refused(path, "has no .metadata", str(path))
