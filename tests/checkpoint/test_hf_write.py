"""Hugging Face safetensors written from shards: transformers' `from_pretrained` and safetensors' `safe_open` read them.

A small Llama sharded on a (2, 2) mesh (tensor parallel on "tp", `fully_shard` on "dp": 2-D
and strided layouts, and embeddings on the dp sub-mesh, held twice over tp) is saved with
`save_pretrained` into several files; transformers loads the directory in this process and
its logits equal the sharded model's, every tensor bitwise its `full_tensor()`. Also: a
bfloat16 model with tied embeddings; uneven shapes (vocab 130 over 4 ranks, Shard(1) pieces
written row by row); a save that fails midway on one rank fails on every rank and leaves
the previous directory byte for byte; a switch cut short is finished by `finish_switch`.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import shardwise as sw
from shardwise import checkpoint
from shardwise.checkpoint._hf_write import HuggingFaceStorageWriter, finish_switch
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))


def _llama(vocab: int = 128, dtype: torch.dtype = torch.float64, tied: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, sw.DTensor) else t).detach()


def _save_2x2(path: str, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the sharded model's logits, the full value of each state dict entry)."""
    from shardwise.fsdp import fully_shard
    from shardwise.parallel import parallelize_module

    from ..parallel.test_hf_models import torch_style_plan

    model = _llama()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], torch_style_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {str(p.placements) for p in model.parameters()}
    assert len(placements) > 1, placements  # several layouts, 2-D ones among them
    with torch.no_grad():
        logits = _full(model(input_ids=IDS).logits)
    model.save_pretrained(path, max_shard_size="100KB")
    return logits, {k: _full(v) for k, v in model.state_dict().items()}


def _check_directory(path: Path, full: dict[str, torch.Tensor], logits: torch.Tensor, atol: float) -> Any:
    """Every file reads with safe_open, from_pretrained loads the tensors bitwise and the logits."""
    from safetensors import safe_open

    names = sorted(os.listdir(path))
    assert not [n for n in names if n.startswith(".")], names  # no temporary file, no journal left
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [n for n in names if n.endswith(".safetensors")], (files, names)
    seen = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                seen[key] = f.get_tensor(key)
    assert set(seen) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in seen.values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    state = loaded.state_dict()
    for key, want in full.items():
        assert state[key].dtype == want.dtype and torch.equal(state[key], want), key
    with torch.no_grad():
        got = loaded(input_ids=IDS).logits
    torch.testing.assert_close(got, logits, atol=atol, rtol=0)
    return files


def test_save_pretrained_from_a_2x2_mesh_loads_with_from_pretrained_and_gives_the_sharded_models_logits(
        tmp_path: Path) -> None:
    logits, full = run_distributed(_save_2x2, 4, str(tmp_path), timeout=180)[0]
    files = _check_directory(tmp_path, full, logits, atol=1e-12)
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float64"
    assert (tmp_path / "generation_config.json").exists()


def _save_bf16_tied(path: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from shardwise.parallel import data_parallel, parallelize_module

    from ..parallel.test_hf_models import torch_style_plan

    model = _llama(dtype=torch.bfloat16, tied=True)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], torch_style_plan(model))
    data_parallel(model, mesh, dp_dim="dp")  # replicated over dp: one replica of each piece is written
    with torch.no_grad():
        logits = _full(model(input_ids=IDS).logits)
    checkpoint.save_pretrained(model, path, max_shard_size=40_000)
    return logits, {k: _full(v) for k, v in model.state_dict().items()}


def test_a_bfloat16_model_with_tied_embeddings_is_written_once_and_loads_bitwise(tmp_path: Path) -> None:
    logits, full = run_distributed(_save_bf16_tied, 4, str(tmp_path), timeout=180)[0]
    _check_directory(tmp_path, full, logits, atol=1e-2)  # tensors bitwise; logits to bf16 rounding (sums split by tp)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and loaded.dtype == torch.bfloat16


