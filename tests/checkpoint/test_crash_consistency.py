"""Kill a rank at any moment of a save over an existing checkpoint: the directory loads the
old state or the new one, exactly, never a mix and never nothing.

Each case saves an old checkpoint, then runs a new save on 4 gloo ranks in which one rank
(`victim`) dies with `os._exit` at one point of the save (`phase`); the survivors' saves
fail (their peer is gone): each must raise a CollectiveError naming the dead rank and saying
truly which checkpoint the directory holds. The directory is then loaded in this process and
compared with both states. Every (rank, phase) kill point is tried once (blocking saves), and
one per phase of an async save; phases after the atomic switch must load the new state, all
others the old.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Shard, checkpoint

from ..dist_helpers import run_own_processes

# phase -> whether the new checkpoint is current once a rank dies there
PHASES = {
    "before_writing": False,  # checks done, nothing written
    "mid_data_file": False,  # half of a temporary data file on disk
    "after_data_file": False,  # this rank's data file in place, others' maybe not
    "mid_metadata": False,  # rank 0: half of the new metadata.json's temporary file
    "after_switch": True,  # rank 0: the new metadata.json renamed into place, cleanup not run
}
RANK0_ONLY = {"mid_metadata", "after_switch"}


def _old() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(24.0).view(8, 3), "b": torch.full((5,), 2.0)}


def _new() -> dict[str, torch.Tensor]:
    return {"w": -torch.arange(24.0).view(8, 3), "b": torch.full((5,), 7.0)}


def _die(*args: Any, **kwargs: Any) -> None:
    os._exit(17)


def _half_then_die(target: Path, write: Any) -> None:
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        f.write(b"\x80\x02half a file")
    os._exit(17)


def _whole_then_die(real: Any) -> Any:
    def wrapped(target: Path, write: Any) -> None:
        real(target, write)
        os._exit(17)
    return wrapped


def _save_and_die(path: str, victim: int, phase: str, asynchronous: bool) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    new = _new()
    state = {"w": sw.distribute_tensor(new["w"], mesh, [Shard(0)]), "b": new["b"]}
    from shardwise.checkpoint import _metadata, _save

    patches: list[Any] = []
    if dist.get_rank() == victim:
        if phase == "before_writing":
            patches.append(mock.patch.object(_save, "_pieces", _die))
        elif phase == "mid_data_file":
            patches.append(mock.patch.object(_save, "write_atomically", _half_then_die))
        elif phase == "after_data_file":
            patches.append(mock.patch.object(_save, "write_atomically", _whole_then_die(_save.write_atomically)))
        elif phase == "mid_metadata":
            patches.append(mock.patch.object(_metadata, "write_atomically", _half_then_die))
        elif phase == "after_switch":
            patches.append(mock.patch.object(_save, "_sync_directory", _die))
    for p in patches:
        p.start()
    if asynchronous:  # the writing (every phase but the first) happens in the background thread
        checkpoint.async_save(state, checkpoint_id=path).result(timeout=60)
    else:
        checkpoint.save(state, checkpoint_id=path)


def _kill_points() -> list[tuple[int, str]]:
    """Every (rank, phase) once."""
    return [(victim, phase) for phase in PHASES for victim in range(4) if phase not in RANK0_ONLY or victim == 0]


# every kill point of a blocking save, then one per phase of an async save (a random rank)
CASES = [(v, p, False) for v, p in _kill_points()] + [
    (0 if phase in RANK0_ONLY else random.Random(phase).randrange(4), phase, True) for phase in PHASES
]


@pytest.mark.parametrize(("victim", "phase", "asynchronous"), CASES)
def test_a_rank_killed_anywhere_in_a_save_leaves_the_old_or_the_new_checkpoint_whole(
    tmp_path: Path, victim: int, phase: str, asynchronous: bool
) -> None:
    directory = tmp_path / "checkpoint"
    checkpoint.save(_old(), checkpoint_id=directory)
    outcomes = run_own_processes(_save_and_die, 4, str(directory), victim, phase, asynchronous, forkserver=True)
    state = {"w": torch.zeros(8, 3), "b": torch.zeros(5)}
    checkpoint.load(state, checkpoint_id=directory)
    expected = _new() if PHASES[phase] else _old()
    for key in state:
        assert torch.equal(state[key], expected[key]), (key, phase, victim)
    # every survivor raised, naming the dead rank and telling the truth about what the directory holds
    assert outcomes[victim] == ("exit code 17", ""), outcomes
    said = "the checkpoint itself is complete" if PHASES[phase] else "still loads the checkpoint it held before"
    for rank in set(range(4)) - {victim}:
        kind, message = outcomes[rank]
        assert kind == "CollectiveError" and said in message and f"rank {victim} died" in message, (rank, outcomes)
    # and the next save that completes cleans what the killed one left
    checkpoint.save(_new(), checkpoint_id=directory)
    assert not list(directory.glob(".*.tmp")) and len(list(directory.glob("rank_*.pt"))) == 1
