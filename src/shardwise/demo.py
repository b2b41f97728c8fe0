"""The main job: train a small character-level GPT on a (dp, tp) mesh of local processes.

`make demo` / `shardwise demo` starts 4 CPU processes (gloo) through PyTorch's launcher
as a 2 (dp) x 2 (tp) mesh. The model is cut by the built-in Megatron planner over `tp`,
made data parallel over `dp` with parameters, gradients and optimizer state sharded, and
trained with AdamW for about a minute. At the end rank 0 prints the loss curve next to a
single-process run of the same training (they must agree to 1e-4), the memory each rank
holds against the unsharded model, and a picture of how each parameter is laid out (also
written as a PNG). Under torchrun directly: `torchrun --nproc-per-node=4 -m shardwise.demo`.

`--mesh 2x2x2` (pp x dp x tp, 8 processes) trains the same model as a 1F1B pipeline of two
stages, each tensor parallel over tp and ZeRO-3 data parallel over dp, and prints the
pipeline's schedule in place of the layout picture.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

__all__ = ["add_arguments", "main"]

PARITY = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default="2x2", help="dp x tp, e.g. 2x2, 4x1, 1x4 (default 2x2); or pp x dp x tp, "
                        "e.g. 2x2x2: a 1F1B pipeline of tensor-parallel, ZeRO-3 stages")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150, about a minute on 2 cores)")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: dp * tp)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (nccl)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also train in one process and compare the loss curves (default on)")
    parser.add_argument("--shard-parameters", action=argparse.BooleanOptionalAction, default=True,
                        help="shard parameters, gradients and optimizer state over dp (default on)")
    parser.add_argument("--png", default="shardwise-demo-layout.png", help="where to write the layout picture")
    parser.add_argument("--tour", action="store_true", help="instead: a tour of layouts and redistributions")


def _mesh(text: str) -> tuple[int, ...]:
    parts = text.lower().split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--mesh takes dp x tp (like 2x2) or pp x dp x tp (like 2x2x2) as positive numbers, "
                         f"got {text!r}")
    return tuple(int(p) for p in parts)


def main(args: Optional[argparse.Namespace] = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="shardwise demo", description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args()
    if args.tour:
        from ._demo.tour import tour

        return tour()
    try:
        mesh = _mesh(args.mesh)
    except ValueError as exc:
        print(f"shardwise demo: {exc}", file=sys.stderr)
        return 2
    size = math.prod(mesh)
    nproc = args.nproc or size
    if nproc != size:
        print(f"shardwise demo: --nproc {nproc} does not fill the mesh {args.mesh} ({size} processes)", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _worker(args, mesh)
    from ._launch import launch

    flags = [f"--mesh={'x'.join(map(str, mesh))}", f"--steps={args.steps}", f"--device={args.device}", f"--png={args.png}",
             "--compare" if args.compare else "--no-compare",
             "--shard-parameters" if args.shard_parameters else "--no-shard-parameters"]
    return launch(["-n", str(nproc), "-m", "shardwise.demo", *flags])


def _worker(args: argparse.Namespace, mesh: tuple[int, ...]) -> int:
    import torch.distributed as dist

    from ._demo.report import report
    from ._demo.train import DemoConfig, progress_bar, train_reference, train_sharded

    cfg = DemoConfig(mesh=mesh, steps=args.steps, device=args.device, shard_parameters=args.shard_parameters)
    rank = int(os.environ["RANK"])
    if rank == 0:
        dims = " x ".join(f"{n} ({d})" for n, d in zip(mesh, ("pp", "dp", "tp") if len(mesh) == 3 else ("dp", "tp")))
        print(f"shardwise demo: CharGPT on a {dims} mesh of {math.prod(mesh)} {args.device} processes, "
              f"{cfg.steps} AdamW steps, global batch {cfg.batch}", flush=True)
    schedule = None
    if len(mesh) == 3:
        from ._demo.pipelined import train_pipelined
        from .pipeline import Timeline

        result, pipe = train_pipelined(cfg, progress_bar(cfg.steps) if rank == 0 else None)
        schedule = Timeline.from_schedule(pipe.schedule).render_text(width=72)
    else:
        result = train_sharded(cfg, progress_bar(cfg.steps) if rank == 0 else None)
    memory = _gather_memory(result)
    ok = True
    if rank == 0:
        reference = train_reference(cfg) if args.compare else None
        ok = report(cfg, result, memory, reference, args.png, PARITY, schedule)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _gather_memory(result: object) -> list[dict[str, int]]:
    """Every rank's memory numbers, on every rank (in rank order), through a DTensor gather."""
    import torch

    from shardwise import DTensor, Shard

    memory, mesh = result.memory, result.mesh  # type: ignore[attr-defined]
    keys = sorted(memory)
    local = torch.tensor([[memory[k] for k in keys]], dtype=torch.float64, device=mesh.device_type)
    rows = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim).full_tensor().cpu()
    return [{k: int(v) for k, v in zip(keys, row.tolist())} for row in rows]


if __name__ == "__main__":
    raise SystemExit(main())
