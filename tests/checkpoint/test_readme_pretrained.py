"""The README's "Start from a pretrained model" block runs as written, on 4 gloo ranks.

The block is cut out of README.md and executed on every rank in a directory holding
`llama/`, a tiny seeded Llama that transformers' own `save_pretrained` wrote in several
files. Afterwards: transformers' `from_pretrained("llama-tuned/")`, in one process, gives
the same logits as the sharded model the block tuned; and the tuned weights are the
pretrained ones moved by one AdamW step (each at most about lr away, some moved), so a
block that skipped the load, the step or the save fails here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LR = 1e-5  # the block's learning rate


def readme_block() -> str:
    """The first python block of the README section "Start from a pretrained model"."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^#+ Start from a pretrained model\n(.*?)(?=^#)", text, re.M | re.S)
    assert section is not None, "README.md has no section 'Start from a pretrained model'"
    block = re.search(r"```python\n(.*?)```", section.group(1), re.S)
    assert block is not None, "the README section 'Start from a pretrained model' has no python block"
    return block.group(1)


def _probe() -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))


def _run_block(directory: str, code: str) -> torch.Tensor:
    import torch.distributed as dist

    os.chdir(directory)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    names: dict[str, Any] = {"ids": ids}
    exec(compile(code, "README.md (Start from a pretrained model)", "exec"), names)
    with torch.no_grad():
        logits: torch.Tensor = names["model"](input_ids=_probe()).logits
    return logits


def test_the_readme_block_loads_tunes_and_saves_what_transformers_reloads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(tmp_path / "llama",
                                                                                     max_shard_size="100KB")
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) >= 3

    logits = run_distributed(_run_block, 4, str(tmp_path), readme_block(), timeout=300)

    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama-tuned")
    with torch.no_grad():
        want = tuned(input_ids=_probe()).logits
    for rank, got in enumerate(logits):  # the sharded model and transformers' reload of what it saved
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-6), (
            f"rank {rank}: logits differ by up to {float((got - want).abs().max())}")
    before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    after = tuned.state_dict()
    assert set(after) == set(before)
    moved = {k: float((after[k] - before[k]).abs().max()) for k in before}
    assert max(moved.values()) <= 1.5 * LR, {k: v for k, v in moved.items() if v > 1.5 * LR}  # loaded, then one step
    assert sum(v > 0 for v in moved.values()) >= len(moved) // 2, moved  # and the step was saved
