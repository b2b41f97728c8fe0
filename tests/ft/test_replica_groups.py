"""Replica groups that keep training when one dies, and a restarted group healed by a live one.

Each replica group is its own processes here (its own world), as separate launches are
under `shardwise run --ft`; the lighthouse runs in the test's process. Every group trains
the same float64 model through `shardwise.ft.DistributedDataParallel` and `Optimizer`, on
its part of each step's global batch (`ReplicaSampler`: re-partitioned over the groups
alive). A group kills itself (SIGKILL) after a backward, before its vote; the test restarts
it, as the launcher would. At the end every group's parameters must equal, bit for bit,
every other's, and one process trained on the committed steps' global batches, to rounding.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.multiprocessing as mp

from shardwise.ft import Lighthouse, QuorumRule

pytestmark = pytest.mark.multirank  # every test here launches processes

STEPS = 10
GROUPS = ("a", "b", "c")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


DATA = 60  # samples; each step's global batch is re-partitioned over the groups alive (ReplicaSampler)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(DATA, 6, generator=g, dtype=torch.float64), torch.randn(DATA, 1, generator=g,
                                                                               dtype=torch.float64)


def _global_batch(groups: int) -> int:
    return 10 if groups == 3 else 12  # 3 groups of 1: parts 4, 3, 3 (uneven: weighted by samples); 2 of 2: 6, 6


def _wait_for(paths: list[Path], seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s for {[str(p) for p in paths]}")
        time.sleep(0.05)


def _group(rid: str, address: str, out: str, life: int, kill_at: Optional[int], wait_at: Optional[tuple[int, str]],
           rank: int, size: int, port: int, everyone: tuple[str, ...], ckpt: str, start_with: tuple[str, ...],
           giving: str) -> None:
    import shardwise as sw
    import shardwise.ft as ft
    from shardwise.fsdp import fully_shard

    folder = Path(out)
    model = _model()
    if size > 1:  # the group's own world, as its own launch would start it: fully_shard inside
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=sw.init_device_mesh("cpu", (size,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if giving == "pickle" or (giving == "pickle-last-rank" and rank == size - 1):
        # the first state this process sends is a code-running pickle, not the wire format
        import shardwise.ft._manager as sent

        honest = sent.pack

        def pack(state: Any) -> tuple[bytes, list[torch.Tensor]]:
            return (pickle.dumps(_Pwn(str(folder / "pwned"))), []) if _first(folder / "gave") else honest(state)

        sent.pack = pack  # type: ignore[assignment]

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    def state() -> dict[str, Any]:
        if giving == "die" and _first(folder / "gave"):  # (only a group sending its state to a healing one calls this)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    if ckpt:  # a checkpoint to resume from needs the optimizer's state before its first step too
        from shardwise.checkpoint.state_dict import get_state_dict, set_state_dict

        def state() -> dict[str, Any]:
            model_state, optim_state = get_state_dict(model, opt)
            return {"model": model_state, "optim": optim_state}

        def load(state: dict[str, Any]) -> None:
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    manager = ft.Manager(load_state_dict=load, state_dict=state, lighthouse_addr=address, replica_id=rid,
                         timeout=timedelta(seconds=3), checkpoint_dir=ckpt or None, checkpoint_every=2 if ckpt else 0)
    ddp = ft.DistributedDataParallel(manager, model)
    optim = ft.Optimizer(manager, opt)
    sampler = ft.ReplicaSampler(DATA, _global_batch(len(everyone)), manager)
    xs, ys = _data()
    (folder / f"{rid}{rank}.ready{life}").touch()
    if life == 0 or start_with:  # groups started together join one quorum
        _wait_for([folder / f"{g}{r}.ready{life}" for g in (start_with or everyone) for r in range(size)])
    commits: list[tuple[int, list[str]]] = []
    while manager.current_step() < STEPS:
        optim.zero_grad()
        step = manager.current_step()
        if wait_at is not None and step >= wait_at[0]:
            _wait_for([folder / wait_at[1]])  # (the survivors wait for the restarted group to be up)
        rows = sampler.indices()  # this rank's piece of its group's part of the step's global batch
        torch.nn.functional.mse_loss(ddp(xs[rows]), ys[rows]).backward()
        if kill_at is not None and step >= kill_at and rank == size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # after its gradients were sent, before its vote
        if optim.step():
            quorum = manager.quorum()
            assert quorum is not None
            commits.append((step, list(quorum.members)))
            (folder / f"{rid}{rank}.commit{step}").touch()
        else:
            (folder / f"{rid}{rank}.failed{step}").touch()
    params = {n: p.full_tensor() if isinstance(p, sw.DTensor) else p for n, p in model.state_dict().items()}
    if rank == 0:
        torch.save({"commits": commits, "params": params, "healed": manager.healed, "resumed": manager.resumed_from},
                   folder / f"{rid}.pt")
    manager.shutdown()


class _Pwn:
    """Unpickled, it would run a command (create a file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def _first(path: Path) -> bool:
    """Whether this process is the first to get here (it creates `path`)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class _Launch:
    """One replica group's processes, started as its own launch: a failed one ends the others
    (torchrun does), and the group is started again alone."""

    def __init__(self, address: str, folder: Path, size: int, everyone: tuple[str, ...]) -> None:
        self.address, self.folder, self.size, self.everyone = address, folder, size, everyone
        self.ctx = mp.get_context("spawn")

    def start(self, rid: str, life: int, kill_at: Optional[int] = None, wait_at: Optional[tuple[int, str]] = None,
              ckpt: str = "", start_with: tuple[str, ...] = (), giving: str = "") -> list[Any]:
        port = _free_port()
        procs = [self.ctx.Process(target=_group, args=(rid, self.address, str(self.folder), life, kill_at, wait_at, r,
                                                        self.size, port, self.everyone, ckpt, start_with,
                                                        giving))
                 for r in range(self.size)]
        for p in procs:
            p.start()
        return procs

    @staticmethod
    def wait_failed(procs: list[Any], seconds: float = 240) -> int:
        """Wait for a process of the group to fail, end the others, and return its exit code."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs if p.exitcode is not None]
            if codes:
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                    p.join(30)
                return codes[0]
            time.sleep(0.05)
        raise TimeoutError("no process of the group ended")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replay(commits: list[tuple[int, list[str]]]) -> dict[str, torch.Tensor]:
    """One process training on each committed step's global batch: what the groups alive at
    each step computed between them (parts weighted by their samples)."""
    from shardwise.ft import ReplicaSampler

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sampler = ReplicaSampler(DATA, _global_batch(len({m for _, members in commits for m in members})))
    xs, ys = _data()
    for step, _ in commits:
        opt.zero_grad()
        rows = sampler.global_batch(step)
        torch.nn.functional.mse_loss(model(xs[rows]), ys[rows]).backward()
        opt.step()
    return model.state_dict()


def _exact_replay(commits: list[tuple[int, list[str]]], size: int = 1) -> dict[str, torch.Tensor]:
    """The committed steps replayed in one process op for op, as the groups of `size` ranks
    computed them: each rank's gradient on its piece of its member's part of the step's batch;
    within a member the ranks' mean (`fully_shard`'s reduce-scatter: a sum of two halves is
    exact in any order); each member's weighted by its part's size; summed over the members in
    their order (`_comm.replica_all_reduce`'s order), divided by the samples; the optimizer
    step. Bit for bit what the groups computed."""
    from shardwise.ft import ReplicaSampler

    assert size <= 2, "a group's own mean over more than two ranks is summed in gloo's order"
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    groups = len({m for _, members in commits for m in members})
    sampler = ReplicaSampler(DATA, _global_batch(groups))
    xs, ys = _data()
    for step, members in commits:
        total: Optional[torch.Tensor] = None
        samples = 0.0
        for i in range(len(members)):
            ranks = []
            for r in range(size):
                opt.zero_grad()
                rows = sampler.indices(step=step, members=len(members), member=i, rank=r, ranks=size)
                torch.nn.functional.mse_loss(model(xs[rows]), ys[rows]).backward()
                ranks.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            part = float(len(sampler.indices(step=step, members=len(members), member=i, rank=0, ranks=1)))
            mine = (ranks[0] if size == 1 else (ranks[0] + ranks[1]) / 2) * part
            total = mine if total is None else total + mine
            samples += part
        assert total is not None
        total /= samples
        offset = 0
        for p in model.parameters():
            p.grad.copy_(total[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("size", [1, 2], ids=["groups-of-1", "groups-of-2-fully-sharded"])
def test_a_killed_group_leaves_the_others_training_and_heals_from_a_live_one_on_restart(size: int,
                                                                                        tmp_path: Path) -> None:
    groups = GROUPS if size == 1 else GROUPS[:2]
    log = io.StringIO()
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=2.0), heartbeat_timeout=0.5, log=log) as lighthouse:
        launch = _Launch(lighthouse.address, tmp_path, size, groups)
        survivors = [p for rid in groups if rid != "b" for p in launch.start(rid, 0, wait_at=(6, f"b{size - 1}.ready1"))]
        victim = launch.start("b", 0, kill_at=3)
        assert launch.wait_failed(victim) == -signal.SIGKILL
        # restarted once the others went on without it (a restart within the heartbeat timeout is
        # waited for, and heals in the step it was killed in: the others would not go on alone)
        _wait_for([tmp_path / "a0.commit3"])
        restarted = launch.start("b", 1)  # as `shardwise run --ft` restarts a failed group, alone
        for p in (*survivors, *restarted):
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in groups}
    commits = results["a"]["commits"]
    assert [s for s, _ in commits] == list(range(STEPS)), commits  # every step committed once, in order
    for rid in groups:  # each group's (last life's) commits are the steps it took part in since it started
        mine = results[rid]["commits"]
        assert mine == [c for c in commits if c[0] >= mine[0][0] and rid in c[1]], (rid, mine, commits)
    assert any("b" not in members for _, members in commits), commits  # the others went on without b
    assert commits[-1][1] == list(groups) and results["b"]["healed"] >= 1  # (again if, slow, it missed a quorum)
    text = log.getvalue()
    assert "left {'b': 'heartbeat stale'}" in text and "b heals from" in text, text
    want, exact = _replay(commits), _exact_replay(commits, size)
    for rid in groups:
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, exact[name]), (rid, name, (p - exact[name]).abs().max().item())  # bit for bit
            assert (p - want[name]).abs().max().item() < 1e-12, (rid, name)


