"""The multi-rank harness: results per rank, failures that name the rank, pools that recover."""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise.testing
from shardwise.testing import DistributedTestError, RankFailure, default_timeout, distributed, run_distributed

# --- bodies: module level, so the workers import them by name ------------------------


def _pid() -> int:
    return os.getpid()


def _make_groups(n: int) -> int:
    groups = [dist.new_group([0, 1]) for _ in range(n)]  # kept: a test's meshes keep theirs too
    for g in groups:
        dist.barrier(group=g)
    _KEPT.extend(groups)
    return os.getpid()


_KEPT: list[object] = []


def _all_reduce_rank(scale: float) -> tuple[int, int, list[float]]:
    t = torch.full((2,), dist.get_rank() * scale)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.tolist()


def _rank_2_raises() -> None:
    if dist.get_rank() == 2:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(1))


def _rank_1_exits_mid_collective() -> None:
    work = dist.all_reduce(torch.ones(1), async_op=True)
    if dist.get_rank() == 1:
        os._exit(3)
    assert work is not None
    work.wait()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _mess_up_process_state() -> None:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)
    os.environ["SHARDWISE_HARNESS_PROBE"] = "set by a body"
    os.chdir("/")


def _process_state() -> tuple[int, torch.dtype, float, bool, bool, str]:
    probe_set = "SHARDWISE_HARNESS_PROBE" in os.environ
    return os.getpid(), torch.get_default_dtype(), torch.rand(()).item(), torch.is_grad_enabled(), probe_set, os.getcwd()


def _assert_rank_is_0() -> None:
    rank = dist.get_rank()
    assert rank == 0


def _rank_0_issues_an_extra_collective() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)


def _destroy_default_group() -> None:
    dist.destroy_process_group()


# --- run_distributed ------------------------------------------------------------------


def test_all_reduce_on_4_ranks_returns_each_ranks_value() -> None:
    results = run_distributed(_all_reduce_rank, 4, 0.5)
    assert results == [(rank, 4, [3.0, 3.0]) for rank in range(4)]  # 0.5 * (0 + 1 + 2 + 3)


@pytest.mark.parametrize("world_size", [1, 2])
def test_small_world_sizes(world_size: int) -> None:
    results = run_distributed(_all_reduce_rank, world_size, scale=2.0)
    total = 2.0 * sum(range(world_size))
    assert results == [(rank, world_size, [total, total]) for rank in range(world_size)]


def test_pool_is_kept_across_runs() -> None:
    assert run_distributed(_pid, 2) == run_distributed(_pid, 2)


def test_sys_path_added_after_the_pool_started_reaches_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_distributed(_pid, 2)  # the pool exists before the path does
    (tmp_path / "late_path_probe.py").write_text("def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_path_probe", raising=False)
    probe = importlib.import_module("late_path_probe")
    assert run_distributed(probe.answer, 2) == [42, 42]


def test_each_run_starts_from_the_state_of_a_fresh_worker() -> None:
    before = run_distributed(_process_state, 2)
    run_distributed(_mess_up_process_state, 2)
    after = run_distributed(_process_state, 2)
    assert after == before  # same processes, same default dtype, RNG draw, grad mode, env, cwd
    _, dtype, _, grad_enabled, probe_set, _ = before[0]
    assert (dtype, grad_enabled, probe_set) == (torch.float32, True, False)


# --- failures -------------------------------------------------------------------------


def test_rank_that_raises_fails_the_run_fast_and_names_the_rank() -> None:
    before = run_distributed(_pid, 4)
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_2_raises, 4, timeout=20.0)
    elapsed = time.monotonic() - start
    # Ranks 0, 1 and 3 wait in all_reduce until their 30 s collective timeout; the
    # harness must not wait for that, nor for its own 20 s deadline.
    assert elapsed < 19.0, elapsed  # well under the 20 s deadline, even on a loaded machine
    message = str(info.value)
    assert info.value.ranks == (2, 0, 1, 3)
    assert message.startswith("_rank_2_raises failed on 4 of 4 ranks: rank 2 raised ValueError: boom; ")
    assert "ranks 0, 1, 3 still running 1 s after rank 2 failed" in message
    assert 'raise ValueError("boom")' in message  # rank 2's remote traceback
    stuck = message.split("--- ranks 0, 1, 3 still running 1 s after rank 2 failed ---")[1]
    assert " in all_reduce" in stuck and " in _rank_2_raises" in stuck  # where they were stuck
    after = run_distributed(_pid, 4)
    assert not set(before) & set(after), "the pool should have been replaced"


