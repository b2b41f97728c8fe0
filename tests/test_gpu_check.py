"""The device check (`scripts/gpu_check.sh`) rehearsed on the CPU, and its isolation of sections.

The script is run on a lent GPU machine once per session, with no chance to fix it there; so
here it runs with `--cpu` (every section but the device tests, which the suite runs itself,
must come back "ok" with numbers in its tables), and its parent is checked to turn a crashing,
failing or hanging section into "failed" and a section left without time into "skipped" while
still writing both summaries.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MUST_BE_OK = ("environment", "demo", "per_op", "llama", "overlap")


@pytest.fixture
def gc(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/gpu_check.py as a module (the parent's side imports no torch: this is cheap)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.multirank  # section 6 runs two gloo processes
def test_cpu_rehearsal_writes_every_section_with_numbers(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    start = time.monotonic()
    # All but the device tests, which this suite runs on its own (nested here they doubled the time),
    # side by side (each section's code is what is rehearsed here; the one-at-a-time order and its
    # per-section limits are the next test's), each allowed the whole budget, far above the 90 s
    # default: a rehearsal on a machine shared with a whole test suite must not fail for time.
    command = ["bash", str(SCRIPT), "--cpu", "--side-by-side", "--budget", "600", "--only", ",".join(MUST_BE_OK),
               str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "summary.md").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert list(sections) == ["environment", "demo", "per_op", "llama", "overlap", "device_tests"]
    assert all(s["status"] in ("ok", "failed", "skipped") for s in sections.values()), sections
    broken = {name: sections[name].get("error") or sections[name].get("reason") for name in MUST_BE_OK
              if sections[name]["status"] != "ok"}
    assert not broken, f"sections not ok on the CPU ({seconds:.0f} s): {broken}"
    assert sections["device_tests"]["status"] in ("ok", "skipped"), sections["device_tests"]  # here: not chosen
    ops = {row["op"]: row for row in sections["per_op"]["rows"]}
    assert {"add", "mm S(0)xR", "softmax", "layer_norm"} <= set(ops)
    for row in ops.values():
        for key in ("plain_us", "shardwise_us", "torch_us"):
            assert isinstance(row[key], float) and row[key] > 0, (row["op"], key, row)
        assert row["check"] == "ok", row
    llama = {row["variant"]: row for row in sections["llama"]["rows"]}
    for variant in ("plain", "shardwise", "shardwise compiled"):
        assert (llama[variant].get("tokens_per_s") or 0) > 0, llama[variant]
        assert llama[variant]["mfu"] is None  # no peak on the CPU
    assert all(row["gathers"] > 0 and row["fraction"] is not None for row in sections["overlap"]["rows"])
    assert (tmp_path / "overlap-trace-rank0.json").exists()
    text = (tmp_path / "summary.md").read_text()
    assert "| layer_norm |" in text and "| shardwise compiled |" in text


def crash(ctx: object) -> dict[str, object]:
    raise ZeroDivisionError("a bug in a section")


def exits(ctx: object) -> dict[str, object]:
    code, out = ctx.launch([sys.executable, "-c", "print('last words'); raise SystemExit(3)"])  # type: ignore[attr-defined]
    return {"status": "ok" if code == 0 else "failed", "error": out}


def hangs(ctx: object) -> dict[str, object]:
    code, out = ctx.launch([sys.executable, "-c", "import time; time.sleep(60)"])  # type: ignore[attr-defined]
    return {"status": "failed" if code is None else "ok", "error": out}


def test_a_crashing_or_hanging_section_is_failed_and_the_rest_still_run(gc: ModuleType, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "SECTIONS", [
        gc.Section("crash", "crashes", {"cpu": 5}, crash),
        gc.Section("exits", "exits 3", {"cpu": 5}, exits),
        gc.Section("hangs", "hangs", {"cpu": 60}, hangs),  # runs until the total budget is spent
        gc.Section("late", "no time left", {"cpu": 5}, exits),
    ])
    monkeypatch.setitem(gc.TOTAL_BUDGET, "cpu", 5.0)
    monkeypatch.setitem(gc.MIN_START, "cpu", 1.0)
    monkeypatch.setenv("GPU_CHECK_CALLER_DIR", str(tmp_path))
    start = time.monotonic()
    assert gc.main(["--cpu", "out"]) == 0
    assert time.monotonic() - start < 30
    sections = json.loads((tmp_path / "out" / "summary.json").read_text())["sections"]
    assert sections["crash"]["status"] == "failed" and "ZeroDivisionError" in sections["crash"]["error"]
    assert sections["exits"]["status"] == "failed" and "last words" in sections["exits"]["error"]
    assert sections["hangs"]["status"] == "failed" and "killed after" in sections["hangs"]["error"]
    assert sections["late"] == {"title": "no time left", "status": "skipped", "reason": "out of time"}
    assert "## 1. crashes: failed" in (tmp_path / "out" / "summary.md").read_text()


def test_side_by_side_sections_all_start_and_each_is_still_isolated(gc: ModuleType, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "SECTIONS", [
        gc.Section("crash", "crashes", {"cpu": 1}, crash),
        gc.Section("hangs", "hangs", {"cpu": 1}, hangs),  # side by side, each may use the whole budget
        gc.Section("exits", "exits 3", {"cpu": 1}, exits),
        gc.Section("unchosen", "not chosen", {"cpu": 1}, exits),
    ])
    monkeypatch.setitem(gc.TOTAL_BUDGET, "cpu", 5.0)
    monkeypatch.setitem(gc.MIN_START, "cpu", 1.0)
    monkeypatch.setenv("GPU_CHECK_CALLER_DIR", str(tmp_path))
    with pytest.raises(SystemExit):  # a device run times one section at a time
        gc.main(["--side-by-side", "out"])
    start = time.monotonic()
    assert gc.main(["--cpu", "--side-by-side", "--only", "crash,hangs,exits", "out"]) == 0
    assert time.monotonic() - start < 30
    sections = json.loads((tmp_path / "out" / "summary.json").read_text())["sections"]
    assert list(sections) == ["crash", "hangs", "exits", "unchosen"]  # the order of SECTIONS, not of finishing
    assert sections["crash"]["status"] == "failed" and "ZeroDivisionError" in sections["crash"]["error"]
    assert sections["exits"]["status"] == "failed" and "last words" in sections["exits"]["error"]
    assert sections["exits"]["seconds"] < sections["hangs"]["seconds"]  # it did not wait for the hanging one
    assert sections["hangs"]["status"] == "failed" and "killed after" in sections["hangs"]["error"]
    assert sections["hangs"]["budget_s"] == 5.0  # the whole budget, not its own 1 s scaled
    assert sections["unchosen"] == {"title": "not chosen", "status": "skipped", "reason": "not chosen (--only)"}
    assert "## 2. hangs: failed" in (tmp_path / "out" / "summary.md").read_text()


def test_trace_overlap_measures_the_gathers_time_covered_by_compute(gc: ModuleType) -> None:
    trace = {"traceEvents": [
        {"ph": "X", "name": "gloo:all_gather", "ts": 0, "dur": 10},
        {"ph": "X", "name": "c10d::_allgather_base_", "ts": 0, "dur": 2},  # nested: counted once
        {"ph": "X", "name": "aten::mm", "ts": 5, "dur": 10},
        {"ph": "X", "name": "aten::add", "ts": 0, "dur": 10},  # not compute that a gather hides behind
    ]}
    got = gc.trace_overlap(trace, "cpu")
    assert (got["gathers"], got["gather_ms"], got["overlapped_ms"], got["fraction"]) == (2, 0.01, 0.005, 0.5)