def test_a_group_killed_while_it_heals_another_leaves_the_heal_to_a_live_one(tmp_path: Path) -> None:
    # b is killed at step 3 and restarted (a and c wait at step 4 for it); the member it heals
    # from first dies as it starts to send its state: the heal fails on b and the step on every
    # member, and b heals from the other live one. The two go on and end as one process would.
    log = io.StringIO()
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=2.0), heartbeat_timeout=0.5, log=log) as lighthouse:
        launch = _Launch(lighthouse.address, tmp_path, 1, GROUPS)
        givers = {rid: launch.start(rid, 0, wait_at=(4, "b0.ready1"), giving="die")[0] for rid in ("a", "c")}
        victim = launch.start("b", 0, kill_at=3)
        assert launch.wait_failed(victim) == -signal.SIGKILL
        restarted = launch.start("b", 1)
        deadline = time.monotonic() + 240
        while all(p.exitcode is None for p in givers.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [rid for rid, p in givers.items() if p.exitcode is not None]
        assert len(dead) == 1 and givers[dead[0]].exitcode == -signal.SIGKILL, (dead, log.getvalue())
        live = "c" if dead == ["a"] else "a"
        for p in (givers[live], *restarted):
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    text = log.getvalue()
    assert f"b heals from {dead[0]}" in text and f"b heals from {live}" in text, text
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in (live, "b")}
    commits = results[live]["commits"]
    assert [s for s, _ in commits] == list(range(STEPS)) and commits[-1][1] == sorted([live, "b"]), commits
    assert results["b"]["healed"] >= 1, results
    want, exact = _replay(commits), _exact_replay(commits)
    for rid in (live, "b"):
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, exact[name]), (rid, name, (p - exact[name]).abs().max().item())
            assert (p - want[name]).abs().max().item() < 1e-12, (rid, name)


