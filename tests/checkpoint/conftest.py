"""A small seeded Llama saved by transformers' own `save_pretrained` in 4 safetensors files
behind an index, shared by the tests that read Hugging Face checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) >= 3 and (path / "model.safetensors.index.json").is_file()
    return path
