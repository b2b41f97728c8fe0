"""The demo: the layout tour, and the training job (each asserts single-device equality itself).

The training job's parity is checked here as the issue asks: the demo GPT trained 5
AdamW steps under TP, DP, DP x TP and DP x TP with sharded parameters, by the built-in
planner's plan and by the hand-written one, against the same training in one process
(losses and final parameters within 1e-5). The commands themselves (`shardwise demo`,
`shardwise run`) run end to end through PyTorch's launcher: the command's entry point
(`shardwise.cli:main`, what the installed `shardwise` runs) in this process, as torchrun's
agent, and every rank a fresh process it starts, as on a user's machine. (An interpreter
of its own for the agent added seconds of `import torch` before any rank started, and
checked nothing the ranks do not.) The 3-D demo runs the module the command launches on
each rank (`shardwise.demo`, with the command's arguments) on an 8-process gloo group.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shardwise._demo.train import DemoConfig, train_reference, train_sharded
from shardwise._demo.tour import run_tour
from shardwise.testing import run_distributed

pytestmark = pytest.mark.multirank  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_on_four_processes_and_reports_from_rank_0() -> None:
    reports = run_distributed(run_tour, 4, timeout=120)
    assert reports[1:] == [[], [], []]
    text = "\n".join(reports[0])
    assert "collectives: none" in text  # (S(0), R) @ (R, S(1)) needs no communication
    assert "['all_to_all'], 4096 B" in text  # S(0) -> S(1): half of what an all_gather moves
    assert "grad of w matches single device" in text


def _train(cfg: DemoConfig) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    result = train_sharded(cfg)
    return result.losses, result.parameters, result.memory


@pytest.mark.parametrize(
    ("mesh", "shard", "plan"),
    [((1, 4), False, "manual"), ((1, 4), False, "planner"), ((4, 1), False, "planner"), ((4, 1), True, "planner"),
     ((2, 2), False, "planner"), ((2, 2), True, "planner"), ((2, 2), True, "manual")],
    ids=["tp4-manual", "tp4-planner", "dp4", "dp4-sharded", "dp2xtp2", "dp2xtp2-sharded", "dp2xtp2-sharded-manual"],
)
def test_demo_gpt_trains_like_one_process(mesh: tuple[int, int], shard: bool, plan: str) -> None:
    # float64: AdamW's g / (sqrt(v) + eps) turns float32 rounding in near-zero gradients into
    # steps of about lr; in float32 one element in 16k ends ~4e-5 off (float64: ~1e-12)
    cfg = DemoConfig(mesh=mesh, steps=5, shard_parameters=shard, plan=plan, dtype=torch.float64)
    runs = run_distributed(_train, 4, cfg, timeout=300)
    models: list[torch.nn.Module] = []
    want = train_reference(cfg, models)
    for losses, params, _ in runs:
        assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-5, (losses, want)
        for name, p in models[0].named_parameters():
            torch.testing.assert_close(params[name], p.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    if shard and mesh == (4, 1):  # ZeRO-3 on 4 ranks: each holds about a quarter
        for _, _, memory in runs:
            assert memory["total"] <= 0.3 * memory["unsharded_total"], memory


# torch 2.13's gloo can abort a process at interpreter exit after the script has finished
# ("terminate called without an active exception", exit -6): plain torch under torchrun does
# it in about half the runs of a script that does not destroy its group. Leaving with a
# barrier and destroy_process_group (the example and the demo do; init_device_mesh does it
# at exit) makes it rare but not impossible here (~1 run in 15), so a run that printed its
# result and then hit exactly that abort is run once more; any other failure fails the test.
_EXIT_ABORT = "terminate called without an active exception"

# what torchrun's agent changes in the process it runs in: the handlers of these signals and
# these environment variables (put back after each command, so the test session is unchanged)
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

Command = Callable[..., tuple[int, str, str]]


@contextlib.contextmanager
def _as_before() -> Iterator[None]:
    """Put back the signal handlers, the environment and the working directory a launcher run
    in this process changed."""
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in _AGENT_SIGNALS}
    env, cwd = dict(os.environ), os.getcwd()
    try:
        yield
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """A TimeoutError in this (the main) thread after `seconds`: torchrun's agent, interrupted,
    stops the ranks it started before the error reaches the test (as a subprocess timeout did)."""
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"the command did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def shardwise(capfd: pytest.CaptureFixture[str]) -> Command:
    """`shardwise(*argv, timeout=...)`: the `shardwise` command with `argv`, from the repository
    root; returns its exit status, then everything the launcher and its ranks wrote to stdout
    and to stderr."""
    from shardwise.cli import main

    def run(*argv: str, timeout: float) -> tuple[int, str, str]:
        capfd.readouterr()  # only this command's output
        with _as_before(), _deadline(timeout):
            os.chdir(ROOT)
            for name in _RANK_ENV:  # this process is the launcher, not a rank
                os.environ.pop(name, None)
            os.environ.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
            code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err

    return run


def _run(shardwise: Command, *args: str, timeout: float = 240) -> str:
    for attempt in range(2):
        code, out, err = shardwise(*args, timeout=timeout)
        if code == 0 or attempt or _EXIT_ABORT not in err + out:
            break
    assert code == 0, out[-3000:] + err[-3000:]
    return out


def test_shardwise_run_launches_an_example_script_on_two_processes(shardwise: Command) -> None:
    out = _run(shardwise, "run", "-n", "2", "examples/tensor_parallel_mlp.py")
    assert "rank 0 of 2: holds (32, 16) of (64, 16); output and gradients equal one process" in out


def test_the_weight_sync_example_moves_the_lower_bound_to_a_disjoint_inference_mesh(shardwise: Command) -> None:
    out = _run(shardwise, "run", "-n", "6", "examples/weight_sync.py")
    for step in range(3):
        for rank in (4, 5):  # each serving rank receives its half of the 8,512 weight bytes, exactly
            assert f"step {step}: rank {rank} received 4256 B of weights (lower bound 4256 B)" in out, out
    assert out.count("the served model's output equals the trained model's: True") == 2, out


@pytest.mark.parametrize("argv", [["run", "--help"], ["run", "-h"], ["run", "-n", "2", "--help"]])
def test_shardwise_run_help_prints_usage_and_torchruns_options(argv: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # regression: `shardwise run --help` said "no script to run" and exited 2. In this process:
    # the command's entry point is what parses (`python -m shardwise.cli` only calls it; the
    # tests above and below call it here too), and an interpreter per case cost 5 s for nothing.
    from shardwise.cli import main

    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("usage: shardwise run -n N") and "--nnodes" in out


def test_shardwise_demo_command_trains_compares_and_draws(shardwise: Command, tmp_path: Path) -> None:
    png = tmp_path / "layout.png"
    out = _run(shardwise, "demo", "--steps", "3", f"--png={png}")
    assert "parity: max |sharded - single process|" in out and ": equal" in out, out
    assert "memory per rank" in out and "blocks.*.attn.q.weight" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _demo_rank(argv: list[str]) -> tuple[int, str]:
    """One rank of `shardwise demo ARGV`: the module the command launches on every process
    (`shardwise.demo`), given the command's arguments; its exit status and what it printed."""
    import argparse
    import io

    from shardwise import demo

    parser = argparse.ArgumentParser(prog="shardwise demo")
    demo.add_arguments(parser)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = demo.main(parser.parse_args(argv))
    return code, printed.getvalue()