@pytest.mark.parametrize("size", [1, 2], ids=["groups-of-1", "groups-of-2-one-rank-refuses"])
def test_a_pickle_sent_to_a_healing_group_runs_nothing_and_is_refused_and_the_heal_is_tried_again(
        size: int, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # a's first state sent to the restarted b is a pickle that would create a file: b refuses it
    # (the header is not JSON), the step commits nowhere, and b heals again from a's next send.
    # Groups of 2: only a's last rank sends a pickle, so b's rank 0 heals and its rank 1 does not;
    # regression (bench ft): rank 0 kept its healed step, the group asked as up to date, rank 1
    # never received the state and trained on with stale shards, a step count of its own, and at
    # the end a collective that its rank 0 did not issue (gloo aborted the process)
    log = io.StringIO()
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=2.0), heartbeat_timeout=0.5, log=log) as lighthouse:
        launch = _Launch(lighthouse.address, tmp_path, size, ("a", "b"))
        giver = launch.start("a", 0, wait_at=(6, f"b{size - 1}.ready1"),
                             giving="pickle" if size == 1 else "pickle-last-rank")
        victim = launch.start("b", 0, kill_at=3)
        assert launch.wait_failed(victim) == -signal.SIGKILL
        for p in (*giver, *launch.start("b", 1)):
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    assert (tmp_path / "gave").exists() and not (tmp_path / "pwned").exists()  # sent, and nothing ran
    assert log.getvalue().count("b heals from a") >= 2, log.getvalue()
    assert "a state header that is not UTF-8 JSON" in capfd.readouterr().err
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in ("a", "b")}
    commits = results["a"]["commits"]
    assert [s for s, _ in commits] == list(range(STEPS)) and commits[-1][1] == ["a", "b"], commits
    exact = _exact_replay(commits, size)
    for rid in ("a", "b"):
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, exact[name]), (rid, name)


