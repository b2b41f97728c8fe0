"""LocalSGD and DiLoCo across replica groups, each group its own processes, checked against a one-process replay.

Every group starts from the same float64 model and trains alone on its own batches; every
`SYNC_EVERY` inner steps the groups meet (`shardwise.ft._semisync`). Each group records its
parameters after every sync; the test compares them across groups (bit for bit) and with
`_replay`, a few lines that run the same algorithm for both groups in one process.
"""

from __future__ import annotations

import io
import os
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

SYNC_EVERY = 3
DATA = 60
GROUPS = ("a", "b")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _batch(group: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group `group`'s batch at its inner step `t`: its own rows, different from the other group's."""
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(DATA, 6, generator=g, dtype=torch.float64), torch.randn(DATA, 1, generator=g,
                                                                                  dtype=torch.float64)
    rows = torch.randperm(DATA, generator=torch.Generator().manual_seed(1000 * group + t))[:8]
    return xs[rows], ys[rows]


def _inner(algo: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if algo == "localsgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def _outer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, group: int, t: int) -> None:
    opt.zero_grad()
    x, y = _batch(group, t)
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    opt.step()


def _wait_for(paths: list[Path], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s for {[str(p) for p in paths]}")
        time.sleep(0.05)


class Run:
    """One training run of a group: `algo` for `syncs` committed syncs; `fail_sync`: this group
    fails that sync (after its averaging, before its vote); `kill_after`: the group's last
    process kills itself after that inner step; `wait_at`: (sync, file) wait for the file after
    that many committed syncs."""

    def __init__(self, name: str, algo: str, syncs: int, fail_sync: Optional[int] = None,
                 kill_after: Optional[int] = None, wait_at: Optional[tuple[int, str]] = None) -> None:
        self.name, self.algo, self.syncs, self.fail_sync = name, algo, syncs, fail_sync
        self.kill_after, self.wait_at = kill_after, wait_at


def _group(rid: str, address: str, out: str, runs: list[Run], life: int, rank: int, size: int, port: int) -> None:
    """One process of group `rid`: the runs one after another, each with a manager of its own."""
    import shardwise as sw

    mesh = None
    if size > 1:  # the group's own world, as its own launch would start it: fully_shard inside
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
        mesh = sw.init_device_mesh("cpu", (size,))
    for run in runs:
        _train(rid, address, Path(out), run, life, rank, size, mesh)


def _train(rid: str, address: str, folder: Path, run: Run, life: int, rank: int, size: int, mesh: Any) -> None:
    import shardwise as sw
    import shardwise.ft as ft
    from shardwise.fsdp import fully_shard
    from shardwise.ft._semisync import DiLoCo, LocalSGD

    model = _model()
    if mesh is not None:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
    inner = _inner(run.algo, model)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = ft.Manager(load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                    "optim": inner.state_dict()},
                         lighthouse_addr=address, replica_id=f"{rid}{run.name}", timeout=timedelta(seconds=3))
    attempts = [0]
    if run.fail_sync is not None:
        vote = manager.should_commit

        def failing_vote() -> bool:
            if attempts[0] == run.fail_sync:
                manager.report_error(RuntimeError("injected failure"))
            return vote()

        manager.should_commit = failing_vote  # type: ignore[method-assign]
    (folder / f"{rid}{rank}{run.name}.ready{life}").touch()  # (its manager beats: the lighthouse waits for it)
    _wait_for([folder / f"{g}{r}{run.name}.ready0" for g in GROUPS for r in range(size)])  # the first quorum: all
    semi: Any = LocalSGD(manager, model, inner, SYNC_EVERY) if run.algo == "localsgd" else DiLoCo(
        manager, [model], inner, _outer(model), SYNC_EVERY)
    records: list[dict[str, Any]] = []
    t = 0
    with semi:
        while manager.current_step() < run.syncs:
            if run.wait_at is not None and manager.current_step() >= run.wait_at[0]:
                _wait_for([folder / run.wait_at[1]])
            before = manager.current_step()
            _train_step(model, inner, GROUPS.index(rid), t)  # (its step() post-hook syncs every SYNC_EVERY)
            t += 1
            if t % SYNC_EVERY == 0:
                quorum = manager.quorum()
                params = {n: (p.full_tensor() if isinstance(p, sw.DTensor) else p).detach().clone()
                          for n, p in model.named_parameters()}
                records.append({"committed": manager.current_step() > before, "params": params,
                                "members": [m.removesuffix(run.name) for m in quorum.members] if quorum else []})
                attempts[0] += 1
            if run.kill_after is not None and t == run.kill_after and rank == size - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # between two syncs
    if rank == 0:
        torch.save({"records": records, "healed": manager.healed}, folder / f"{rid}{run.name}.pt")
    manager.shutdown()


def _start(ctx: Any, rid: str, address: str, folder: Path, runs: list[Run], size: int, life: int = 0) -> list[Any]:
    port = _free_port()
    procs = [ctx.Process(target=_group, args=(rid, address, str(folder), runs, life, r, size, port))
             for r in range(size)]
    for p in procs:
        p.start()
    return procs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RUNS = [Run("-l", "localsgd", 3), Run("-d", "diloco", 3), Run("-lf", "localsgd", 2, fail_sync=1),
        Run("-df", "diloco", 2, fail_sync=1)]


KILLED = "-k"  # a run in which b dies between two syncs, is started again and heals from a


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of RUNS, then the KILLED one, by name then group (and the lighthouse's log): one
    launch of the two groups runs them in turn (a process start costs seconds here; each run has
    managers of its own)."""
    folder = tmp_path_factory.mktemp("semisync")
    log = io.StringIO()
    ctx = mp.get_context("spawn")
    killed = {"a": Run(KILLED, "diloco", 5, wait_at=(2, f"b0{KILLED}.ready1")),
              "b": Run(KILLED, "diloco", 5, kill_after=SYNC_EVERY + 1)}
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=3.0), heartbeat_timeout=0.5, log=log) as lighthouse:
        a, b = (_start(ctx, rid, lighthouse.address, folder, [*(_failing_in(run, rid) for run in RUNS), killed[rid]], 1)
                for rid in GROUPS)
        b[0].join(240)
        assert b[0].exitcode == -signal.SIGKILL, (b[0].exitcode, log.getvalue())
        b = _start(ctx, "b", lighthouse.address, folder, [Run(KILLED, "diloco", 5)], 1, life=1)  # as the launcher
        for p in (*a, *b):
            p.join(240)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    out: dict[str, Any] = {run: {rid: torch.load(folder / f"{rid}{run}.pt", weights_only=True) for rid in GROUPS}
                           for run in [*(r.name for r in RUNS), KILLED]}
    return {**out, "log": log.getvalue()}


