"""One process of the fault-tolerance benchmark (`bench/ft.py`): a rank of a shardwise.ft replica group, or of plain HSDP.

Run as `python -m bench._ft_worker '<json config>'` with the group's own world in the
environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`), as `shardwise run --ft`
starts each group. Modes:

- `ft`: a rank of replica group `rid` (`fully_shard` over the group's ranks when it has
  more than one), its gradients averaged across the groups by `shardwise.ft`. A restarted
  life waits, with torch imported (a hot spare), for the file `go.<rid>.<life>` that the
  bench writes when it kills the life before it. Rank 0 writes one JSON line per step
  (`events.<rid>.<life>`) and, at the end, its full parameters (`params.<rid>.pt`).
- `hsdp`: a rank of one world of groups x ranks processes, `fully_shard` on a (groups, ranks)
  mesh (replicate x shard), no fault tolerance: the healthy-step baseline.
- `lighthouse`: the quorum service on a given port, in a process the bench kills and restarts.

Every step trains on its part of the committed step's global batch (`ReplicaSampler`): the
same data whatever groups are alive.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["main"]

DATA = 4096  # samples of the synthetic regression set
WIDTH = 64


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(DATA, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(DATA, 1, generator=g, dtype=torch.float64))


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(4 * WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)).double()


def _wait(path: Path, seconds: float = 600.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s for {path}")
        time.sleep(0.01)


def _shard(model: torch.nn.Sequential, mesh: Any) -> None:
    from shardwise.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _ft(cfg: dict[str, Any]) -> None:
    import shardwise as sw
    import shardwise.ft as ft
    from datetime import timedelta

    out, rid, life = Path(cfg["out"]), cfg["rid"], int(cfg["life"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from shardwise.fsdp import fully_shard  # noqa: F401 - (imported before a spare waits)

    if life > 0:  # a hot spare: started early, released by the kill of the last life
        (out / f"armed.{rid}.{life}.{rank}").touch()
        _wait(out / f"go.{rid}.{life}")
    started = time.time()
    model = _model()
    if size > 1:
        _shard(model, sw.init_device_mesh("cpu", (size,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    manager = ft.Manager(load_state_dict=load,
                         state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                         lighthouse_addr=cfg["lighthouse"], replica_id=rid, timeout=timedelta(seconds=cfg["timeout"]))
    transfers: list[float] = []
    receive = manager._receive  # (timed: the state transfer alone, apart from the quorum around it)

    def timed_receive(src: int) -> None:
        t = time.perf_counter()
        receive(src)
        transfers.append(time.perf_counter() - t)

    manager._receive = timed_receive  # type: ignore[method-assign]
    ddp = ft.DistributedDataParallel(manager, model)
    optim = ft.Optimizer(manager, opt)
    sampler = ft.ReplicaSampler(DATA, cfg["batch"], manager)
    xs, ys = _data()
    (out / f"ready.{rid}.{life}.{rank}").touch()
    if life == 0:  # the groups started together join one quorum
        for g in cfg["groups"]:
            for r in range(size):
                _wait(out / f"ready.{g}.0.{r}")
    log = open(out / f"events.{rid}.{life}", "a") if rank == 0 else None
    if log is not None:
        log.write(json.dumps({"started": started, "ready": time.time()}) + "\n")
    steps = int(cfg["steps"])
    while manager.current_step() < steps:
        if manager.current_step() >= steps - 1:
            _wait(out / "finish")  # the bench: every group is up, so none is left with nobody to heal from
        if cfg.get("pace"):  # (the quick run: slower steps, so that its kills find their spares ready)
            time.sleep(cfg["pace"])
        t0, wall = time.perf_counter(), time.time()
        healed, n_transfers = manager.healed, len(transfers)
        optim.zero_grad()
        t1 = time.perf_counter()
        step = manager.current_step()
        quorum = manager.quorum()
        rows = sampler.indices() if quorum is not None else list(range(size))
        torch.nn.functional.mse_loss(ddp(xs[rows]), ys[rows]).backward()
        ok = optim.step()
        t2 = time.perf_counter()
        if log is not None:
            log.write(json.dumps({"step": step, "ok": ok, "t": wall, "end": time.time(), "quorum_s": t1 - t0,
                                  "step_s": t2 - t0, "healed": manager.healed > healed,
                                  "transfer_s": sum(transfers[n_transfers:]) or None,
                                  "heal_in_quorum": bool(quorum is not None and quorum.heal_from),
                                  "members": list(quorum.members) if quorum is not None else [],
                                  "quorum": quorum.quorum_id if quorum is not None else None}) + "\n")
            log.flush()
            (out / f"progress.{rid}.tmp").write_text(str(manager.current_step()))
            os.replace(out / f"progress.{rid}.tmp", out / f"progress.{rid}")
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.state_dict().items()}
    if rank == 0:
        torch.save(params, out / f"params.{rid}.pt")
        assert log is not None
        log.write(json.dumps({"done": time.time(), "committed": manager.current_step()}) + "\n")
        log.close()
    manager.shutdown()


def _hsdp(cfg: dict[str, Any]) -> None:
    import shardwise as sw
    import torch.distributed as dist

    groups, ranks = int(cfg["groups_n"]), int(cfg["ranks"])
    mesh = sw.init_device_mesh("cpu", (groups, ranks), mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank()
    model = _model()
    _shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from shardwise.ft import ReplicaSampler

    sampler = ReplicaSampler(DATA, cfg["batch"])
    xs, ys = _data()
    times = []
    for step in range(int(cfg["steps"])):
        t0 = time.perf_counter()
        opt.zero_grad()
        rows = sampler.indices(step=step, members=groups, member=rank // ranks, rank=rank % ranks, ranks=ranks)
        torch.nn.functional.mse_loss(model(xs[rows]), ys[rows]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(cfg["out"], "hsdp.json").write_text(json.dumps({"step_s": times}))
    dist.destroy_process_group()


def _lighthouse(cfg: dict[str, Any]) -> None:
    """The quorum service in a process of its own, so that the bench can kill it (every group's
    connection to it is then refused) and start it again on its port: an incarnation after the
    first is a hot spare (imported, waiting for its `go` file)."""
    from shardwise.ft import Lighthouse, QuorumRule

    if cfg.get("go"):
        _wait(Path(cfg["go"]), 3600.0)
    with open(cfg["log"], "a") as log:
        Lighthouse(port=int(cfg["port"]), rule=QuorumRule(min_replicas=1, join_timeout=1.0), heartbeat_timeout=0.5,
                   log=log).serve()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    import logging

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    {"ft": _ft, "hsdp": _hsdp, "lighthouse": _lighthouse}[cfg["mode"]](cfg)


if __name__ == "__main__":
    main()