def test_every_group_killed_at_once_resumes_from_the_last_checkpoint(tmp_path: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    # a and b (2 ranks each, fully_shard inside) both lose a process at step 7 after its backward:
    # no live group is left to heal from. Started again together, every member of their first
    # quorum is at step 0, and they load the last complete checkpoint: the first member saves one
    # every 2 steps in the background, so step 6's, or an earlier one if the kill cut a save short.
    log, ckpt = io.StringIO(), str(tmp_path / "checkpoint")
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=2.0), heartbeat_timeout=0.5, log=log) as lighthouse:
        launch = _Launch(lighthouse.address, tmp_path, 2, ("a", "b"))
        lives = [launch.start(rid, 0, kill_at=7, ckpt=ckpt) for rid in ("a", "b")]
        for procs in lives:
            assert launch.wait_failed(procs) == -signal.SIGKILL
        restarted = [p for rid in ("a", "b") for p in launch.start(rid, 1, ckpt=ckpt, start_with=("a", "b"))]
        for p in restarted:
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in ("a", "b")}
    # whoever asked first resumed; the other resumed in the same quorum or, late (loaded machine),
    # healed from it a step later
    first = min(results[rid]["commits"][0][0] for rid in ("a", "b"))
    resumed = [rid for rid in ("a", "b") if results[rid]["resumed"] is not None]
    assert first in (2, 4, 6) and resumed and all(results[rid]["resumed"] == first for rid in resumed), results
    assert all(results[rid]["healed"] == (rid not in resumed) for rid in ("a", "b")), results
    commits = sorted({c[0]: c for rid in ("a", "b") for c in results[rid]["commits"]}.values())
    assert [s for s, _ in commits] == list(range(first, STEPS)) and commits[-1][1] == ["a", "b"], commits
    assert "resumed from the checkpoint of step" in capfd.readouterr().err
    want = _replay([(s, ["a", "b"]) for s in range(STEPS)])  # what an uninterrupted run computes
    for rid in ("a", "b"):
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, results["a"]["params"][name]), (rid, name)
            assert (p - want[name]).abs().max().item() < 1e-12, (rid, name)


def _serve(port: int, log: str) -> None:
    with open(log, "a") as out:
        Lighthouse(port=port, rule=QuorumRule(min_replicas=2, join_timeout=0.5), heartbeat_timeout=0.5,
                   log=out).serve()