def _failing_in(run: Run, rid: str) -> Run:
    """`run` as group `rid` does it: only b fails its sync."""
    return run if rid == "b" else Run(run.name, run.algo, run.syncs)


def _replay(algo: str, outcomes: list[bool]) -> list[dict[str, torch.Tensor]]:
    """The parameters after each sync, both groups simulated in one process: each trains alone
    from the last synced parameters; a committed sync averages (LocalSGD) or steps the outer
    optimizer on the last synced parameters with the mean pseudo-gradient (DiLoCo); one that
    does not commit puts both back at the last synced parameters."""
    models = [_model() for _ in GROUPS]
    inners = [_inner(algo, m) for m in models]
    synced = _model()
    outer = _outer(synced)
    after: list[dict[str, torch.Tensor]] = []
    for k, committed in enumerate(outcomes):
        for g, (m, o) in enumerate(zip(models, inners)):
            for s in range(SYNC_EVERY):
                _train_step(m, o, g, k * SYNC_EVERY + s)
        with torch.no_grad():
            for name, p in synced.named_parameters():
                local = [dict(m.named_parameters())[name] for m in models]
                if committed and algo == "localsgd":
                    p.copy_((local[0] + local[1]) / 2)
                elif committed:
                    p.grad = ((p - local[0]) + (p - local[1])) / 2
        if committed and algo == "diloco":
            outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for m in models:
                for q, p in zip(m.parameters(), synced.parameters()):
                    q.copy_(p)
        after.append({n: p.detach().clone() for n, p in synced.named_parameters()})
    return after


def _check(results: dict[str, Any], algo: str, outcomes: list[bool]) -> None:
    for rid in GROUPS:
        assert [r["committed"] for r in results[rid]["records"]] == outcomes, (rid, results[rid]["records"])
        assert all(r["members"] == list(GROUPS) for r in results[rid]["records"])
    want = _replay(algo, outcomes)
    for k, expected in enumerate(want):
        a, b = (results[rid]["records"][k]["params"] for rid in GROUPS)
        for name, p in a.items():
            assert torch.equal(p, b[name]), (k, name)  # the groups agree bit for bit after each sync
            assert (p - expected[name]).abs().max().item() < 1e-12, (k, name, p, expected[name])


