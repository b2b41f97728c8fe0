"""A pipeline's training state saved and resumed: each rank saves the stages it holds.

A `DistributedPipe`'s ranks hold different parameters (their own stages), so each rank's
state dict has keys of its own; `save` writes each leaf once (the lowest rank holding it)
and `load` gives each rank its own back. An optimizer's state goes flattened (each group's
settings by parameter name); torch's nested form, whose one key lists each rank's own
parameters, is refused by name. Two AdamW steps, a save, a fresh pipe and optimizer
loaded from it, and two more steps equal four uninterrupted steps bit for bit, in shardwise's
format and in torch's DCP format (whose table rank 0 writes from every rank's leaves).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import checkpoint
from shardwise.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from shardwise.pipeline import DistributedPipe
from shardwise.testing import run_distributed

pytestmark = pytest.mark.multirank


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4))).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, generator=g, dtype=torch.float64)


def _train(pipe: DistributedPipe, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        pipe.step(*_batch(step))
        opt.step()


def _save(state: dict[str, Any], path: str, fmt: str) -> None:
    if fmt == "dcp":  # torch's format, whose table rank 0 writes from every rank's leaves
        checkpoint.save(state, storage_writer=checkpoint.FileSystemWriter(path))
    else:
        checkpoint.save(state, checkpoint_id=path)


def _load(state: dict[str, Any], path: str, fmt: str) -> None:
    if fmt == "dcp":
        checkpoint.load(state, storage_reader=checkpoint.FileSystemReader(path))
    else:
        checkpoint.load(state, checkpoint_id=path)


def _resume(path: str, schedule: str, fmt: str) -> int:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))

    def make() -> tuple[DistributedPipe, torch.optim.Optimizer]:
        pipe = DistributedPipe(_model(), [1, 1, 1, 1], mesh, schedule=schedule, chunks=4,
                               loss_fn=torch.nn.functional.mse_loss)
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.05)

    whole, whole_opt = make()
    _train(whole, whole_opt, range(4))
    first, first_opt = make()
    _train(first, first_opt, range(2))
    # torch's nested optimizer state dict lists each group's parameters under one key, a different
    # list on each stage's rank: refused by name, not saved as rank 0's
    model_state, optim_state = get_state_dict(first, first_opt)
    with pytest.raises((ValueError, RuntimeError)) as refused:
        _save({"model": model_state, "optim": optim_state}, path, fmt)
    assert "plain values that differ between the ranks holding them under one name: 'optim.param_groups.0.params" \
           in str(refused.value) and "flatten_optimizer_state_dict=True" in str(refused.value), str(refused.value)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)  # (as torchtitan saves a pipeline's optimizers)
    model_state, optim_state = get_state_dict(first, first_opt, options=flat)
    _save({"model": model_state, "optim": optim_state}, path, fmt)
    first.close()
    second, second_opt = make()
    model_state, optim_state = get_state_dict(second, second_opt, options=flat)
    state = {"model": model_state, "optim": optim_state}
    _load(state, path, fmt)
    set_state_dict(second, second_opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=flat)
    _train(second, second_opt, range(2, 4))
    mine = dict(whole.named_parameters())
    for name, p in second.named_parameters():
        assert torch.equal(p, mine[name]), name
    whole.close()
    second.close()
    return len(mine)


@pytest.mark.parametrize("schedule, fmt", [("interleaved", "native"), ("zbv", "native"), ("zbv", "dcp")])
def test_a_pipeline_saved_by_its_stages_resumes_bit_for_bit(tmp_path: Path, schedule: str, fmt: str) -> None:
    held = run_distributed(_resume, 2, str(tmp_path), schedule, fmt, timeout=300)
    assert sum(held) == 8 and min(held) > 0  # 4 stages' weights and biases, each on one rank


def _one_name_two_shapes(path: str) -> str:
    rank = torch.distributed.get_rank()
    state = {"w": torch.ones(2 + rank), f"own{rank}": torch.zeros(1)}  # different keys, and 'w' of two shapes
    with pytest.raises(ValueError) as refused:
        checkpoint.save(state, storage_writer=checkpoint.FileSystemWriter(path))
    return str(refused.value)


def test_a_name_two_ranks_hold_with_different_shapes_is_refused_on_every_rank(tmp_path: Path) -> None:
    for message in run_distributed(_one_name_two_shapes, 2, str(tmp_path), timeout=120):
        assert "the ranks' state dicts hold one name with different shapes, dtypes or layouts:\n  - 'w' is a plain " \
               "tensor of shape (2,) and dtype torch.float32 on rank 0 but a plain tensor of shape (3,) and dtype " \
               "torch.float32 on rank 1" in message, message
    assert not (tmp_path / ".metadata").exists()
