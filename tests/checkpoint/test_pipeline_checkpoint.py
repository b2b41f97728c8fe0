"""A pipeline's training state saved and resumed: each rank saves the stages it holds.

A `DistributedPipe`'s ranks hold different parameters (their own stages), so each rank's
state dict has keys of its own; `save` writes each leaf once (the lowest rank holding it)
and `load` gives each rank its own back. An optimizer's state goes flattened (each group's
settings by parameter name); torch's nested form, whose one key lists each rank's own
parameters, is refused by name. Two AdamW steps, a save, a fresh pipe and optimizer
loaded from it, and two more steps equal four uninterrupted steps bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
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


def _resume(path: str, schedule: str) -> int:
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
        checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    if dist.get_rank() == 0:
        assert "'optim.param_groups.0.params.0' is a plain value that differs between ranks [0, 1]" in str(refused.value)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)  # (as torchtitan saves a pipeline's optimizers)
    model_state, optim_state = get_state_dict(first, first_opt, options=flat)
    checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    first.close()
    second, second_opt = make()
    model_state, optim_state = get_state_dict(second, second_opt, options=flat)
    state = {"model": model_state, "optim": optim_state}
    checkpoint.load(state, checkpoint_id=path)
    set_state_dict(second, second_opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=flat)
    _train(second, second_opt, range(2, 4))
    mine = dict(whole.named_parameters())
    for name, p in second.named_parameters():
        assert torch.equal(p, mine[name]), name
    whole.close()
    second.close()
    return len(mine)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_pipeline_saved_by_its_stages_resumes_bit_for_bit(tmp_path: Path, schedule: str) -> None:
    held = run_distributed(_resume, 2, str(tmp_path), schedule, timeout=300)
    assert sum(held) == 8 and min(held) > 0  # 4 stages' weights and biases, each on one rank
