"""Pretrained weights into the stages of a pipeline cut from a Hugging Face model.

`hf_sequential(model)` reuses the model's own modules under new names, and `DistributedPipe`
renames them again (`partitions.1.layer1.layer...`); `load_pretrained(pipe, path)` finds each
tensor's name in the model it was cut from. A Llama built on meta is cut into 2 stages, each
split over tp=2 (4 ranks), materialised with `pipe.to_empty`, and filled: every tensor a rank
holds equals transformers' own load bitwise, the rotary tables no file holds are recomputed,
no rank reads more than 1.05x its pieces' bytes, and the pipeline's logits match the loaded
model's, whether the tp styles give DTensor or local outputs. Cut into 4 stages of one layer,
each rank materialises and fills only its own, and `save_pretrained(pipe)` writes each stage's
tensors from its rank under the model's names: transformers loads the directory bit-equal.
GPT-2 over 2 stages puts the embedding on stage 0 and the LM head tied to it on
stage 1: the head is read from the embedding's bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.checkpoint import _hf_read, load_pretrained, save_pretrained
from shardwise.pipeline import DistributedPipe, hf_sequential
from shardwise.testing import run_distributed

from .conftest import LLAMA
from .test_hf_read import _full, _gpt2

transformers = pytest.importorskip("transformers")


class _CountingReader(_hf_read.HuggingFaceStorageReader):
    made: list[_hf_read.HuggingFaceStorageReader] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _CountingReader.made.append(self)


def _held(model: Any, pipe: Any) -> dict[str, torch.Tensor]:
    """The model's tensors this rank's stages hold (the other stages' stay on meta), by the model's names."""
    held = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    assert len(held) == len({id(v) for v in pipe.state_dict().values()}), (sorted(held), sorted(pipe.state_dict()))
    return held


def _llama_pipeline(path: str, local: bool = False) -> int:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    col, row = sw.parallel.ColwiseParallel(use_local_output=local), sw.parallel.RowwiseParallel(use_local_output=local)
    plan = {"layer*.layer.self_attn.[qkv]_proj": col, "layer*.layer.self_attn.o_proj": row,
            "layer*.layer.mlp.[gu]*_proj": col, "layer*.layer.mlp.down_proj": row}
    pipe = DistributedPipe(hf_sequential(model), [2, 2], mesh, tp_plan=plan)
    pipe.to_empty(device="cpu")
    for buffer in pipe.buffers():
        buffer.fill_(float("nan"))  # what to_empty may leave in the rotary tables no file holds
    _CountingReader.made.clear()
    _hf_read.HuggingFaceStorageReader = _CountingReader  # type: ignore[misc]
    try:
        assert load_pretrained(pipe, path) == ([], [])
    finally:
        _hf_read.HuggingFaceStorageReader = _CountingReader.__mro__[1]  # type: ignore[misc]
    want_model = transformers.LlamaForCausalLM.from_pretrained(path)
    want = want_model.state_dict()
    held = _held(model, pipe)
    assert any(isinstance(v, sw.DTensor) and v.to_local().numel() < v.numel() for v in held.values())
    for name, value in held.items():
        assert torch.equal(_full(value), want[name]), name
    for buffer in pipe.buffers():
        assert not buffer.isnan().any()
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    logits = pipe(ids)
    pipe.close()
    if logits is not None:
        torch.testing.assert_close(logits, want_model(ids).logits)
    own = sum((v.to_local() if isinstance(v, sw.DTensor) else v).numel() * 4 for v in held.values())
    read = sum(r.bytes_read for r in _CountingReader.made)
    assert 0 < read <= 1.05 * own, (read, own)
    return read


@pytest.mark.parametrize("local", [False, True], ids=["dtensor-outputs", "local-outputs"])
def test_a_llama_built_on_meta_as_two_tensor_parallel_stages_is_filled_by_load_pretrained(llama_dir: Path,
                                                                                         local: bool) -> None:
    read = run_distributed(_llama_pipeline, 4, str(llama_dir), local, timeout=300)
    whole = sum(v.numel() * 4 for v in transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
                .state_dict().values())
    assert max(read) < whole / 2  # each rank reads a quarter of the model, give or take the embeddings


def _llama_four_stages(path: str, out: str = "") -> int:
    # built on meta, cut into 4 stages: each rank materialises and fills its own stage only
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    pipe = DistributedPipe(hf_sequential(model), [1, 1, 1, 1], sw.init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)),
                           schedule="1f1b", chunks=2)
    pipe.to_empty(device="cpu")
    assert load_pretrained(pipe, path) == ([], [])
    want_model = transformers.LlamaForCausalLM.from_pretrained(path)
    want = want_model.state_dict()
    held = _held(model, pipe)
    for name, value in held.items():
        assert torch.equal(value, want[name]), name
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    logits = pipe(ids)
    save_pretrained(pipe, out)  # each rank writes its stage's tensors, by the model's names
    pipe.close()
    if logits is not None:
        torch.testing.assert_close(logits, want_model(ids).logits)
    return len(held)


def test_a_llama_built_on_meta_as_four_stages_holds_only_its_stage_loads_bit_equal_and_saves_what_transformers_loads(
        llama_dir: Path, tmp_path: Path) -> None:
    held = run_distributed(_llama_four_stages, 4, str(llama_dir), str(tmp_path), timeout=300)
    want = transformers.LlamaForCausalLM.from_pretrained(llama_dir).state_dict()
    assert sum(held) == len(want) and min(held) > 0  # every tensor on exactly one stage
    saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert saved.config.architectures == ["LlamaForCausalLM"]
    for name, value in want.items():
        assert torch.equal(saved.state_dict()[name], value), name


def _gpt2_save(path: str, out: str) -> None:
    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    pipe = DistributedPipe(hf_sequential(model), [2, 2], sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)))
    save_pretrained(pipe, out)
    pipe.close()


def test_a_pipelined_gpt2_saves_its_tied_head_once_and_reloads_in_transformers(tmp_path: Path) -> None:
    _gpt2(0).save_pretrained(tmp_path / "in")
    run_distributed(_gpt2_save, 2, str(tmp_path / "in"), str(tmp_path / "out"), timeout=300)
    want = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "in").state_dict()
    got = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _gpt2_pipeline(path: str) -> None:
    model = _gpt2(1)
    pipe = DistributedPipe(hf_sequential(model), [2, 2], sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)))
    assert load_pretrained(pipe, path) == ([], [])
    want = transformers.GPT2LMHeadModel.from_pretrained(path).state_dict()
    mine = dict(pipe.named_parameters())
    if pipe.pp_rank == 1:  # the head, tied to the embedding stage 0 holds: read from the embedding's bytes
        assert torch.equal(mine["partitions.1.head.lm_head.weight"], want["transformer.wte.weight"])
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight", "transformer.ln_f.weight"):
        value = model.get_parameter(name)
        held = any(value is p for p in mine.values())
        assert held == (name.startswith("transformer.h.0") == (pipe.pp_rank == 0)), name
        if held:
            assert torch.equal(value, want[name]), name
    pipe.close()


def test_gpt2_over_two_stages_reads_the_tied_head_from_the_embedding(tmp_path: Path) -> None:
    _gpt2(0).save_pretrained(tmp_path)  # lm_head.weight is tied to transformer.wte.weight: not in the file
    run_distributed(_gpt2_pipeline, 2, str(tmp_path), timeout=300)
