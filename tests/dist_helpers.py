"""Helpers for multi-rank tests: layouts to sweep and DTensors with a known global value."""

from __future__ import annotations

import datetime
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard

from .oracle import local_piece

Layout = tuple[tuple[Placement, ...], Optional[dict[int, tuple[int, ...]]]]


def layouts(mesh_ndim: int, tensor_ndim: int, partials: Sequence[str] = ("sum",)) -> Iterator[Layout]:
    """Every combination of Shard(d) / Replicate / Partial per mesh dim, plus reversed split orders."""
    choices: list[Placement] = [Shard(d) for d in range(tensor_ndim)] + [Replicate()] + [Partial(op) for op in partials]
    for combo in itertools.product(choices, repeat=mesh_ndim):
        yield combo, None
        for d in range(tensor_ndim):
            ms = tuple(m for m, p in enumerate(combo) if p == Shard(d))
            if len(ms) > 1:
                yield combo, {d: tuple(reversed(ms))}


# The piece a rank should hold: the naive oracle that literally applies torch.chunk.
expected_piece = local_piece


def make_dtensor(full: torch.Tensor, mesh: sw.DeviceMesh, placements: Sequence[Placement],
                 order: Optional[dict[int, tuple[int, ...]]] = None, requires_grad: bool = False) -> DTensor:
    """A DTensor whose global value is `full`, with genuinely different terms on Partial dims."""
    coord = mesh.get_coordinate()
    assert coord is not None
    piece = expected_piece(full, mesh.shape, placements, coord, order).clone()
    for i, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        n, c = mesh.shape[i], coord[i]
        # The terms split along mesh dim i may depend only on which piece is being split: the
        # Shard coordinates and the earlier (outer) Partial coordinates. Along Replicate and
        # later Partial mesh dims they must be identical (the global value reduces innermost first).
        others = tuple(
            x for j, x in enumerate(coord)
            if isinstance(placements[j], Shard) or (j < i and isinstance(placements[j], Partial))
        )
        noise = []
        for k in range(n):
            g = torch.Generator().manual_seed(hash((i, k, others)) & 0xFFFF)
            noise.append(torch.randn(piece.shape, generator=g, dtype=piece.dtype))
        mean = torch.stack(noise).mean(0) if noise else 0
        if p.reduce_op == "sum":
            piece = piece / n + (noise[c] - mean)
        elif p.reduce_op == "avg":
            piece = piece + (noise[c] - mean)
        elif p.reduce_op == "max":
            piece = piece if c == 0 else piece - noise[c].abs()
        else:
            piece = piece if c == 0 else piece + noise[c].abs()
    piece.requires_grad_(requires_grad)
    return DTensor.from_local(piece, mesh, placements, shape=full.shape, stride=full.stride(), shard_order=order)


def seeded(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def rank() -> int:
    return dist.get_rank()


def term_grad_scale(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> float:
    """How much of the full gradient one rank's term of a Partial input gets: a Partial("avg")
    over n ranks counts each term 1/n (a "sum" term counts fully)."""
    scale = 1.0
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            scale /= n
    return scale


def replies_from_processes(target: Callable[..., None], world: int, args: tuple[Any, ...], *, deadline: float,
                           no_reply: Callable[[str], Any], start_method: str = "spawn") -> list[Any]:
    """Start `world` processes running `target(rank, store_port, conn, args)` (each sends one reply
    on `conn`) and collect the replies by rank; `no_reply(status)` stands in for a process that
    sent none ("exit code 3", "no reply (hung)"). Every process is gone when this returns."""
    ctx = mp.get_context(start_method)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    conns, procs = [], []
    for r in range(world):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=target, args=(r, store.port, theirs, args), daemon=True)
        proc.start()
        theirs.close()
        conns.append(ours)
        procs.append(proc)
    until = time.monotonic() + deadline
    results: list[Any] = []
    try:
        for conn, proc in zip(conns, procs):
            if conn.poll(max(until - time.monotonic(), 0)):
                try:
                    results.append(conn.recv())
                    continue
                except EOFError:
                    pass
            proc.join(max(until - time.monotonic(), 0.1))
            results.append(no_reply("no reply (hung)" if proc.exitcode is None else f"exit code {proc.exitcode}"))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    return results


def _outcome_rank(rank: int, port: int, conn: Any, task: tuple[Any, ...]) -> None:
    world, body, args = task
    os.environ["SHARDWISE_COLLECTIVE_TIMEOUT"] = "10"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=10)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        body(*args)
        conn.send(("returned", ""))
    except BaseException as exc:
        notes = "".join(f"\n{n}" for n in getattr(exc, "__notes__", []))
        conn.send((type(exc).__name__, f"{exc}{notes}"))
    conn.close()
    os._exit(0)  # no teardown: the process group may hold sends and collectives that never complete


def run_own_processes(body: Callable[..., None], world: int, *args: Any, deadline: float = 60.0,
                      forkserver: bool = False) -> list[Any]:
    """Run `body(*args)` on `world` fresh gloo processes (SHARDWISE_COLLECTIVE_TIMEOUT=10); per
    rank (exception name, message with its notes) or ("returned", ""), or the exit status of a
    process that sent nothing (one that was killed). `forkserver`: forked from a server that has
    imported torch and shardwise (fast), instead of spawned."""
    if forkserver:
        mp.get_context("forkserver").set_forkserver_preload(["torch", "shardwise", body.__module__])
    return replies_from_processes(_outcome_rank, world, (world, body, args), deadline=deadline,
                                  start_method="forkserver" if forkserver else "spawn",
                                  no_reply=lambda status: (status, ""))