def test_rank_that_exits_mid_collective_is_named_with_its_exit_code() -> None:
    before = run_distributed(_pid, 4)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_1_exits_mid_collective, 4, timeout=20.0)
    assert info.value.ranks[0] == 1
    assert "rank 1 exited with code 3" in str(info.value)
    after = run_distributed(_pid, 4)
    assert not set(before) & set(after), "the pool should have been replaced"


def _start_comm_worker() -> int:
    import shardwise._comm as comm

    return comm.run_async(lambda: 1).result()  # a background thread, as a redistribute(async_op=True) leaves


def test_ranks_past_the_timeout_are_named_with_where_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    # the workers hold a second thread: the stacks were read before the body's thread was written
    before = run_distributed(_pid, 2)
    assert run_distributed(_start_comm_worker, 2) == [1, 1]
    start = time.monotonic()
    with monkeypatch.context() as env, pytest.raises(DistributedTestError) as info:
        env.setenv("SHARDWISE_TEST_TIMEOUT", "3")  # the default timeout, as on a CI box
        run_distributed(_sleep, 2, 60.0)
    elapsed = time.monotonic() - start
    # stack dumps take up to 1 s and killing up to 4 s; a loaded machine may take longer, but never the
    # 60 s the body asked for
    assert 3.0 <= elapsed < 45.0, elapsed
    message = str(info.value)
    assert info.value.ranks == (0, 1)
    assert message.startswith("_sleep failed on 2 of 2 ranks: ranks 0, 1 did not finish within 3 s")
    # one stack for both ranks, or one each where they were caught in different lines of the body
    heads = re.findall(r"--- ranks? ([\d, ]+) did not finish within 3 s ---", message)
    stacks = re.split(r"--- ranks? [\d, ]+ did not finish within 3 s ---", message)[1:]
    assert sorted(int(r) for h in heads for r in h.split(", ")) == [0, 1], heads
    assert all(" in _sleep" in s and "_worker.py" not in s for s in stacks), stacks  # the body, not the harness
    after = run_distributed(_pid, 2)
    assert not set(before) & set(after), "the pool should have been replaced"


def test_failed_asserts_in_test_modules_show_values_as_under_pytest() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_assert_rank_is_0, 2)
    assert "rank 1 raised AssertionError: assert 1 == 0" in str(info.value)


def test_ranks_out_of_step_get_a_warning_and_a_fresh_pool() -> None:
    before = run_distributed(_pid, 2)
    with pytest.warns(RuntimeWarning, match=r"different numbers of collectives \(group '0': rank 0 issued 1, rank 1 issued 0\)"):
        run_distributed(_rank_0_issues_an_extra_collective, 2)
    after = run_distributed(_pid, 2)
    assert not set(before) & set(after), "the pool should have been replaced"


def test_workers_that_hold_many_threads_are_replaced_before_the_next_run() -> None:
    # every gloo group keeps threads that wake up on their own; past WORN_THREADS the pool goes
    shardwise.testing.shutdown_pools()  # (from fresh workers: earlier tests' groups count too)
    before = run_distributed(_pid, 2)
    assert run_distributed(_make_groups, 2, 4) == before  # a few groups: the same workers go on
    assert run_distributed(_pid, 2) == before
    assert run_distributed(_make_groups, 2, 50) == before  # 50 groups: 150 threads more, worn ...
    after = run_distributed(_all_reduce_rank, 2, 1.0)  # ... so the next run has fresh workers
    assert after == [(0, 2, [1.0, 1.0]), (1, 2, [1.0, 1.0])]
    assert not set(before) & set(run_distributed(_pid, 2))