def test_the_demo_runs_3d_on_pp_dp_tp_and_prints_the_schedule() -> None:
    # the ranks of `shardwise demo --mesh 2x2x2 --steps 3` on 8 processes of one gloo group
    # (the launch itself is the 2x2 command's above; the 3-D job is what each rank runs)
    ranks = run_distributed(_demo_rank, 8, ["--mesh", "2x2x2", "--steps", "3"], timeout=240)
    assert [code for code, _ in ranks] == [0] * 8, ranks
    out = ranks[0][1]
    assert "CharGPT on a 2 (pp) x 2 (dp) x 2 (tp) mesh of 8 cpu processes" in out, out
    assert "parity: max |sharded - single process|" in out and ": equal" in out, out
    assert "the 1F1B schedule of the 2 pipeline stages" in out and "rank 1 |" in out, out
    # each rank holds about an eighth of the model's parameters, gradients and optimizer state
    ratios = [float(line.split()[-1].rstrip("x")) for line in out.splitlines() if line.strip().endswith("x")
              and line.split()[0].isdigit()]
    assert len(ratios) == 8 and all(r < 0.2 for r in ratios), out


def test_a_rank_failing_in_a_launched_script_ends_the_run_at_once(shardwise: Command, tmp_path: Path) -> None:
    # init_device_mesh registers a barrier and destroy_process_group at exit (see _EXIT_ABORT);
    # a rank failing with an uncaught exception must skip that barrier, so its peer, blocked in
    # a collective, fails at once instead of both waiting for the collective timeout.
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, torch\nimport shardwise as sw\n"
        "mesh = sw.init_device_mesh('cpu', (2,))\n"
        "x = sw.distribute_tensor(torch.ones(4, 4), mesh, [sw.Shard(0)])\n"
        "if os.environ['RANK'] == '1':\n    raise ValueError('rank 1 fails on purpose')\n"
        "x.full_tensor()\n"
    )
    code, out, err = shardwise("run", "-n", "2", str(script), timeout=60)
    assert code != 0 and "fails on purpose" in out + err