def _save_uneven(path: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    from shardwise.parallel import MegatronPlanner, shard_module

    model = _llama(vocab=130)
    shard_module(model, MegatronPlanner(), sw.init_device_mesh("cpu", (4,)))
    embed = model.model.embed_tokens.weight
    layouts = [str(model.model.layers[0].self_attn.o_proj.weight.placements)]
    if isinstance(embed, sw.DTensor):
        layouts.append(f"{embed.placements} {tuple(embed.to_local().shape)}")
    with torch.no_grad():
        logits = _full(model(input_ids=IDS).logits)
    checkpoint.save_pretrained(model, path, max_shard_size="60KB")
    return logits, {k: _full(v) for k, v in model.state_dict().items()}, layouts


def test_uneven_pieces_and_pieces_split_along_rows_are_written_byte_exact(tmp_path: Path) -> None:
    results = run_distributed(_save_uneven, 4, str(tmp_path), timeout=180)
    logits, full, layouts = results[0]
    assert layouts[0] == "(Shard(dim=1),)", layouts  # o_proj: each rank's piece is a column block, written row by row
    assert [r[2][1].split(" ", 1)[1] for r in results if len(r[2]) > 1] in ([], ["(33, 64)", "(33, 64)", "(33, 64)",
                                                                                  "(31, 64)"])  # torch.chunk's split, [r[2] for r in results]
    _check_directory(tmp_path, full, logits, atol=1e-12)


def _save_failing_midway(path: str) -> None:
    import torch.distributed as dist

    from shardwise.checkpoint import _hf_write

    calls = [0]
    real = _hf_write._pwrite_all

    def fail_after_some(fd: int, data: Any, offset: int) -> None:
        calls[0] += 1
        if calls[0] > 5:
            raise OSError("No space left on device")
        real(fd, data, offset)

    if dist.get_rank() == 1:
        with mock.patch.object(_hf_write, "_pwrite_all", fail_after_some):
            with pytest.raises(OSError, match="No space left"):
                _save_2x2(path, scale=0.5)
        assert calls[0] > 5  # it failed midway: some of its bytes were written
    else:
        with pytest.raises(RuntimeError, match="failed on rank 1 while writing the tensors"):
            _save_2x2(path, scale=0.5)


def test_a_save_that_fails_midway_on_one_rank_fails_everywhere_and_leaves_the_previous_directory_whole(
        tmp_path: Path) -> None:
    logits, full = run_distributed(_save_2x2, 4, str(tmp_path), timeout=180)[0]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    run_distributed(_save_failing_midway, 4, str(tmp_path), timeout=180)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # byte for byte, no temporary file left
    _check_directory(tmp_path, full, logits, atol=1e-12)


def test_a_switch_cut_short_is_finished_from_its_journal(tmp_path: Path) -> None:
    old = {"a": torch.zeros(50), "b": torch.zeros(50)}
    new = {"a": torch.ones(50), "b": torch.full((50,), 2.0)}
    checkpoint.save(old, storage_writer=HuggingFaceStorageWriter(tmp_path, max_shard_size=200))
    real, calls = os.replace, [0]

    def die_after_one(src: Any, dst: Any) -> None:
        calls[0] += 1
        if calls[0] > 1:
            raise KeyboardInterrupt  # rank 0 killed between two renames
        real(src, dst)

    with mock.patch("shardwise.checkpoint._hf_write.os.replace", die_after_one), pytest.raises(KeyboardInterrupt):
        checkpoint.save(new, storage_writer=HuggingFaceStorageWriter(tmp_path, max_shard_size=200))
    assert (tmp_path / ".shardwise-switch.json").exists()
    assert not (tmp_path / "model.safetensors.index.json").exists()  # same names: the old index was retired first
    finish_switch(tmp_path)
    from safetensors.torch import load_file

    got = {**load_file(tmp_path / "model-00001-of-00002.safetensors"),
           **load_file(tmp_path / "model-00002-of-00002.safetensors")}
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                            "model.safetensors.index.json"]
    assert all(torch.equal(got[k], v) for k, v in new.items())


def test_one_file_replaces_several_and_the_stale_shards_and_index_go() -> None:
    import tempfile

    path = Path(tempfile.mkdtemp())
    state = {"a": torch.arange(60.0), "b": torch.arange(7, dtype=torch.int64)}
    checkpoint.save(state, storage_writer=HuggingFaceStorageWriter(path, max_shard_size=100))
    assert len(os.listdir(path)) == 3
    checkpoint.save(copy.deepcopy(state), storage_writer=HuggingFaceStorageWriter(path))
    assert os.listdir(path) == ["model.safetensors"]
    with pytest.raises(TypeError, match="holds tensors only"):
        checkpoint.save({"a": torch.ones(2), "step": 3}, storage_writer=HuggingFaceStorageWriter(path))
    with pytest.raises(ValueError, match="max_shard_size must be"):
        HuggingFaceStorageWriter(path, max_shard_size="5 parsecs")
    assert os.listdir(path) == ["model.safetensors"]
