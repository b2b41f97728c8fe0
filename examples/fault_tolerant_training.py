"""Replica groups that survive a failure. Run: shardwise run --ft --groups 3 -n 2 examples/fault_tolerant_training.py

Each replica group is one torchrun launch of this script (2 processes here, `fully_shard`
over them). Every step the groups form a quorum, average their gradients and commit the
step only if every group succeeded. With `--kill group1:3`, one process of group1 kills
itself at step 3 after its backward: the other groups go on without it, torchrun restarts
group1 alone, and group1 heals from a live group and trains on with them. At the end each
group prints its committed steps and a checksum of its parameters: they agree. `--hold DIR`
(for a demonstration on a loaded machine): the other groups wait, before asking for a step,
until the victim has started (step 1) and until it is back from its restart (3 steps after
the kill), so that they do not finish before it rejoins.
"""

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

import shardwise.ft as ft
from shardwise.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill", default="", help="GROUP:STEP: one process of GROUP dies at STEP, once")
    parser.add_argument("--hold", default="", help="a folder: the others wait until the victim started and is back")
    args = parser.parse_args()
    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    replica, life = os.environ["SHARDWISE_FT_REPLICA_ID"], int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)  # the same initial model in every group
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    manager = ft.Manager(load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                    "optimizer": optimizer.state_dict()},
                         timeout=timedelta(seconds=5))
    # an HSDP mesh as torchft programs name it: the replica groups are its outer dim, one slot each
    mesh = ft.ft_init_device_mesh("cpu", (1, size), ("dp_replicate", "dp_shard"), replicate_dim=0, manager=manager)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    ddp = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, optimizer)
    victim, _, kill_step = args.kill.partition(":")
    hold = Path(args.hold) if args.hold else None
    if hold is not None and replica == victim:
        (hold / f"{replica}.{rank}.life{life}").touch()  # (about to ask for its first quorum)
    committed = 0
    while manager.current_step() < args.steps:
        if hold is not None and replica != victim:  # (before asking: a group mid-step holds newcomers back)
            step = manager.current_step()
            life_awaited = 1 if kill_step and step >= int(kill_step) + 3 else 0 if step >= 1 else None
            while life_awaited is not None and not all((hold / f"{victim}.{r}.life{life_awaited}").exists()
                                                       for r in range(size)):
                time.sleep(0.05)
        opt.zero_grad()  # the step's quorum; a group behind it heals here
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + int(replica.removeprefix("group")))
        x, y = torch.randn(2 * size, 8, generator=g, dtype=torch.float64), torch.randn(2 * size, 1, generator=g,
                                                                                      dtype=torch.float64)
        mine = slice(2 * rank, 2 * rank + 2)
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        if replica == victim and life == 0 and step >= int(kill_step) and rank == size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        committed += opt.step()
    total = sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())
    if rank == 0:
        print(f"{replica}: {manager.current_step()} steps committed ({committed} in this life, healed "
              f"{manager.healed} time(s)); parameter checksum {total:.15e}", flush=True)
    manager.shutdown()


if __name__ == "__main__":
    main()
