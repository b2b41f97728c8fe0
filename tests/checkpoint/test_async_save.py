"""`async_save`: the files are written while training goes on, with `save`'s guarantees.

The background writer is held at a gate (a patched `write_atomically` that waits for an
event) so that the training really does change the parameters, and run its own
collectives, before anything is written: what loads back must be the state as it was when
`async_save` was called. Failures in the background reach every rank through the future,
and a failure nobody asked about stops the next save or load instead of passing silently.
Kills during an async save are in test_crash_consistency.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Shard, checkpoint
from shardwise.checkpoint import _save
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

from .test_checkpoint import _adamw, _batch, _full, _mlp


class _Gate:
    """`write_atomically` held until `open()` (or 30 s, so a broken test cannot hang)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.real = _save.write_atomically

    def write(self, target: Path, write: Any) -> None:
        assert threading.current_thread() is not threading.main_thread()  # written in the background
        self.event.wait(30)
        self.real(target, write)

    def open(self) -> None:
        self.event.set()


def test_the_state_as_it_was_at_the_call_is_saved_though_it_changes_at_once(tmp_path: Path) -> None:
    gate = _Gate()
    state = {"w": torch.arange(12.0).view(3, 4), "n": torch.tensor(5), "step": 3}
    with mock.patch.object(_save, "write_atomically", gate.write):
        future = checkpoint.async_save(state, checkpoint_id=tmp_path)
        state["w"].add_(100)  # the next optimizer step, before anything is written
        state["n"].fill_(0)
        assert not future.done() and not (tmp_path / "metadata.json").exists()
        gate.open()
        assert future.result(timeout=30) is None
    got = {"w": torch.zeros(3, 4), "n": torch.tensor(0), "step": 0}
    checkpoint.load(got, checkpoint_id=tmp_path)
    assert torch.equal(got["w"], torch.arange(12.0).view(3, 4)) and int(got["n"]) == 5 and got["step"] == 3


def test_load_and_the_next_save_wait_for_an_async_save_in_flight(tmp_path: Path) -> None:
    gate = _Gate()
    with mock.patch.object(_save, "write_atomically", gate.write):
        first = checkpoint.async_save({"w": torch.full((4,), 1.0)}, checkpoint_id=tmp_path)
        threading.Timer(0.3, gate.open).start()
        got = {"w": torch.zeros(4)}
        checkpoint.load(got, checkpoint_id=tmp_path)  # waits: the first save is complete when it reads
    assert first.done() and torch.equal(got["w"], torch.full((4,), 1.0))
    second = checkpoint.async_save({"w": torch.full((4,), 2.0)}, checkpoint_id=tmp_path)
    checkpoint.save({"w": torch.full((4,), 3.0)}, checkpoint_id=tmp_path)  # after the second, never beside it
    assert second.done()
    checkpoint.load(got, checkpoint_id=tmp_path)
    assert torch.equal(got["w"], torch.full((4,), 3.0)) and len(list(tmp_path.glob("rank_*.pt"))) == 1


def _train_while_saving(path: str) -> dict[str, Any]:
    """Two steps, an async save, two more steps (and their collectives) before the files are
    written; then load into a fresh model and optimizer and compare with the state at the call."""
    torch.set_default_dtype(torch.float64)
    mesh = sw.init_device_mesh("cpu", (4,))
    plan = {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()}
    model = parallelize_module(_mlp(0), mesh, plan)
    opt = _adamw(model.parameters())

    def step(k: int) -> None:
        x, y = _batch(k)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()

    for k in range(2):
        step(k)
    at_call = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}  # full_tensor of R is the piece
    moments = {i: _full(s["exp_avg"]).clone() for i, s in opt.state_dict()["state"].items()}
    gate = _Gate()
    with mock.patch.object(_save, "write_atomically", gate.write):
        future = checkpoint.async_save({"model": model, "optim": opt}, checkpoint_id=path)
        step(2)
        gate.open()  # the background agreements now run beside the next step's collectives
        step(3)
        future.result(timeout=60)
    after = {n: _full(p.detach()) for n, p in model.named_parameters()}

    fresh = parallelize_module(_mlp(1), mesh, plan)
    fresh_opt = _adamw(fresh.parameters())
    checkpoint.load({"model": fresh, "optim": fresh_opt}, checkpoint_id=path)
    for name, p in fresh.named_parameters():
        assert torch.equal(_full(p.detach()), at_call[name]) and not torch.equal(at_call[name], after[name]), name
    for i, s in fresh_opt.state_dict()["state"].items():
        assert torch.equal(_full(s["exp_avg"]), moments[i]), i
    return after


def test_four_ranks_train_on_while_the_checkpoint_is_written(tmp_path: Path) -> None:
    # training was not disturbed: every rank ends with the same parameters after 4 steps
    finals = run_distributed(_train_while_saving, 4, str(tmp_path), timeout=120)
    for name in finals[0]:
        assert all(torch.equal(f[name], finals[0][name]) for f in finals), name


def _failing_in_the_background(path: str, asked: bool) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    state = {"w": sw.distribute_tensor(torch.full((8, 3), 2.0), mesh, [Shard(0)])}
    rank = dist.get_rank()
    failing = mock.patch.object(_save, "write_atomically", side_effect=OSError("No space left on device"))
    if rank == 1:
        failing.start()
    future = checkpoint.async_save(state, checkpoint_id=path)
    if asked:
        expected = (OSError, "No space left") if rank == 1 else (RuntimeError, "failed on rank 1 while writing the data files")
        with pytest.raises(expected[0], match=expected[1]):
            future.result(timeout=60)
        assert "still loads the checkpoint it held before" in str(future.exception()) + str(
            getattr(future.exception(), "__notes__", ""))
    else:  # nobody asks: the next save says so, on every rank, and starts nothing
        with pytest.raises(RuntimeError, match="the async_save to .* failed, and its result was never asked for"):
            checkpoint.save(state, checkpoint_id=path)
    if rank == 1:
        failing.stop()
    loaded = {"w": torch.zeros(8, 3)}
    checkpoint.load(loaded, checkpoint_id=path)  # the earlier checkpoint, whole
    assert torch.equal(loaded["w"], torch.full((8, 3), 7.0))
    checkpoint.save(state, checkpoint_id=path)  # and saving works again
    checkpoint.load(loaded, checkpoint_id=path)
    assert torch.equal(loaded["w"], torch.full((8, 3), 2.0))


@pytest.mark.parametrize("asked", [True, False], ids=["result-asked", "never-asked"])
def test_a_background_failure_reaches_every_rank_and_keeps_the_earlier_checkpoint(tmp_path: Path, asked: bool) -> None:
    checkpoint.save({"w": torch.full((8, 3), 7.0)}, checkpoint_id=tmp_path)
    run_distributed(_failing_in_the_background, 4, str(tmp_path), asked, timeout=120)
