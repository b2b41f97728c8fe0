"""The one entry point of the benchmark suite: run the benchmarks, print their tables, write one JSON file.

`python -m bench [--quick] [--only overhead,redistribute,overlap,steps,memory,fsdp,checkpoint,hf_load,cross_mesh,dry_run,planner_quality,context_parallel,long_run,optimizer,pipeline_steps,moe,ft] [--repeats N] [--out FILE]`
(or `python bench/run.py ...`, or `make bench`). Every benchmark runs shardwise and
torch.distributed.tensor side by side in the same gloo worker processes (started by
`shardwise.testing.run_distributed`), interleaved and repeated. Each table is printed with
the load average at the time, since this machine is shared: a number taken under load is
a number to distrust. `--quick` shrinks shapes and repeats for the smoke test; its
timings mean nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/run.py`: the workers import bench.* and tests.models by name
    if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
        sys.path.pop(0)
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from bench._common import Settings, Table

__all__ = ["BENCHMARKS", "NAMES", "benchmarks", "main"]

# In the order they run. Named here, imported by `benchmarks()`: an argument error is reported
# before anything imports torch (seconds on a loaded machine).
NAMES = ("overhead", "redistribute", "overlap", "steps", "memory", "fsdp", "checkpoint", "hf_load", "cross_mesh",
         "dry_run", "planner_quality", "context_parallel", "long_run", "optimizer", "pipeline_steps", "moe", "ft")


def benchmarks() -> dict[str, Callable[[Settings], list[Table]]]:
    """Each benchmark's `run(settings)`, by name, in the order they run (imports them all)."""
    return {name: importlib.import_module(f"bench.{name}").run for name in NAMES}


def __getattr__(name: str) -> Any:  # `BENCHMARKS`, as before: imported on first use
    if name == "BENCHMARKS":
        return benchmarks()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (the smoke test); timings mean nothing")
    p.add_argument("--only", default=",".join(NAMES), help=f"comma-separated subset of {','.join(NAMES)}")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per case and library")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/bench-<time>.json)")
    args = p.parse_args(argv)
    args.names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in NAMES]
    if unknown or not args.names:
        p.error(f"--only {args.only!r}: unknown {unknown or 'empty list'}; choose from {','.join(NAMES)}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats {args.repeats}: needs at least 1 timed sample")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    from bench._common import FULL, QUICK, load_average, machine_info
    from shardwise.testing import shutdown_pools

    runs = benchmarks()
    settings = (QUICK if args.quick else FULL).with_repeats(args.repeats)
    info: dict[str, Any] = machine_info()
    info["load_average_start"] = list(load_average())
    print(f"shardwise vs torch.distributed.tensor {info['torch']} | {info['cpu_count']} cpus | "
          f"load average {' '.join(f'{v:.2f}' for v in info['load_average_start'])} | "
          f"{'QUICK (smoke test sizes: timings mean nothing)' if settings.quick else 'full'} | {settings.repeats} repeats\n",
          flush=True)
    tables: dict[str, Any] = {}
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}  # each benchmark's wall time, where a slow smoke test spends it
    try:
        for name in args.names:
            started = time.monotonic()
            try:
                for table in runs[name](settings):
                    table.load = load_average()
                    print(table.render() + "\n", flush=True)
                    tables[table.name] = table.as_json()
            except Exception as exc:
                errors[name] = "".join(traceback.format_exception(exc))
                print(f"== {name}: FAILED\n{errors[name]}", flush=True)
            seconds[name] = round(time.monotonic() - started, 1)
    finally:
        shutdown_pools()
    info["seconds"] = seconds
    print("wall seconds per benchmark: " + ", ".join(f"{n} {s:g}" for n, s in seconds.items()), flush=True)
    info["load_average_end"] = list(load_average())
    out = args.out or ROOT / "bench" / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": info, "settings": asdict(settings), "benchmarks": tables, "errors": errors}
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"load average at the end {' '.join(f'{v:.2f}' for v in info['load_average_end'])}; results: {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
