"""The fault-tolerance benchmark's job on torchft 0.2 (`bench/ft.py`), run by the scratch environment's python.

`python -m bench._ft_torchft '<json config>'` with `PYTHONPATH` at the repository: never
imported by shardwise, and torchft is no dependency of it. Modes:

- `lighthouse`: torchft's `LighthouseServer` on the given port, until killed;
- `ft`: a replica group of one rank (torchft's HSDP, `ft_init_device_mesh`, is left out: the
  groups here are one process each), `torchft.Manager` over `ProcessGroupGloo`, its
  `DistributedDataParallel` and `OptimizerWrapper`, synchronous quorum (healing at the start
  of the step, as shardwise's). The same model, data and per-step JSON lines as
  `bench/_ft_worker.py`'s `ft` mode, which `bench/_ft_run.py` reads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from bench._ft_worker import _data, _model, _wait

__all__ = ["main"]


def _lighthouse(cfg: dict[str, Any]) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{cfg['port']}", min_replicas=1, join_timeout_ms=1000,
                              heartbeat_timeout_ms=500)
    print(f"torchft lighthouse at {server.address()}", flush=True)
    while True:
        time.sleep(1)


def _part(items: list[int], i: int, n: int) -> list[int]:
    size, extra = divmod(len(items), n)
    start = i * size + min(i, extra)
    return items[start:start + size + (i < extra)]


def _ft(cfg: dict[str, Any]) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    out, rid, life = Path(cfg["out"]), cfg["rid"], int(cfg["life"])
    if life > 0:
        (out / f"armed.{rid}.{life}.0").touch()
        _wait(out / f"go.{rid}.{life}")
    started = time.time()
    port = int(os.environ["MASTER_PORT"])
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the group's own (1 rank)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    timeout = timedelta(seconds=cfg["timeout"])
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=60),
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=cfg["lighthouse"], replica_id=rid, init_sync=False)
    transfers: list[float] = []
    transport = manager._checkpoint_transport
    recv = transport.recv_checkpoint

    def timed_recv(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return recv(*args, **kwargs)
        finally:
            transfers.append(time.perf_counter() - t)

    transport.recv_checkpoint = timed_recv  # type: ignore[method-assign]
    ddp = DistributedDataParallel(manager, model)
    optim = OptimizerWrapper(manager, opt)
    xs, ys = _data()
    (out / f"ready.{rid}.{life}.0").touch()
    if life == 0:
        for g in cfg["groups"]:
            _wait(out / f"ready.{g}.0.0")
    log = open(out / f"events.{rid}.{life}", "a")
    log.write(json.dumps({"started": started, "ready": time.time()}) + "\n")
    steps, batch = int(cfg["steps"]), int(cfg["batch"])
    while manager.current_step() < steps:
        if manager.current_step() >= steps - 1:
            _wait(out / "finish")
        if cfg.get("pace"):
            time.sleep(cfg["pace"])
        t0, wall = time.perf_counter(), time.time()
        before, n_transfers = manager.current_step(), len(transfers)
        optim.zero_grad()  # the quorum (and the heal's fetch)
        t1 = time.perf_counter()
        step = manager.current_step()
        members, member = manager.num_participants(), manager.participating_rank()
        g = torch.Generator().manual_seed(step)
        order = torch.randperm(len(xs), generator=g)[:batch].tolist()
        rows = _part(order, member or 0, max(1, members))
        torch.nn.functional.mse_loss(ddp(xs[rows]), ys[rows]).backward()
        committed = manager.should_commit()  # (OptimizerWrapper.step, with the outcome kept)
        if committed:
            opt.step()
        t2 = time.perf_counter()
        quorum = manager._quorum_id
        log.write(json.dumps({"step": step, "ok": committed, "t": wall, "end": time.time(), "quorum_s": t1 - t0,
                              "step_s": t2 - t0, "healed": len(transfers) > n_transfers,
                              "transfer_s": sum(transfers[n_transfers:]) or None,
                              "heal_in_quorum": None, "quorum": quorum, "behind": step != before,
                              "members": [None] * members}) + "\n")
        log.flush()
        (out / f"progress.{rid}.tmp").write_text(str(manager.current_step()))
        os.replace(out / f"progress.{rid}.tmp", out / f"progress.{rid}")
    torch.save({n: p.detach().clone() for n, p in model.state_dict().items()}, out / f"params.{rid}.pt")
    log.write(json.dumps({"done": time.time(), "committed": manager.current_step()}) + "\n")
    log.close()
    manager.shutdown(wait=False)
    del store  # (the group's store, kept alive until here)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    (_lighthouse if cfg["mode"] == "lighthouse" else _ft)(cfg)


if __name__ == "__main__":
    main()
