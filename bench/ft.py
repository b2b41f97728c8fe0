"""Fault tolerance across replica groups: kills, hangs and refused connections mid-run, recovery, goodput and overhead, shardwise.ft beside torchft.

The failure run: G replica groups of N ranks (`fully_shard` inside each group when N > 1),
a float64 MLP, trained for S committed steps while the bench injects F failures, these kinds
in turn (`_ft_run.FailureRun`): SIGKILL of a random process of a random group (the group's
other processes are ended and the group started again alone, as `shardwise run --ft` does);
SIGSTOP of a random process for a second past the fault-tolerance timeout, then SIGCONT (a hung
member: the others must notice it within the timeout and go on, and the group heal when it
wakes); the lighthouse SIGKILLed and started again on its port a second later (meanwhile
every connection to it is refused). A kill or hang never takes the last healthy group. Each
row checks that no committed step was lost (none missing, none committed again after a later
one: no global restart), that every group ended at step S, and that every group's final
parameters are equal bit for bit.

Columns: committed steps; discarded step attempts (a group's step that did not commit);
failures injected, by kind; goodput (committed steps per wall second, first step to last);
recovery from a kill (kill -> the restarted group's first committed step, seconds and steps
committed meanwhile; the next life is a hot spare, see `_ft_run`); "rejoin" (steps the others
committed while the restarted group, ready, waited to be let in: the issue's "back within 2
steps"); the state transfer alone; a hang: the longest step attempt of the others that it
failed (the timeout noticing it) and the hung group's next commit; a refusal: the first commit
after the lighthouse died; the survivors' step time in a quorum where a group heals over
their normal step; and the healthy-step overhead: a run without failures, ft on, against
plain HSDP (one world of G x N processes, `fully_shard` on a (G, N) replicate x shard mesh).

torchft 0.2 runs the same job from a scratch environment when `/tmp/torchft-env` has it
(`_ft_torchft.py`, its own processes and lighthouse), in groups of one rank: its HSDP
(`ft_init_device_mesh`) is not tried here. torchft is never a dependency of shardwise.

Sizes: `FT_STEPS`, `FT_FAILURES`, `FT_GROUPS`, `FT_RANKS`, `FT_HEALTHY` (steps of the healthy
runs) in the environment override the full run's 1,000 steps, 50 failures, 3 groups of 2,
200 healthy steps (the quick run: 40 steps, 3 failures, 2 groups of 1, no HSDP baseline);
`FT_KEEP=1` keeps the run's folder (logs, per-step events) and names it in a note.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from ._common import Column, Settings, Table, ratio
from ._ft_run import FailureRun, free_port, summarize

__all__ = ["run"]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 5.0  # the fault-tolerance timeout of the groups (a hang lasts a second longer)
KINDS = ("kill", "hang", "kill", "refuse")  # the failures injected, in turn (`_ft_run`)
TORCHFT_ENV = Path(os.environ.get("FT_TORCHFT_ENV", "/tmp/torchft-env"))
TORCHFT_HOWTO = (f"python3 -m venv {TORCHFT_ENV} && {TORCHFT_ENV}/bin/pip install torch==2.13.0 torchft==0.2.0")


def _sizes(settings: Settings) -> dict[str, int]:
    base = (dict(steps=40, failures=3, groups=2, ranks=1, healthy=20) if settings.quick
            else dict(steps=1000, failures=50, groups=3, ranks=2, healthy=200))
    for key in base:
        if f"FT_{key.upper()}" in os.environ:
            base[key] = int(os.environ[f"FT_{key.upper()}"])
    return base


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _shardwise(out: Path, groups: list[str], ranks: int, steps: int, failures: int, deadline: float,
               pace: float = 0.0, kinds: tuple[str, ...] = KINDS) -> tuple[dict[str, Any], FailureRun]:
    import subprocess

    port = free_port()
    address = f"127.0.0.1:{port}"

    def lighthouse(n: int) -> subprocess.Popen[bytes]:  # in a process of its own: a refusal kills it
        cfg = {"mode": "lighthouse", "port": port, "log": str(out / "lighthouse.log"),
               "go": str(out / f"go.lighthouse.{n}") if n else ""}
        return subprocess.Popen([sys.executable, "-m", "bench._ft_worker", json.dumps(cfg)], env=_env({}),
                                stdout=subprocess.DEVNULL, stderr=open(out / "lighthouse.err", "ab"))

    def command(group: str, life: int, rank: int, port: int) -> tuple[list[str], dict[str, str]]:
        cfg = {"mode": "ft", "out": str(out), "rid": group, "life": life, "lighthouse": address,
               "groups": groups, "steps": steps, "batch": 8 * len(groups) * ranks, "timeout": TIMEOUT, "pace": pace}
        return [sys.executable, "-m", "bench._ft_worker", json.dumps(cfg)], _env(
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(ranks)})

    fr = FailureRun(out, groups, ranks, steps, failures, command, deadline_s=deadline, kinds=kinds,
                    lighthouse=lighthouse, hang_s=TIMEOUT + 1.0)
    fr.run()
    return summarize(out, groups, steps, fr.kills), fr


def _torchft(out: Path, groups: list[str], steps: int, failures: int, deadline: float,
             pace: float = 0.0) -> tuple[dict[str, Any], FailureRun]:
    import subprocess

    python = str(TORCHFT_ENV / "bin" / "python")
    port = free_port()
    house = subprocess.Popen([python, str(ROOT / "bench" / "_ft_torchft.py"),
                              json.dumps({"mode": "lighthouse", "port": port})],
                             stdout=open(out / "lighthouse.log", "wb"), stderr=subprocess.STDOUT, env=_env({}))
    try:
        def command(group: str, life: int, rank: int, store_port: int) -> tuple[list[str], dict[str, str]]:
            cfg = {"mode": "ft", "out": str(out), "rid": group, "life": life, "lighthouse": f"http://127.0.0.1:{port}",
                   "groups": groups, "steps": steps, "batch": 8 * len(groups), "timeout": TIMEOUT, "pace": pace}
            return [python, str(ROOT / "bench" / "_ft_torchft.py"), json.dumps(cfg)], _env(
                {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port), "RANK": str(rank), "WORLD_SIZE": "1"})

        fr = FailureRun(out, groups, 1, steps, failures, command, deadline_s=deadline, kinds=("kill",))
        fr.run()
    finally:
        house.kill()
        house.wait()
    return summarize(out, groups, steps, fr.kills), fr


def _hsdp(out: Path, groups: int, ranks: int, steps: int) -> Optional[float]:
    """Median step seconds of plain HSDP (rank 0), after 5 warm-up steps."""
    import subprocess

    port = free_port()
    cfg = {"mode": "hsdp", "out": str(out), "groups_n": groups, "ranks": ranks, "steps": steps,
           "batch": 8 * groups * ranks}
    procs = [subprocess.Popen([sys.executable, "-m", "bench._ft_worker", json.dumps(cfg)],
                              env=_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                                        "WORLD_SIZE": str(groups * ranks)}),
                              stdout=open(out / f"log.hsdp.{r}", "wb"), stderr=subprocess.STDOUT)
             for r in range(groups * ranks)]
    for p in procs:
        p.wait(600)
    times = json.loads((out / "hsdp.json").read_text())["step_s"]
    return statistics.median(times[5:] or times)


def _row(lib: str, layout: str, s: dict[str, Any], fr: FailureRun, steps: int) -> dict[str, Any]:
    problems = []
    if fr.timed_out:
        problems.append("timed out")
    if s["lost"]:
        problems.append(f"lost steps {s['lost'][:5]}")
    if s["redone"]:
        problems.append(f"committed work lost: {s['redone']} steps committed again after {s['rollbacks']} "
                        "rollback(s) (the job went back in time: a global restart)")
    if s["extra"] or s["committed"] != steps:
        problems.append(f"{s['committed']} of {steps} committed")
    if not s["equal"]:
        problems.append(f"params differ or missing {s['missing_params']}")
    if s["recovered"] != s["kills"]:
        problems.append(f"{s['kills'] - s['recovered']} killed groups never recovered")
    if s["hangs_back"] != s["kinds"]["hang"]:
        problems.append(f"{s['kinds']['hang'] - s['hangs_back']} hung groups never committed again")
    if s["refused_max_s"] is not None and s["refused_max_s"] == float("inf"):
        problems.append("no commit after a refusal (the lighthouse restarted)")
    return {"lib": lib, "layout": layout, "committed": s["committed"], "discarded": s["discarded"],
            "failures": s["failures"], "kinds": " / ".join(str(s["kinds"][k]) for k in ("kill", "hang", "refuse")),
            "goodput": s["goodput"], "hang_back": s["hang_back_med_s"], "noticed": s["noticed_max_s"],
            "refused": s["refused_med_s"], "rec_med": s["recover_med_s"],
            "rec_max": s["recover_max_s"], "rec_steps": (f"{s['recover_med_steps']:g} / {s['recover_max_steps']}"
                                                        if s["recovered"] else None),
            "rejoin": s["rejoin_max_steps"], "setup": s["setup_med_s"], "ready": s["ready_med_s"],
            "ready_max": s["ready_max_s"], "transfer": (s["transfer_med_s"] or 0) * 1e3 if s["recovered"] else None,
            "transfer_max": (s["transfer_max_s"] or 0) * 1e3 if s["recovered"] else None,
            "heal_ratio": ratio(s["heal_step_s"], s["normal_step_s"]),
            "step_ms": s["normal_step_s"] * 1e3 if s["normal_step_s"] else None,
            "unplanned": len(fr.unplanned), "check": "ok" if not problems else "FAILED: " + "; ".join(problems)}


def run(settings: Settings) -> list[Table]:
    n = _sizes(settings)
    groups = [f"g{i}" for i in range(n["groups"])]
    deadline = 150.0 if settings.quick else settings.timeout * 3
    pace = 0.2 if settings.quick else 0.0  # (quick: 40 steps must outlast a spare's start, for its 2 kills)
    table = Table(
        "ft",
        f"fault tolerance: {n['groups']} replica groups x {n['ranks']} ranks, {n['steps']} steps, {n['failures']} "
        f"failures in turn: SIGKILL of a random process, a process stopped past the timeout, the lighthouse killed "
        f"and restarted (float64 MLP {64}->{256}->{64}->1, AdamW)",
        [Column("lib", "library"), Column("layout", "groups x ranks"), Column("committed", "committed"),
         Column("discarded", "discarded"), Column("failures", "failures"),
         Column("kinds", "kills / hangs / refusals"), Column("unplanned", "other exits"),
         Column("goodput", "steps / s", ".2f"),
         Column("rec_med", "recovery med s", ".2f"), Column("rec_max", "max s", ".2f"),
         Column("rec_steps", "recovery steps med / max"), Column("setup", "restart med s", ".2f"),
         Column("ready", "ready->commit med s", ".2f"), Column("ready_max", "max s", ".2f"),
         Column("rejoin", "rejoin max steps"),
         Column("noticed", "hang noticed max s", ".2f"), Column("hang_back", "hang -> commit med s", ".2f"),
         Column("refused", "refusal -> commit med s", ".2f"),
         Column("transfer", "transfer med ms", ".1f"), Column("transfer_max", "max ms", ".1f"),
         Column("heal_ratio", "step in heal / normal", ".2f"), Column("step_ms", "normal step ms", ".1f"),
         Column("overhead", "healthy / plain HSDP", ".2f"),
         Column("check", "check")])
    work = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    keep = bool(os.environ.get("FT_KEEP"))
    try:
        out = work / "shardwise"
        out.mkdir()
        s, fr = _shardwise(out, groups, n["ranks"], n["steps"], n["failures"], deadline, pace)
        table.rows.append(_row("shardwise", f"{n['groups']} x {n['ranks']}", s, fr, n["steps"]))
        normal_ft = s["normal_step_s"]
        healthy_note = "the failure run's normal steps"
        if not settings.quick:  # a run of its own, without failures
            out = work / "healthy"
            out.mkdir()
            h, _ = _shardwise(out, groups, n["ranks"], n["healthy"], 0, deadline, kinds=())
            normal_ft, healthy_note = h["normal_step_s"], f"a run of {n['healthy']} steps without failures"
        plain = None
        if not settings.quick:
            out = work / "hsdp"
            out.mkdir()
            plain = _hsdp(out, n["groups"], n["ranks"], n["healthy"])
        table.rows[0]["overhead"] = ratio(normal_ft, plain)
        table.notes.append(f"healthy: a step with ft on ({healthy_note}) / plain HSDP ({n['groups']} x {n['ranks']} "
                           f"mesh, replicate x shard, {n['healthy']} steps): {(normal_ft or 0) * 1e3:.1f} ms / "
                           f"{(plain or 0) * 1e3:.1f} ms (goal <= 1.05x)" if plain is not None else
                           "healthy-step overhead against plain HSDP: measured in the full run only")
        if (TORCHFT_ENV / "bin" / "python").exists() and _has_torchft():
            out = work / "torchft"
            out.mkdir()
            s, fr = _torchft(out, groups, n["steps"], n["failures"], deadline, pace)
            table.rows.append(_row("torchft 0.2", f"{n['groups']} x 1", s, fr, n["steps"]))
        else:
            table.rows.append({"lib": "torchft 0.2", "check": f"torchft not installed: {TORCHFT_HOWTO}"})
    finally:
        if keep:
            table.notes.append(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    table.notes.append("recovery: SIGKILL -> the group's first committed step after healing; its next life is a hot "
                       "spare (torch and the library imported, released at the kill); steps: committed meanwhile. "
                       "restart: kill -> the new life ready to ask (its world, model, fully_shard, manager); "
                       "ready->commit: fault tolerance's part (quorum, rebuild, heal, its first step). rejoin: steps "
                       "the others committed while the restarted group waited ready (goal <= 2). transfer: the "
                       "heal's state transfer alone. step in heal: the survivors' step in which a group healed")
    table.notes.append("discarded: a group's step attempts that did not commit (a member died or was left out); "
                       "other exits: processes that died on their own, not killed by the bench (their group is "
                       "restarted as the launcher would); torchft 0.2's DistributedDataParallel kills a survivor "
                       "whose allreduce fails (`assert fut._fut` in its comm hook, torchft/ddp.py)")
    return [table]


def _has_torchft() -> bool:
    import subprocess

    probe = subprocess.run([str(TORCHFT_ENV / "bin" / "python"), "-c", "import torchft"], capture_output=True)
    return probe.returncode == 0
