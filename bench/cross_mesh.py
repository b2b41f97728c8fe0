"""Moving a DTensor to another mesh: shardwise's `redistribute(device_mesh=B)` against what a
torch.distributed.tensor user writes today (torch raises on a move across meshes).

The workaround: `full_tensor()` on the source mesh, then `distribute_tensor` of the whole
tensor onto the target mesh; when the target mesh holds ranks that are not in the source
mesh, they first get the whole tensor by a broadcast over the world from rank 0. Three
moves on 4 gloo ranks: the same ranks reshaped ((4,) S(0) -> (2, 2) (R, S(1))), to a
disjoint 2-rank mesh ((2,) S(0) on ranks 0, 1 -> (2,) S(1) on 2, 3), and a training mesh
pushing to a mesh that overlaps it ((2, 2) (R, S(0)) -> (2,) S(1) on ranks 1, 2). Each
result is checked against the tensor; bytes are what the busiest rank receives
(shardwise's comm log), next to the lower bound (its target piece less what it held).
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import Column, Settings, Table, interleaved, per_repeat_max_median, ratio, settle
from ._libs import load, placements

__all__ = ["CASES", "body", "run"]

# name: (source ranks grid, source layout, target ranks grid, target layout)
CASES: dict[str, tuple[Any, str, Any, str]] = {
    "(4,) S0 -> (2, 2) R,S1, same ranks": ([0, 1, 2, 3], "S0", [[0, 1], [2, 3]], "R,S1"),
    "[0, 1] S0 -> [2, 3] S1, disjoint": ([0, 1], "S0", [2, 3], "S1"),
    "(2, 2) R,S0 -> [1, 2] S1, overlapping": ([[0, 1], [2, 3]], "R,S0", [1, 2], "S1"),
}


def body(settings: Settings) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    import shardwise as sw
    from shardwise import comm_log
    from shardwise._comm import P2PRecord
    from shardwise._tensor._cross import cross_move

    rank = dist.get_rank()
    sw_lib, th_lib = load("shardwise"), load("torch")
    full = torch.randn(settings.redistribute_shape, generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    for name, (a_ranks, src, b_ranks, dst) in CASES.items():
        a, b = sw.DeviceMesh("cpu", a_ranks), sw.DeviceMesh("cpu", b_ranks)
        ta, tb = TorchMesh("cpu", a_ranks), TorchMesh("cpu", b_ranks)
        x = sw_lib.distribute_tensor(full, a, placements(sw_lib, src))
        tx = th_lib.distribute_tensor(full, ta, placements(th_lib, src))
        target, torch_target = placements(sw_lib, dst), placements(th_lib, dst)
        b_outside_a = bool(set(b.mesh.flatten().tolist()) - set(a.mesh.flatten().tolist()))

        def ours() -> Any:
            return settle(x.redistribute(b, target).to_local())

        def workaround() -> Any:
            whole = tx.full_tensor() if ta.get_coordinate() is not None else torch.empty_like(full)
            if b_outside_a:
                dist.broadcast(whole, src=0)
            return settle(th_lib.distribute_tensor(whole, tb, torch_target).to_local())

        want = sw_lib.distribute_tensor(full, b, target).to_local()
        with comm_log() as records:
            got = ours()
        ok = torch.equal(got, want) and torch.equal(workaround(), want)
        move = cross_move(x._spec, x.redistribute(b, target)._spec)
        for fn in (ours, workaround):
            for _ in range(settings.warmup):
                fn()
        samples = interleaved({"shardwise": ours, "torch": workaround}, settings.repeats, before=dist.barrier)
        out[name] = {"samples": samples, "ok": ok,
                     "received": sum(r.bytes_received for r in records if isinstance(r, P2PRecord)),
                     "bound": move.plan.lower_bound().get(rank, 0)}
    return out


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    per_rank = run_distributed(body, 4, settings, timeout=settings.timeout)
    shape = settings.redistribute_shape
    table = Table(
        "cross_mesh",
        f"redistribute to another mesh, {shape[0]}x{shape[1]} fp32 on 4 ranks: ms (slowest rank) and bytes the "
        f"busiest rank receives",
        [Column("case", "move"), Column("shardwise", "shardwise ms", ".2f"), Column("torch", "full+distribute ms", ".2f"),
         Column("ratio", "ratio", ".2f"), Column("received", "sw bytes in"), Column("bound", "lower bound"),
         Column("check", "check")],
    )
    for name in CASES:
        results = [r[name] for r in per_rank]
        row: dict[str, Any] = {"case": name}
        for lib in ("shardwise", "torch"):
            value = per_repeat_max_median([r["samples"][lib] for r in results])
            row[lib] = None if value is None else value * 1e3
        row["ratio"] = ratio(row["shardwise"], row["torch"])
        row["received"] = max(r["received"] for r in results)
        row["bound"] = max(r["bound"] for r in results)
        row["check"] = "ok" if all(r["ok"] for r in results) else "WRONG"
        table.rows.append(row)
    table.notes.append("torch has no move across meshes (NotImplementedError); its column is the workaround: "
                       "full_tensor on the source, a broadcast when the target has other ranks, distribute_tensor")
    return [table]
