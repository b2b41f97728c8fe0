"""The demo job runs and reports (it asserts single-device equality itself)."""

from __future__ import annotations

from shardwise.demo import run_demo
from shardwise.testing import run_distributed


def test_demo_runs_on_four_processes_and_reports_from_rank_0() -> None:
    reports = run_distributed(run_demo, 4, timeout=120)
    assert reports[1:] == [[], [], []]
    text = "\n".join(reports[0])
    assert "collectives: none" in text  # (S(0), R) @ (R, S(1)) needs no communication
    assert "['all_to_all'], 4096 B" in text  # S(0) -> S(1): half of what an all_gather moves
    assert "grad of w matches single device" in text