def test_the_groups_wait_for_a_killed_lighthouse_to_come_back_and_carry_on(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port, log = _free_port(), str(tmp_path / "lighthouse.log")
    lighthouse = ctx.Process(target=_serve, args=(port, log))
    lighthouse.start()
    launch = _Launch(f"127.0.0.1:{port}", tmp_path, 1, ("a", "b"))
    groups = [p for rid in ("a", "b") for p in launch.start(rid, 0)]
    try:
        _wait_for([tmp_path / "a0.commit3"])
        lighthouse.kill()  # the quorum host dies mid-run ...
        lighthouse.join(30)
        time.sleep(1.0)
        lighthouse = ctx.Process(target=_serve, args=(port, log))  # ... and is started again on its port
        lighthouse.start()
        for p in groups:
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, Path(log).read_text())
    finally:
        lighthouse.kill()
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in ("a", "b")}
    commits = results["a"]["commits"]
    assert [s for s, _ in commits] == list(range(STEPS)) and results["b"]["commits"] == commits, commits
    assert all(members == ["a", "b"] for _, members in commits)  # min_replicas=2: no step without both
    assert Path(log).read_text().count("[shardwise.ft] lighthouse ") == 2  # two incarnations served the run
    want, exact = _replay(commits), _exact_replay(commits)
    for rid in ("a", "b"):
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, exact[name]), (rid, name, (p - exact[name]).abs().max().item())
            assert (p - want[name]).abs().max().item() < 1e-12, (rid, name)


def test_a_group_that_misses_the_last_step_heals_from_a_finished_one_rather_than_take_it_alone(
        tmp_path: Path) -> None:
    # b stops before its last step until a, which went on without it, has committed that step and
    # ended its loop (a.pt written; a waits in shutdown). b's step fails, and in a final quorum it
    # heals from a to the job's end, taking no step. Regression: b took the last step again alone,
    # on its part of the batch, and ended with parameters no other group had.
    log = io.StringIO()
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.5), heartbeat_timeout=0.5, log=log) as lighthouse:
        launch = _Launch(lighthouse.address, tmp_path, 1, ("a", "b"))
        groups = [*launch.start("a", 0), *launch.start("b", 0, wait_at=(STEPS - 1, "a.pt"))]
        for p in groups:
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in ("a", "b")}
    commits = results["a"]["commits"]
    assert [s for s, _ in commits] == list(range(STEPS)) and commits[-1] == (STEPS - 1, ["a"]), commits
    assert results["b"]["commits"] == commits[:-1] and results["b"]["healed"] == 1, results["b"]
    assert "final: b heals from a" in log.getvalue(), log.getvalue()
    exact = _exact_replay(commits)
    for rid in ("a", "b"):
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, exact[name]), (rid, name, (p - exact[name]).abs().max().item())


def test_a_hung_group_is_left_out_after_the_timeout_and_heals_when_it_wakes(tmp_path: Path) -> None:
    # b stops mid-step 4 (alive, heartbeat beating, never sending its gradients) until a has
    # committed steps 4 to 6 alone: only the fault-tolerance timeout can have let a go on (a then
    # waits at step 7 for b to wake, so that b has a live peer to heal from)
    log = io.StringIO()
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.5), heartbeat_timeout=0.5, log=log) as lighthouse:
        launch = _Launch(lighthouse.address, tmp_path, 1, ("a", "b"))
        groups = [*launch.start("a", 0, wait_at=(7, "b0.failed4")), *launch.start("b", 0, wait_at=(4, "release"))]
        _wait_for([tmp_path / "a0.commit6"])
        (tmp_path / "release").touch()
        for p in groups:
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    results = {rid: torch.load(tmp_path / f"{rid}.pt", weights_only=True) for rid in ("a", "b")}
    commits = results["a"]["commits"]
    assert [s for s, _ in commits] == list(range(STEPS)) and commits[4:7] == [(s, ["a"]) for s in (4, 5, 6)], commits
    assert "left {'b': 'did not ask within join_timeout'}" in log.getvalue() and results["b"]["healed"] >= 1
    want, exact = _replay(commits), _exact_replay(commits)
    for rid in ("a", "b"):
        for name, p in results[rid]["params"].items():
            assert torch.equal(p, exact[name]), (rid, name, (p - exact[name]).abs().max().item())
            assert (p - want[name]).abs().max().item() < 1e-12, (rid, name)
