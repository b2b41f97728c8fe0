"""The failure run of `bench/ft.py`: replica groups as separate process sets, failed in three ways, and what their logs say.

`FailureRun` starts G groups of N processes (one command per process, `command(group,
life)`), each group's world on its own port as `shardwise run --ft` launches it, and the
lighthouse in a process of its own. While the groups train it injects failures, the kinds in
turn (`kinds`):

| kind | what the bench does | what fault tolerance must do |
|---|---|---|
| `kill` | SIGKILL one process of a random group, end the rest of the group (torchrun does) and start its next life | go on without the group, heal it from a live one when it is back |
| `hang` | SIGSTOP one process of a random group for `hang_s` (past the fault-tolerance timeout), then SIGCONT | notice it within the timeout, go on without the group, heal it when it wakes |
| `refuse` | SIGKILL the lighthouse and start it again on its port `down_s` later (meanwhile every connection to it is refused) | wait for it and carry on |

Each next life is started ahead (a hot spare with torch imported, released by a
`go.<group>.<life>` file), so that the recovery measured is the group's setup and fault
tolerance's (quorum, rebuild, heal), not Python's imports.
A kill or a hang takes only a healthy group (its current life has committed a step, since it
woke if it hung; a kill also needs its spare armed: imported, waiting), and never the last
healthy one, so a live group is always there to heal from; when the kind due cannot be
injected now, the next kind that can is. Failures are about `steps / (failures + 1)` steps
apart, or more when groups are slow to come back. Near the end it stops and writes `finish`
once every group is back; the workers wait for it before their last step, so that none is
left behind with nobody to heal from.

`summarize` reads rank 0's per-step JSON lines of every life (`events.<group>.<life>`).
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["FailureRun", "Kill", "summarize", "free_port"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Kill:
    """One injected failure (a kill, a hang or a refusal; see the module docstring)."""

    group: str  # ("lighthouse" for a refusal)
    rank: int
    time: float
    progress: int  # committed steps when it happened (the most any group had seen)
    life: int  # the life started in its place (a kill), the life that hung (a hang)
    kind: str = "kill"


@dataclass
class FailureRun:
    out: Path
    groups: list[str]
    ranks: int
    steps: int
    failures: int
    command: Callable[[str, int, int, int], tuple[list[str], dict[str, str]]]  # (group, life, rank, port) -> argv, env
    seed: int = 0
    deadline_s: float = 600.0
    kinds: tuple[str, ...] = ("kill",)
    lighthouse: Optional[Callable[[int], subprocess.Popen[bytes]]] = None  # its incarnation n on its port (n > 0:
    # a hot spare that binds the port once `go.lighthouse.<n>` exists)
    hang_s: float = 6.0
    down_s: float = 1.0
    kills: list[Kill] = field(default_factory=list)
    unplanned: list[str] = field(default_factory=list)
    timed_out: bool = False

    def _start(self, group: str, life: int) -> list[subprocess.Popen[bytes]]:
        port = free_port()
        procs = []
        for rank in range(self.ranks):
            argv, env = self.command(group, life, rank, port)
            log = open(self.out / f"log.{group}.{life}.{rank}", "wb")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        return procs

    def _progress(self) -> int:
        best = 0
        for g in self.groups:
            try:
                best = max(best, int((self.out / f"progress.{g}").read_text() or 0))
            except (OSError, ValueError):
                pass
        return best

    def _ready(self, group: str, life: int, what: str = "ready") -> bool:
        return all((self.out / f"{what}.{group}.{life}.{r}").exists() for r in range(self.ranks))

    def _finished(self, group: str, life: int) -> bool:
        try:
            return any("done" in json.loads(line) for line in
                       (self.out / f"events.{group}.{life}").read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            return False

    def _committed_in(self, group: str, life: int, after: float = 0.0) -> bool:
        """Whether that life committed a step that started after `after` (wall time)."""
        try:
            lines = (self.out / f"events.{group}.{life}").read_text().splitlines()
            return any(e.get("ok") and e["t"] > after for e in map(json.loads, filter(str.strip, lines)))
        except (OSError, ValueError):
            return False

    def run(self) -> None:
        rng = random.Random(self.seed)
        gap = max(2, self.steps // (self.failures + 1)) if self.failures else self.steps
        lives = {g: 0 for g in self.groups}
        house = self.lighthouse(0) if self.lighthouse is not None else None
        incarnation = 0
        house_spare = self.lighthouse(1) if self.lighthouse is not None and "refuse" in self.kinds else None
        procs = {g: self._start(g, 0) for g in self.groups}
        spares: dict[str, list[Any]] = {}  # each group's next life, started once its current life is up
        healthy_life: dict[str, int] = {}  # group -> its life that has committed a step
        hung: dict[str, tuple[Any, float]] = {}  # group -> (its stopped process, when to continue it)
        woke: dict[str, float] = {}  # group -> when its hung process was continued (healthy once it commits after)
        down_until: Optional[float] = None  # the lighthouse is dead until then
        done: set[str] = set()  # groups that failed after their last step
        next_kill = rng.randint(max(1, gap // 2), gap) if self.failures else self.steps
        stop_killing_at = self.steps - 3
        finished = False
        ready_since: Optional[float] = None
        deadline = time.monotonic() + self.deadline_s
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    self.timed_out = True
                    break
                for g, (p, until) in list(hung.items()):
                    if now >= until:
                        p.send_signal(signal.SIGCONT)
                        del hung[g]
                        woke[g] = time.time()
                if down_until is not None and now >= down_until and house_spare is not None:
                    incarnation += 1
                    (self.out / f"go.lighthouse.{incarnation}").touch()  # on its port again
                    house, down_until = house_spare, None
                    house_spare = self.lighthouse(incarnation + 1) if self.lighthouse is not None else None
                codes = {g: [p.poll() for p in ps] for g, ps in procs.items()}
                if all(c == 0 for cs in codes.values() for c in cs):
                    break
                for g, cs in codes.items():  # a process that failed on its own: the launcher restarts its group
                    if any(c not in (None, 0) for c in cs) and g not in done:
                        self.unplanned.append(f"{g} life {lives[g]} exit codes {cs}")
                        hung.pop(g, None)
                        if self._finished(g, lives[g]):  # (after its last step: nothing left to restart for)
                            done.add(g)
                        else:
                            self._replace(g, lives, procs, spares)
                if done and all(c is not None for cs in codes.values() for c in cs):
                    break
                for g in self.groups:
                    if self.failures and g not in spares and self._ready(g, lives[g]):
                        spares[g] = self._start(g, lives[g] + 1)
                progress = self._progress()
                for g in self.groups:
                    if healthy_life.get(g) != lives[g] and self._committed_in(g, lives[g]):
                        healthy_life[g] = lives[g]
                    if g in woke and self._committed_in(g, lives[g], after=woke[g]):
                        del woke[g]
                healthy = [g for g in self.groups if healthy_life.get(g) == lives[g] and g not in hung and g not in woke]
                armed = [g for g in healthy if g in spares and self._ready(g, lives[g] + 1, "armed")]
                if (not finished and len(self.kills) < self.failures and progress >= next_kill
                        and progress < stop_killing_at):
                    due = len(self.kills) % len(self.kinds)
                    for kind in self.kinds[due:] + self.kinds[:due]:
                        if kind == "refuse" and house is not None and house_spare is not None and down_until is None:
                            house.kill()
                            house.wait()
                            down_until = time.monotonic() + self.down_s
                            self.kills.append(Kill("lighthouse", -1, time.time(), progress, -1, kind))
                        elif kind in ("kill", "hang") and len(healthy) >= 2 and (armed or kind == "hang"):
                            # a healthy group, never the last: a live group is left to heal from
                            g = rng.choice(armed if kind == "kill" else healthy)
                            r = rng.randrange(self.ranks)
                            when = time.time()
                            if kind == "kill":
                                procs[g][r].send_signal(signal.SIGKILL)
                                self._replace(g, lives, procs, spares)
                            else:
                                procs[g][r].send_signal(signal.SIGSTOP)
                                hung[g] = (procs[g][r], time.monotonic() + self.hang_s)
                            self.kills.append(Kill(g, r, when, progress, lives[g], kind))
                        else:
                            continue
                        next_kill = progress + rng.randint(max(1, gap // 2), gap)
                        break
                if not finished and (len(self.kills) >= self.failures or progress >= stop_killing_at):
                    # every group's current life ready (asking, or about to), none stopped, the lighthouse up:
                    # the last step takes them all
                    up = [g for g in self.groups if self._ready(g, lives[g])]
                    if len(up) == len(self.groups) and not hung and down_until is None:
                        ready_since = ready_since or time.monotonic()
                        if time.monotonic() - ready_since > 0.5:
                            (self.out / "finish").touch()
                            finished = True
                time.sleep(0.01)
        finally:
            (self.out / "kills.json").write_text(json.dumps([vars(k) for k in self.kills]))
            for p, _ in hung.values():
                p.send_signal(signal.SIGCONT)
            for ps in (*procs.values(), *spares.values()):
                for p in ps:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
            for h in (house, house_spare):
                if h is not None:
                    h.kill()
                    h.wait()

    def _replace(self, g: str, lives: dict[str, int], procs: dict[str, list[Any]],
                 spares: dict[str, list[Any]]) -> None:
        """End the rest of group g (as torchrun does) and release its next life."""
        for p in procs[g]:
            if p.poll() is None:
                p.kill()
            p.wait()
        lives[g] += 1
        if g not in spares:
            spares[g] = self._start(g, lives[g])
        (self.out / f"go.{g}.{lives[g]}").touch()
        procs[g] = spares.pop(g)


def _events(out: Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    found: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for path in out.glob("events.*"):
        _, group, life = path.name.split(".")
        found[(group, int(life))] = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return found


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(out: Path, groups: list[str], steps: int, kills: list[Kill]) -> dict[str, Any]:
    """The failure run's figures (see bench/ft.py's table)."""
    events = _events(out)
    step_lines = {k: [e for e in v if "step" in e] for k, v in events.items()}
    commits: dict[int, list[str]] = {}
    discarded = 0
    for (g, _), lines in step_lines.items():
        for e in lines:
            if e["ok"]:
                commits.setdefault(e["step"], []).append(g)
            else:
                discarded += 1
    # committed work lost: a step committed by a second quorum (trained again: the job went back in time);
    # without quorum ids (torchft's lines), a step committed again after a later one was. (A group's line
    # for a step all committed may come late: it was stopped after its vote.)
    newest, redone, rollbacks, behind = -1, set(), 0, False
    first_quorum: dict[int, str] = {}
    oks = sorted((e for ls in step_lines.values() for e in ls if e["ok"]), key=lambda e: e["end"])
    by_quorum = all(e.get("quorum") for e in oks)
    for e in oks:
        again = (first_quorum.setdefault(e["step"], e["quorum"]) != e["quorum"] if by_quorum
                 else e["step"] < newest)
        if again:
            rollbacks += not behind  # (a new fall back, not the same one going on)
            redone.add(e["step"])
        behind = again
        newest = max(newest, e["step"])
    starts = [e["t"] for lines in step_lines.values() for e in lines]
    ends = [e["end"] for lines in step_lines.values() for e in lines]
    wall = (max(ends) - min(starts)) if starts else None
    recover_s, recover_steps, rejoin_steps, transfers = [], [], [], []
    setup_s: list[float] = []
    ready_s: list[float] = []
    for k in (k for k in kills if k.kind == "kill"):
        lines = step_lines.get((k.group, k.life), [])
        first = next((e for e in lines if e["ok"]), None)
        if first is None:
            continue
        recover_s.append(first["end"] - k.time)
        recover_steps.append(first["step"] - k.progress)
        ready = next((e["ready"] for e in events.get((k.group, k.life), []) if "ready" in e), None)
        others = {e["step"] for (g, _), ls in step_lines.items() if g != k.group for e in ls
                  if e["ok"] and ready is not None and ready < e["end"] < first["end"]}
        rejoin_steps.append(len(others))
        if ready is not None:
            setup_s.append(ready - k.time)  # the new life's start: its world, model, manager
            ready_s.append(first["end"] - ready)  # then fault tolerance's part: quorum, heal, its first step
        transfers += [e["transfer_s"] for e in lines if e.get("transfer_s")]
    # a hang: the stopped group's next commit (it woke, was behind, healed), and how long the others'
    # step attempt that it failed took (the fault-tolerance timeout noticing it)
    hang_back, noticed = [], []
    for k in (k for k in kills if k.kind == "hang"):
        lines = step_lines.get((k.group, k.life), [])
        back = next((e for e in lines if e["ok"] and e["t"] > k.time), None)
        if back is not None:
            hang_back.append(back["end"] - k.time)
            transfers += [e["transfer_s"] for e in lines if e.get("transfer_s") and e["t"] > k.time]
        failed = [e["end"] - max(e["t"], k.time) for (g, _), ls in step_lines.items() if g != k.group for e in ls
                  if not e["ok"] and e["t"] < k.time + 1.0 < e["end"]]
        noticed.append(max(failed, default=0.0))
    # a refusal: the first commit after the lighthouse died (it was down, then back on its port)
    refused = [min((e["end"] for ls in step_lines.values() for e in ls if e["ok"] and e["end"] > k.time),
                   default=float("inf")) - k.time for k in kills if k.kind == "refuse"]
    # the survivors' steps in which a group healed: the committed step that its first commit after a heal
    # took with them (their attempts that failed before it are the failure's cost, not the heal's)
    heal_steps = {e["step"] for ls in step_lines.values() for e in ls if e["healed"] and e["ok"]}
    healing = [e["step_s"] for ls in step_lines.values() for e in ls
               if e["step"] in heal_steps and e["ok"] and e["heal_in_quorum"] and not e["healed"]]
    normal = [e["step_s"] for ls in step_lines.values() for e in ls[5:]
              if e["ok"] and e["step"] not in heal_steps and len(e["members"]) == len(groups)]
    params = {}
    for g in groups:
        try:
            import torch

            params[g] = torch.load(out / f"params.{g}.pt", weights_only=True)
        except (OSError, RuntimeError):
            params[g] = None
    ref = params[groups[0]]
    equal = ref is not None and all(p is not None and p.keys() == ref.keys()
                                    and all(bool((p[n] == ref[n]).all()) for n in ref) for p in params.values())
    return {
        "committed": len(commits), "redone": len(redone), "rollbacks": rollbacks,
        "lost": sorted(set(range(steps)) - set(commits)),
        "extra": sorted(set(commits) - set(range(steps))), "discarded": discarded, "failures": len(kills),
        "kinds": {kind: sum(k.kind == kind for k in kills) for kind in ("kill", "hang", "refuse")},
        "hang_back_med_s": _median(hang_back), "hang_back_max_s": max(hang_back, default=None),
        "hangs_back": len(hang_back), "noticed_max_s": max(noticed, default=None),
        "refused_med_s": _median(refused), "refused_max_s": max(refused, default=None),
        "wall_s": wall, "goodput": len(commits) / wall if wall else None,
        "recover_med_s": _median(recover_s), "recover_max_s": max(recover_s, default=None),
        "recover_med_steps": _median(recover_steps), "recover_max_steps": max(recover_steps, default=None),
        "rejoin_max_steps": max(rejoin_steps, default=None), "setup_med_s": _median(setup_s),
        "ready_med_s": _median(ready_s), "ready_max_s": max(ready_s, default=None), "recovered": len(recover_s),
        "kills": sum(k.kind == "kill" for k in kills),
        "transfer_med_s": _median(transfers), "transfer_max_s": max(transfers, default=None),
        "heal_step_s": _median(healing), "normal_step_s": _median(normal),
        "equal": equal, "missing_params": [g for g, p in params.items() if p is None],
    }