def test_local_sgd_averages_the_groups_parameters_every_sync_every_steps(results: dict[str, Any]) -> None:
    _check(results["-l"], "localsgd", [True, True, True])
    start = dict(_model().named_parameters())  # (the groups did move: a replay of nothing would not match)
    assert not torch.equal(results["-l"]["a"]["records"][0]["params"]["0.weight"], start["0.weight"])


def test_diloco_steps_the_outer_optimizer_with_the_mean_pseudo_gradient(results: dict[str, Any]) -> None:
    _check(results["-d"], "diloco", [True, True, True])


@pytest.mark.parametrize("name, algo", [("-lf", "localsgd"), ("-df", "diloco")])
def test_a_sync_that_does_not_commit_leaves_every_group_at_the_last_synced_parameters(
        results: dict[str, Any], name: str, algo: str) -> None:
    run = results[name]  # b fails the second sync: a third one follows
    _check(run, algo, [True, False, True])
    for rid in GROUPS:
        first, failed = (run[rid]["records"][k]["params"] for k in (0, 1))
        assert all(torch.equal(failed[n], first[n]) for n in first), rid  # back at the backup, bit for bit


def test_a_killed_group_heals_from_the_live_one_at_the_next_sync(results: dict[str, Any]) -> None:
    run, log = results[KILLED], results["log"]
    assert run["b"]["healed"] >= 1 and f"b{KILLED} heals from a{KILLED}" in log, log
    assert f"left {{'b{KILLED}': 'heartbeat stale'}}" in log, log  # (a went on alone while b was down)
    last = {rid: run[rid]["records"][-1] for rid in GROUPS}
    # b's last quorum holds a: their last sync together or, when a loaded machine made b miss it (past
    # join_timeout), the final quorum in which b heals from a, finished, to the end (no sync taken twice)
    assert last["b"]["members"] == list(GROUPS) and last["a"]["members"] in (["a"], list(GROUPS)), last
    assert all(last[rid]["committed"] for rid in GROUPS), last
    for name, p in last["a"]["params"].items():
        assert torch.equal(p, last["b"]["params"][name]), name


def test_fully_sharded_groups_of_two_sync_their_local_pieces(tmp_path: Path) -> None:
    # DiLoCo only: four more processes are costly here, and LocalSGD moves pieces by the same helpers
    log = io.StringIO()
    ctx = mp.get_context("spawn")
    runs = [Run("-d", "diloco", 2)]
    with Lighthouse(rule=QuorumRule(min_replicas=2, join_timeout=2.0), heartbeat_timeout=0.5, log=log) as lighthouse:
        procs = [p for rid in GROUPS for p in _start(ctx, rid, lighthouse.address, tmp_path, runs, 2)]
        for p in procs:
            p.join(300)  # (a hang guard: 75 s at load 9, over 120 s at load 20)
            assert p.exitcode == 0, (p.exitcode, log.getvalue())
    for run in runs:
        _check({rid: torch.load(tmp_path / f"{rid}{run.name}.pt", weights_only=True) for rid in GROUPS}, run.algo,
               [True, True])


def test_bad_arguments_are_refused_with_the_value_and_the_fix() -> None:
    from shardwise.ft._semisync import DiLoCo, LocalSGD

    model, other = _model(), _model()
    inner, outer = _inner("localsgd", model), _outer(model)
    manager: Any = object()  # (every check comes before the manager is used)
    with pytest.raises(ValueError, match=r"LocalSGD\(sync_every=0\).*at least 1"):
        LocalSGD(manager, model, inner, 0)
    with pytest.raises(ValueError, match=r"optimizer=.*not the model's parameters"):
        LocalSGD(manager, model, _inner("localsgd", other), 2)
    with pytest.raises(ValueError, match=r"fragment_sync_delay=1.*not built"):
        DiLoCo(manager, [model], inner, outer, 4, fragment_sync_delay=1)
    with pytest.raises(ValueError, match=r"model_fragments: 2 fragments"):
        DiLoCo(manager, [model[0], model[2]], inner, outer, 4)
    with pytest.raises(ValueError, match=r"outer_optimizer=.*2 of the model's 4 trainable parameters are not in it"):
        DiLoCo(manager, model, inner, torch.optim.SGD(model[0].parameters(), lr=0.7), 4)
    with pytest.raises(ValueError, match=r"the same object"):
        DiLoCo(manager, model, inner, inner, 4)
