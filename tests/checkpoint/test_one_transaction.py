"""One save transaction, a small writer per format: `async_save` in every format, and a format written in a test.

Issue 46: the save transaction was written three times (native, torch DCP, safetensors),
the newer two importing the native one's private helpers, and `async_save` wrote the native
format only. Now every format is a `StorageWriter` answering where its bytes go and writing
them, and the transaction (checks, agreements, who writes what, the atomic switch, cleaning
up) is shared, so `async_save` takes a `storage_writer` too. Here: the DCP and safetensors
writers saved asynchronously (the state as it was at the call is what loads back, though it
changes before anything is written), on 4 ranks with layouts that exercise every row of the
who-writes-what table, a background failure that reaches every rank and leaves the previous
directory byte for byte, and a toy format of a few lines that gets the transaction's
guarantees for free.
"""

from __future__ import annotations

import ast
import json
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Partial, Shard, checkpoint
from shardwise.checkpoint import FileSystemReader, FileSystemWriter, HuggingFaceStorageReader, HuggingFaceStorageWriter
from shardwise.checkpoint import _dcp_write, _hf_write
from shardwise.checkpoint._files import write_atomically
from shardwise.checkpoint._writer import Save, Share, StorageWriter
from shardwise.testing import run_distributed


class _Gate:
    """A writing function held until `open()` (or 30 s, so a broken test cannot hang), and
    checked to run on the background thread."""

    def __init__(self, real: Any) -> None:
        self.event, self.real = threading.Event(), real

    def __call__(self, *args: Any) -> Any:
        assert threading.current_thread() is not threading.main_thread()  # written in the background
        self.event.wait(30)
        return self.real(*args)

    def open(self) -> None:
        self.event.set()


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12.0).view(3, 4), "n": torch.tensor(5), "opt": {"step": 3}}


