"""torchtitan 0.3's own `Trainer` on shardwise (issue 50): `examples/torchtitan_trainer`.

torchtitan is not a dependency of shardwise. The first run installs `torchtitan==0.3.0` (and
`triton`, which it imports unconditionally) into a venv of its own beside the project's
(`.venv-torchtitan`, or `$SHARDWISE_TORCHTITAN_VENV`), which sees the project's packages and
keeps its torch; where that install fails (no index), these tests skip and say why.

On 4 gloo ranks (dp_shard 2 x tp 2) the example trains torchtitan's Llama 3 debug model for 3
steps twice from one seed checkpoint: once with torchtitan's own train spec (torch's DTensor
and FSDP2) and once with the shardwise train spec (`shardwise_spec.py`: shardwise's
tensor-parallel styles and `fully_shard`). Everything else is torchtitan's trainer: its
dataloader and tokenizer, chunked loss, selective activation checkpointing, gradient clipping,
AdamW, DCP checkpointer, metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchtitan_trainer" / "train.py"
VENV = Path(os.environ.get("SHARDWISE_TORCHTITAN_VENV", ROOT / ".venv-torchtitan"))
PACKAGES = ("torchtitan==0.3.0", "triton")
RUN_TIMEOUT = 600


def _torchtitan_python() -> Path:
    """The scratch venv's python, torchtitan installed in it (once)."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".torchtitan-0.3.0-installed"
    if stamp.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True)
    # the project's packages (torch 2.13.0 among them) are visible to it, so pip keeps that torch
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "shardwise-project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pins = VENV / "constraints.txt"
    pins.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    try:
        proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c", str(pins), *PACKAGES],
                              capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"torchtitan could not be installed into {VENV}: pip ran past 900 s")
    if proc.returncode != 0:
        pytest.skip(f"torchtitan could not be installed into {VENV} (pip exit {proc.returncode}): "
                    f"{proc.stderr.strip().splitlines()[-1:]}")
    stamp.touch()
    return python


def _run(python: Path, out: Path, nproc: int, *args: str) -> list[dict[str, Any]]:
    """The example under torchrun; rank 0's logged steps."""
    out.mkdir(parents=True, exist_ok=True)
    record = out / "steps.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(EXAMPLE),
           "--out", str(out), "--record", str(record), *args]
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, timeout=RUN_TIMEOUT)
    if proc.returncode != 0:
        tail = (out / "log.txt").read_text().splitlines()[-40:]
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n" + "\n".join(tail))
    return json.loads(record.read_text()) if record.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = _torchtitan_python()
    root = tmp_path_factory.mktemp("torchtitan")
    _run(python, root / "seed", 1, "--dp-shard", "1", "--tp", "1", "--seed-checkpoint")
    seed = str(root / "seed" / "checkpoint" / "step-0")
    out: dict[str, Any] = {
        "torchtitan": _run(python, root / "torchtitan", 4, "--spec", "torchtitan", "--initial-load", seed),
        "shardwise": _run(python, root / "shardwise", 4, "--spec", "shardwise", "--initial-load", seed,
                          "--save-every", "2"),
    }
    # a second shardwise run resumes from the first one's step-2 checkpoint (model, optimizer,
    # learning-rate schedule, dataloader position: torchtitan's DCP checkpointer)
    resumed = root / "resumed" / "checkpoint"
    resumed.mkdir(parents=True)
    (resumed / "step-2").symlink_to(root / "shardwise" / "checkpoint" / "step-2", target_is_directory=True)
    out["resumed"] = _run(python, root / "resumed", 4, "--spec", "shardwise", "--save-every", "2")
    return out


def test_the_shardwise_spec_trains_like_torchtitans_own(runs: dict[str, Any]) -> None:
    ours, theirs = runs["shardwise"], runs["torchtitan"]
    assert [s["step"] for s in ours] == [s["step"] for s in theirs] == [1, 2, 3]
    assert ours[0]["layout"].startswith("shardwise") and theirs[0]["layout"].startswith("torch"), (ours, theirs)
    for a, b in zip(ours, theirs):
        # float32 on both sides, the same sums split over the same ranks: measured bit-equal
        # losses, and gradient norms 1e-7 apart (each gradient's pieces are laid out apart:
        # torch's FSDP2 over TP strides its dp shards, shardwise splits them in blocks)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (ours, theirs)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (ours, theirs)
    assert ours[-1]["loss"] < ours[0]["loss"]


def test_a_resumed_shardwise_run_equals_the_uninterrupted_one(runs: dict[str, Any]) -> None:
    resumed, full = runs["resumed"], runs["shardwise"]
    assert [s["step"] for s in resumed] == [3]
    assert resumed[0]["loss"] == full[2]["loss"] and resumed[0]["grad_norm"] == full[2]["grad_norm"], (resumed, full)
