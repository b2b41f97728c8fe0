"""Hugging Face safetensors read into shards: `HuggingFaceStorageReader` and `load_pretrained`.

A small seeded Llama is written by transformers' own `save_pretrained` into 4 safetensors
files behind an index, then loaded into differently seeded models laid out by the Megatron
planner on (4,), by a torch-style TP plan on (4,), by `fully_shard` on (4,), by TP x `fully_shard`
on (2, 2), and built on meta, split by TP x fully_shard on
(2, 2) and materialised with `to_empty`: every parameter must equal bitwise what
transformers' `from_pretrained` gives, and each rank must read no more than 1.05x the bytes
of its own pieces (counted by the reader, and in one process checked against the kernel's
count of bytes read, /proc/self/io). GPT-2's fused q|k|v (`c_attn`, split part by part)
and its tied `lm_head` load through `load_pretrained`; a bf16 file fills fp32 parameters;
missing and unexpected keys behave as `load_state_dict(strict=...)`; and every kind of damaged
checkpoint is a ValueError naming the file and the tensor, with the state dict unchanged.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import checkpoint
from shardwise.checkpoint import HuggingFaceStorageReader, load_pretrained
from shardwise.fsdp import fully_shard
from shardwise.parallel import MegatronPlanner, parallelize_module, shard_module
from shardwise.testing import run_distributed

from .conftest import LLAMA

transformers = pytest.importorskip("transformers")

GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)


def _llama(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _gpt2(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _local_bytes(state: dict[str, Any], itemsize: int = 4) -> int:
    return sum((t.to_local() if isinstance(t, sw.DTensor) else t).numel() * itemsize for t in state.values())


def _same_as_from_pretrained(model: Any, path: str, cls: Any) -> None:
    want = cls.from_pretrained(path).state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(_full(got[name]), value), name


def _megatron(model: Any) -> None:
    shard_module(model, MegatronPlanner(), sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))


def _fully_shard(model: Any) -> None:
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _torch_style(model: Any) -> None:
    from ..parallel.test_hf_models import torch_style_plan

    parallelize_module(model, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), torch_style_plan(model))


def _tp_x_fully_shard(model: Any) -> None:
    from ..parallel.test_hf_models import torch_style_plan

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], torch_style_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


LAYOUTS: dict[str, Callable[[Any], None]] = {"megatron-tp4": _megatron, "torch-plan-tp4": _torch_style,
                                             "fully_shard4": _fully_shard, "tp2-x-fully_shard2": _tp_x_fully_shard}


def _load_llama(path: str, layout: str) -> tuple[int, int]:
    model = _llama(1)
    LAYOUTS[layout](model)
    reader = HuggingFaceStorageReader(path)
    state = model.state_dict()
    checkpoint.load(state, storage_reader=reader)
    _same_as_from_pretrained(model, path, transformers.LlamaForCausalLM)
    return reader.bytes_read, _local_bytes(state)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_llama_saved_by_transformers_loads_into_shards_reading_only_each_ranks_pieces(llama_dir: Path,
                                                                                     layout: str) -> None:
    results = run_distributed(_load_llama, 4, str(llama_dir), layout, timeout=300)
    whole = sum(p.numel() * 4 for p in _llama(0).state_dict().values())
    for rank, (read, own) in enumerate(results):
        assert read <= 1.05 * own, (layout, rank, read, own)
    assert max(read for read, _ in results) < whole  # no rank reads the whole model
    print(f"\n{layout}: bytes read per rank {[r for r, _ in results]}, own pieces {[o for _, o in results]}")


def _load_llama_on_meta_two_d(path: str) -> None:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    from ..parallel.test_hf_models import torch_style_plan

    parallelize_module(model, mesh["tp"], torch_style_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    rotary = model.model.rotary_emb.inv_freq
    rotary.fill_(float("nan"))  # what to_empty may leave: no file holds the rotary tables
    assert load_pretrained(model, path) == ([], [])
    _same_as_from_pretrained(model, path, transformers.LlamaForCausalLM)
    want = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).model.rotary_emb.inv_freq
    assert torch.equal(model.model.rotary_emb.inv_freq, want)  # recomputed by the model's own init


def test_a_llama_built_on_meta_split_tp_x_fully_shard_is_filled_by_load_pretrained(llama_dir: Path) -> None:
    run_distributed(_load_llama_on_meta_two_d, 4, str(llama_dir), timeout=300)


def _load_gpt2(path: str) -> None:
    model = _gpt2(1)
    _megatron(model)
    c_attn = model.transformer.h[0].attn.c_attn.weight
    assert "sf=3" in repr(c_attn.placements), c_attn.placements  # q|k|v split part by part
    assert load_pretrained(model, path) == ([], [])
    _same_as_from_pretrained(model, path, transformers.GPT2LMHeadModel)


def test_gpt2_fused_qkv_and_tied_lm_head_load_into_the_megatron_layout(tmp_path: Path) -> None:
    _gpt2(0).save_pretrained(tmp_path)  # lm_head.weight is tied to transformer.wte.weight: not in the file
    run_distributed(_load_gpt2, 4, str(tmp_path), timeout=300)


def test_the_bytes_the_reader_counts_are_the_bytes_the_kernel_read(llama_dir: Path) -> None:
    model = _llama(1)
    reader = HuggingFaceStorageReader(llama_dir)
    reader.read_table()  # headers first: what follows reads tensor bytes only
    before = _rchar()
    checkpoint.load(model.state_dict(), storage_reader=reader)
    read = _rchar() - before
    whole = sum(p.numel() * 4 for p in model.state_dict().values())
    assert reader.bytes_read == whole and whole <= read <= whole + 16384, (reader.bytes_read, read)
    _same_as_from_pretrained(model, str(llama_dir), transformers.LlamaForCausalLM)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_bf16_file_fills_fp32_parameters(tmp_path: Path) -> None:
    saved = _llama(0).to(torch.bfloat16)
    saved.save_pretrained(tmp_path)
    model = _llama(1)
    assert load_pretrained(model, tmp_path) == ([], [])
    for name, value in saved.state_dict().items():
        got = model.state_dict()[name]
        assert got.dtype == torch.float32 and torch.equal(got, value.float()), name


def test_missing_and_unexpected_keys_behave_as_load_state_dict(llama_dir: Path) -> None:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": 3}))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing from the files: 'model\.layers\.2\."):
        load_pretrained(model, llama_dir)
    assert _unchanged(model, before)
    missing, unexpected = load_pretrained(model, llama_dir, strict=False)
    assert missing == [k for k in model.state_dict() if k.startswith("model.layers.2.")] and unexpected == []
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, _llama(0).model.layers[1].mlp.up_proj.weight)
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"in the files but not in the model: 'model\.layers\.1\."):
        load_pretrained(small, llama_dir)
    # load with a reader follows load's (DCP's) rules: keys the state dict does not ask for are skipped
    state = small.state_dict()
    checkpoint.load(state, storage_reader=HuggingFaceStorageReader(llama_dir))
    assert torch.equal(state["lm_head.weight"], _llama(0).lm_head.weight)


def _unchanged(model: Any, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# -- damaged checkpoints -----------------------------------------------------------------------


def _header(file: Path) -> tuple[dict[str, Any], bytes]:
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _rewrite(file: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    header, data = _header(file)
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _file_of(path: Path, name: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


K = "model.layers.0.self_attn.k_proj.weight"
V = "model.layers.0.self_attn.v_proj.weight"


def _truncate(path: Path) -> tuple[Path, str]:
    file = _file_of(path, K)
    header, _ = _header(file)
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 10)
    return file, last


def _lying_offsets(path: Path) -> tuple[Path, str]:
    def edit(h: dict[str, Any]) -> None:
        h[K]["data_offsets"][1] += 4
    _rewrite(_file_of(path, K), edit)
    return _file_of(path, K), K


def _lying_shape(path: Path) -> tuple[Path, str]:
    def edit(h: dict[str, Any]) -> None:
        h[K]["shape"] = [64, 64]
    _rewrite(_file_of(path, K), edit)
    return _file_of(path, K), K


def _lying_dtype(path: Path) -> tuple[Path, str]:
    def edit(h: dict[str, Any]) -> None:
        h[K]["dtype"] = "F16"
    _rewrite(_file_of(path, K), edit)
    return _file_of(path, K), K


def _overlap(path: Path) -> tuple[Path, str]:
    assert _file_of(path, K) == _file_of(path, V)

    def edit(h: dict[str, Any]) -> None:
        h[V]["data_offsets"] = list(h[K]["data_offsets"])  # same size: v claims k's bytes
    _rewrite(_file_of(path, K), edit)
    return _file_of(path, K), "self_attn."


def _missing_file(path: Path) -> tuple[Path, str]:
    file = _file_of(path, K)
    file.unlink()
    return file, K


def _index_lies(path: Path) -> tuple[Path, str]:
    index = path / "model.safetensors.index.json"
    table = json.loads(index.read_text())
    other = next(f for f in table["weight_map"].values() if f != table["weight_map"][K])
    table["weight_map"][K] = other
    index.write_text(json.dumps(table))
    return path / other, K


DAMAGE: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "truncated": _truncate, "lying-offsets": _lying_offsets, "lying-shape": _lying_shape,
    "lying-dtype": _lying_dtype, "overlapping-ranges": _overlap, "missing-shard-file": _missing_file,
    "index-names-the-wrong-file": _index_lies,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_a_value_error_naming_file_and_tensor_and_changes_nothing(
        llama_dir: Path, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "copy"
    shutil.copytree(llama_dir, path)
    file, tensor = DAMAGE[damage](path)
    model = _llama(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for load in (lambda: checkpoint.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(path)),
                 lambda: load_pretrained(model, path)):
        with pytest.raises(ValueError) as raised:
            load()
        message = str(raised.value)
        assert str(file) in message and tensor in message, message
        assert _unchanged(model, before)


def test_runs_of_a_box_are_the_elements_of_the_box_in_order() -> None:
    from shardwise.checkpoint._safetensors import runs

    shape = (3, 4, 5)
    flat = torch.arange(math.prod(shape)).view(shape)
    for box in [((0, 3), (0, 4), (0, 5)), ((1, 2), (0, 4), (0, 5)), ((0, 3), (1, 2), (0, 5)),
                ((0, 3), (0, 4), (2, 3)), ((2, 1), (3, 1), (4, 1)), ((0, 0), (0, 4), (0, 5))]:
        got = [i for start, n in runs(shape, box) for i in range(start, start + n)]
        want = flat[tuple(slice(s, s + n) for s, n in box)].reshape(-1).tolist()
        assert got == want, box
    assert list(runs((), ())) == [(0, 1)]