def test_async_save_in_torch_dcp_format_saves_the_state_as_it_was_at_the_call(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state()
    gate = _Gate(_dcp_write.write_atomically)
    with mock.patch.object(_dcp_write, "write_atomically", gate):
        future = checkpoint.async_save(state, storage_writer=FileSystemWriter(tmp_path))
        state["w"].add_(100)  # the next optimizer step, before anything is written
        state["n"].fill_(0)
        assert not future.done() and not (tmp_path / ".metadata").exists()
        gate.open()
        assert future.result(timeout=30) is None
    target = {"w": torch.zeros(3, 4), "n": torch.tensor(0), "opt": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it loads in one process
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(target["w"], _state()["w"]) and int(target["n"]) == 5 and target["opt"]["step"] == 3


def test_async_save_in_safetensors_saves_the_state_as_it_was_at_the_call(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = {"a": torch.arange(60.0), "b": torch.arange(7)}
    checkpoint.save({"a": torch.zeros(60), "b": torch.zeros(7, dtype=torch.int64)},
                    storage_writer=HuggingFaceStorageWriter(tmp_path))  # the previous save
    gate = _Gate(_hf_write._write_box)
    with mock.patch.object(_hf_write, "_write_box", gate):
        future = checkpoint.async_save(state, storage_writer=HuggingFaceStorageWriter(tmp_path, max_shard_size=250))
        state["a"].mul_(-1)
        assert not future.done() and torch.equal(load_file(tmp_path / "model.safetensors")["a"], torch.zeros(60))
        gate.open()
        future.result(timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                            "model.safetensors.index.json"]  # the single file went, nothing hidden left
    got = {**load_file(tmp_path / "model-00001-of-00002.safetensors"),
           **load_file(tmp_path / "model-00002-of-00002.safetensors")}
    assert torch.equal(got["a"], torch.arange(60.0)) and torch.equal(got["b"], torch.arange(7))


def _async_in_both_formats(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """4 ranks on (dp, tp): a 2-D split, a tensor on the tp sub-mesh (a replica per dp row), a
    Partial, a plain tensor; async_save in each format, the state changed at once; loaded back
    onto a (4,) mesh."""
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = {"a": torch.arange(70.0).view(10, 7), "b": torch.arange(12.0).view(4, 3), "c": torch.arange(6.0),
            "d": torch.full((5,), 2.0)}
    partial = sw.DTensor.from_local(full["c"] / 4, mesh, [Partial(), Partial()])
    state = {"a": sw.distribute_tensor(full["a"], mesh, [Shard(0), Shard(1)]),
             "b": sw.distribute_tensor(full["b"], mesh["tp"], [Shard(1)]), "c": partial, "d": full["d"].clone()}
    flat = sw.init_device_mesh("cpu", (4,))
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for name, writer, reader in (("dcp", FileSystemWriter, FileSystemReader),
                                 ("hf", HuggingFaceStorageWriter, HuggingFaceStorageReader)):
        future = checkpoint.async_save(state, storage_writer=writer(os.path.join(path, name)))
        with torch.no_grad():
            for value in state.values():
                (value.to_local() if isinstance(value, sw.DTensor) else value).add_(100)
        future.result(timeout=60)
        with torch.no_grad():
            for value in state.values():
                (value.to_local() if isinstance(value, sw.DTensor) else value).sub_(100)
        target = {k: sw.distribute_tensor(torch.zeros_like(v), flat, [Shard(0)]) for k, v in full.items()}
        checkpoint.load(target, storage_reader=reader(os.path.join(path, name)))
        loaded[name] = {k: v.full_tensor() for k, v in target.items()}
    assert all(torch.equal(got[k], v) for got in loaded.values() for k, v in full.items()), loaded
    return loaded


def test_four_ranks_async_save_in_torch_dcp_and_safetensors_formats(tmp_path: Path) -> None:
    run_distributed(_async_in_both_formats, 4, str(tmp_path), timeout=180)


def _failing_in_the_background(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    state = {"w": sw.distribute_tensor(torch.full((8, 3), 2.0), mesh, [Shard(0)])}
    failing = mock.patch.object(_hf_write, "_write_box", side_effect=OSError("No space left on device"))
    if dist.get_rank() == 1:
        failing.start()
    future = checkpoint.async_save(state, storage_writer=HuggingFaceStorageWriter(path))
    expected = (OSError, "No space left") if dist.get_rank() == 1 else (RuntimeError, "failed on rank 1 while writing "
                                                                                     "the tensors")
    with pytest.raises(expected[0], match=expected[1]):
        future.result(timeout=60)
    if dist.get_rank() == 1:
        failing.stop()
    dist.barrier()  # every rank has heard; rank 0 removed this save's files before raising


def test_a_background_failure_in_safetensors_reaches_every_rank_and_leaves_the_directory_as_it_was(
        tmp_path: Path) -> None:
    checkpoint.save({"w": torch.full((8, 3), 7.0)}, storage_writer=HuggingFaceStorageWriter(tmp_path))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    run_distributed(_failing_in_the_background, 4, str(tmp_path), timeout=120)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # byte for byte, no temporary file left


class _JsonWriter(StorageWriter):
    """A format in a few lines: each rank's pieces in a JSON file of its own, rank 0's index naming them."""

    switching = "writing index.json"

    def __init__(self, path: Path, fail: bool = False) -> None:
        self.path, self.fail = path, fail

    def leaves(self, tree: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        return [(name, (name,), value) for name, value in tree.items()]

    def write(self, save: Save, shares: list[Share]) -> Any:
        name = f"part{save.rank}.{save.generation}.json"
        (save.directory / name).write_text(json.dumps([[s.leaf, s.box, s.value.tolist()] for s in shares]))
        if self.fail:
            raise OSError("No space left on device")
        return name

    def switch(self, save: Save, records: list[Any]) -> None:
        index = {"generation": save.generation, "files": records}
        write_atomically(save.directory / "index.json", lambda f: f.write(json.dumps(index).encode()))

    def switched(self, save: Save) -> bool:
        return bool(json.loads((save.directory / "index.json").read_text())["generation"] == save.generation)

    def generation_of(self, name: str) -> Any:
        found = re.fullmatch(r"part\d+\.([0-9a-f]+)\.json", name)
        return found[1] if found else None


def test_a_format_written_in_a_few_lines_gets_the_transaction_and_async_save(tmp_path: Path) -> None:
    checkpoint.save({"w": torch.arange(3.0)}, storage_writer=_JsonWriter(tmp_path))
    checkpoint.async_save({"w": torch.arange(4.0)}, storage_writer=_JsonWriter(tmp_path)).result(timeout=30)
    names = sorted(os.listdir(tmp_path))
    index = json.loads((tmp_path / "index.json").read_text())
    assert names == sorted(["index.json", *index["files"]]) and len(index["files"]) == 1  # the older part removed
    assert json.loads((tmp_path / index["files"][0]).read_text()) == [[0, [[0, 4]], [0.0, 1.0, 2.0, 3.0]]]
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save({"w": torch.arange(5.0)}, storage_writer=_JsonWriter(tmp_path, fail=True))
    assert sorted(os.listdir(tmp_path)) == names  # its part, written before it failed, removed; the index as it was


def test_format_writers_share_the_transaction_not_each_others_helpers() -> None:
    # Regression (issue 46): the DCP and safetensors writers imported ten private helpers of
    # the native writer's module, and copies of some had drifted apart
    import shardwise.checkpoint as package

    folder = Path(package.__file__).parent
    writers = {"_save": "the native writer", "_dcp_write": "the DCP writer", "_hf_write": "the safetensors writer"}
    for module in writers:
        tree = ast.parse((folder / f"{module}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert not imported & set(writers) - {module}, (module, imported)
        assert "_transaction" not in imported, module  # the transaction calls the writers, never the reverse