def test_body_that_destroys_the_default_group_gets_a_fresh_pool() -> None:
    before = run_distributed(_pid, 2)
    run_distributed(_destroy_default_group, 2)
    after = run_distributed(_all_reduce_rank, 2, 1.0)
    assert after == [(0, 2, [1.0, 1.0]), (1, 2, [1.0, 1.0])]
    assert not set(before) & set(run_distributed(_pid, 2))


# --- @distributed ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@distributed(world_size=2)
def test_distributed_decorator_with_parametrize(n: int) -> None:
    t = torch.full((2,), float(dist.get_rank() + n))
    dist.all_reduce(t)
    assert t.tolist() == [2.0 * n + 1, 2.0 * n + 1]


@distributed(world_size=4)
def _record_rank(n: int, directory: Path) -> None:
    (directory / f"rank{dist.get_rank()}-n{n}").touch()


@pytest.mark.parametrize("n", [1, 3])
def test_distributed_decorator_runs_the_original_body_on_every_rank(n: int, tmp_path: Path) -> None:
    assert _record_rank(n, directory=tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}-n{n}" for r in range(4)]


@distributed(world_size=2, timeout=20.0)
def _rank_1_disagrees() -> None:
    assert dist.get_rank() != 1, "rank 1 disagrees"


def test_distributed_decorator_fails_like_run_distributed() -> None:
    with pytest.raises(DistributedTestError, match="rank 1 raised AssertionError: rank 1 disagrees"):
        _rank_1_disagrees()


# --- the error, without processes ----------------------------------------------------


def test_error_names_alike_ranks_once_and_pickles() -> None:
    failures = [
        RankFailure(3, "exited with code 3"),
        RankFailure(2, "raised ValueError: x", "remote traceback"),
        RankFailure(0, "raised ValueError: x", "remote traceback"),
    ]
    error = DistributedTestError("body", 4, failures)
    lines = str(error).splitlines()
    assert lines[0] == "body failed on 3 of 4 ranks: rank 3 exited with code 3; ranks 0, 2 raised ValueError: x"
    assert lines[1:] == ["", "--- ranks 0, 2 raised ValueError: x ---", "remote traceback"]
    assert error.ranks == (3, 2, 0)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


# --- bad input ------------------------------------------------------------------------


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        run_distributed(lambda: 0, 2)
    with pytest.raises(ValueError, match="world_size=0 must be at least 1"):
        run_distributed(_pid, 0)
    with pytest.raises(ValueError, match="timeout=-1 must be a positive number"):
        run_distributed(_pid, 2, timeout=-1)
    with pytest.raises(TypeError, match=r"write @distributed\(\)"):
        distributed(_pid)  # type: ignore[arg-type]

    def nested() -> None:
        pass

    with pytest.raises(TypeError, match="needs a module-level function"):
        distributed()(nested)


def test_timeout_env_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDWISE_TEST_TIMEOUT", raising=False)
    assert default_timeout() == 60.0
    monkeypatch.setenv("SHARDWISE_TEST_TIMEOUT", "90")
    assert default_timeout() == 90.0
    monkeypatch.setenv("SHARDWISE_TEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SHARDWISE_TEST_TIMEOUT='soon' is not a positive number of seconds"):
        default_timeout()


def test_public_surface() -> None:
    assert sorted(shardwise.testing.__all__) == [
        "DistributedTestError",
        "RankFailure",
        "default_timeout",
        "distributed",
        "run_distributed",
        "shutdown_pools",
    ]


def test_a_group_that_keeps_no_sequence_number_is_left_out_of_the_collective_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # regression: a body that left torchtitan's "fake" groups alive failed after it finished:
    # "ProcessGroup custom does not yet support sequence numbers"
    from torch.distributed import distributed_c10d as c10d

    from shardwise.testing import _worker

    class Group:
        def __init__(self, name: str, count: int | None) -> None:
            self.group_name, self.count = name, count

        def _get_sequence_number_for_group(self) -> int:
            if self.count is None:
                raise RuntimeError("ProcessGroup custom does not yet support sequence numbers")
            return self.count

    class World:
        pg_map = {Group("gloo", 7): None, Group("fake", None): None}

    monkeypatch.setattr(c10d, "_world", World())
    assert _worker._collective_counts() == {"gloo": 7}
