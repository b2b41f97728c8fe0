"""Restarts by torchrun's own agent: `shardwise run --max-restarts` and `shardwise run --ft`.

A rank that dies is restarted by torchrun with its whole launch (its group, under `--ft`).
The restarted ranks must find each other: torchrun's agent keeps one store for all its
attempts, and the new ranks once read their dead predecessors' addresses from it (gloo:
"connection refused", every restart failed). Here a rank kills itself after its world was
made, and the next attempt must make its world and run a collective; under `--ft` the
restarted group must heal from the live one and end equal to it, while the live group
never restarted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank  # every test here launches processes

ROOT = Path(__file__).resolve().parents[2]

_DIES_ONCE = """
import os, signal, time
import torch, torch.distributed as dist
import shardwise as sw

life = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if life == 1 and os.environ["RANK"] == "0":
    time.sleep(10)  # past gloo's connect retries: rank 1 must wait for this attempt's address, not read the last one's
mesh = sw.init_device_mesh("cpu", (2,))
if life == 0 and dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # after the world was made: its addresses are in the agent's store
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"life {life} rank {dist.get_rank()}: sum {total.item():g}", flush=True)
"""


def _shardwise(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_rank_restarted_by_torchrun_makes_its_world_again(tmp_path: Path) -> None:
    script = tmp_path / "dies_once.py"
    script.write_text(_DIES_ONCE)
    done = _shardwise("run", "-n", "2", "--max-restarts", "1", str(script), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert f"life 1 rank {rank}: sum 3" in done.stdout, done.stdout + done.stderr[-3000:]


def test_shardwise_run_ft_restarts_only_the_failed_group_which_heals_from_the_live_one(tmp_path: Path) -> None:
    done = _shardwise("run", "--ft", "--groups", "2", "--max-restarts", "2", "-n", "2",
                      "examples/fault_tolerant_training.py", "--kill", "group1:3", "--hold", str(tmp_path), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = dict(re.findall(r"^(group\d): (10 steps committed .*)$", done.stdout, re.M))
    assert set(found) == {"group0", "group1"}, done.stdout + done.stderr[-3000:]
    # the live group never restarted; the killed one was restarted by torchrun and healed once
    assert "(10 in this life, healed 0 time(s))" in found["group0"], found
    assert "healed 1 time(s)" in found["group1"] and "(10 in this life" not in found["group1"], found
    checksums = {line.rsplit(" ", 1)[1] for line in found.values()}
    assert len(checksums) == 1, found  # the same parameters, bit for bit
    # (the group leaves the quorum, unless torchrun restarts it within the heartbeat timeout: then it is
    # waited for, asks again behind the others and heals in the very step it was killed in)
    assert "group1 heals from group0" in done.stderr, done.stderr[-3000:]
    # each group reports its steps and goodput
    for rid, steps, healed in (("group0", "10", "0"), ("group1", r"\d", "1")):
        assert re.search(rf"\[shardwise.ft {rid} rank 0\] {steps} steps committed and \d+ discarded in [\d.]+ s: "
                         rf"goodput [\d.]+ steps/s; healed {healed} time\(s\)", done.stderr), done.stderr[-3000:]
