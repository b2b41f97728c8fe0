"""What every benchmark shares: sizes per mode, interleaved timing, rank aggregation, tables, machine facts.

The suite compares two libraries in the same processes, so the one rule that keeps the
numbers honest lives here: `interleaved` times the contenders in alternation, rotating
which goes first on each repeat, so a burst of load from another process on this shared
machine lands on both instead of on whichever happened to run then. Bodies run on every
rank (DTensor programs are SPMD) and return raw per-rank samples; the parent reduces them
(`max_over_ranks` of per-rank medians, or per repeat for synchronised steps).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

__all__ = [
    "Settings",
    "FULL",
    "QUICK",
    "Table",
    "Column",
    "interleaved",
    "median",
    "ratio",
    "max_over_ranks",
    "per_repeat_max_median",
    "machine_info",
    "load_average",
    "quiet",
    "settle",
    "local_bytes",
    "close",
    "one_process_world",
    "on_first_rank",
]


@dataclass(frozen=True)
class Settings:
    """Sizes and repeat counts of one run: `FULL` (the issue's shapes) or `QUICK` (the smoke test's)."""

    quick: bool
    repeats: int  # timed samples per case and library (redistribute, steps)
    op_repeats: int  # timed samples per op and contender of the per-op benchmark
    inner: int  # calls per timed sample of the per-op benchmark
    warmup: int  # untimed calls before timing (fills both libraries' propagation caches)
    redistribute_shape: tuple[int, int]
    mlp: tuple[int, int, int]  # (model dim, hidden dim, batch)
    gpt: tuple[int, int, int, int, int, int]  # (vocab, d_model, heads, seq, layers, batch)
    fsdp: tuple[int, int, int]  # (pre-norm MLP blocks, width, rows per rank) of the sharded data parallel step
    hf_load: tuple[int, int, int, int, str]  # Llama (hidden, MLP width, layers, vocab) and save_pretrained's max_shard_size
    timeout: float  # seconds a benchmark body may take on the workers

    def with_repeats(self, repeats: Optional[int]) -> "Settings":
        if repeats is None:
            return self
        return Settings(**{**asdict(self), "repeats": repeats})


FULL = Settings(
    quick=False,
    repeats=15,
    # Many short samples: with 4 ranks on 2 cores every rank is descheduled about half the
    # time, and a sample of ~0.2 ms is usually spared, so the median is the unpreempted cost.
    op_repeats=201,
    inner=20,
    warmup=50,
    redistribute_shape=(1024, 1024),
    mlp=(1024, 4096, 64),
    gpt=(256, 128, 4, 64, 4, 16),
    fsdp=(16, 256, 16),
    hf_load=(512, 1536, 4, 4096, "20MB"),
    timeout=600.0,
)
QUICK = Settings(
    quick=True,
    # One timed sample and one warm-up call: a quick run's timings mean nothing, and what it
    # checks (every row there, every row's own check) needs each step run, not repeated. A
    # compiled step still gets its eager first call, its traced call (the warm-up) and a replay.
    repeats=1,
    op_repeats=3,
    inner=5,
    warmup=1,
    redistribute_shape=(64, 64),
    mlp=(64, 256, 8),
    gpt=(64, 32, 4, 8, 2, 4),  # tests/models.py's GPTConfig() and batch
    fsdp=(2, 16, 2),
    hf_load=(64, 128, 2, 128, "100KB"),
    timeout=300.0,
)


@dataclass(frozen=True)
class Column:
    """One table column: the row key, its header, and how a value prints (`{:...}` spec)."""

    key: str
    header: str
    fmt: str = ""


@dataclass
class Table:
    """A benchmark's result: rows of plain values (they go to JSON as they are) and notes."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def render(self) -> str:
        cells = [[c.header for c in self.columns]]
        for row in self.rows:
            cells.append([_cell(row.get(c.key), c.fmt) for c in self.columns])
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [f"== {self.title}   [load average {self.load[0]:.2f} {self.load[1]:.2f} {self.load[2]:.2f}, "
                 f"{os.cpu_count()} cpus]"]
        for j, r in enumerate(cells):
            lines.append("  ".join(v.ljust(w) if not c.fmt else v.rjust(w) for v, w, c in zip(r, widths, self.columns)))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"  * {n}" for n in self.notes)
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": [asdict(c) for c in self.columns], "rows": self.rows,
                "notes": self.notes, "load_average": list(self.load)}


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) or not fmt:
        return str(value)
    return format(value, fmt)


def interleaved(
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    inner: int = 1,
    before: Optional[Callable[[], object]] = None,
    after: Optional[Callable[[], object]] = None,
) -> dict[str, list[float]]:
    """Seconds per call of each contender, `repeats` samples each, timed in rotating alternation.

    Sample r times contender (r + i) mod k as the i-th of the k: every contender goes first
    equally often. `before` runs untimed ahead of each sample (a barrier keeps ranks in step);
    `after` runs inside the timed region (finishing asynchronous work).
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = contenders[name]
            if before is not None:
                before()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            if after is not None:
                after()
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    """ours / theirs, or None when either is missing or theirs is not positive."""
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


def max_over_ranks(values: Sequence[Optional[float]]) -> Optional[float]:
    """The slowest rank's value (None if any rank has none)."""
    if not values or any(v is None for v in values):
        return None
    return max(v for v in values if v is not None)


def per_repeat_max_median(per_rank: Sequence[Sequence[float]]) -> Optional[float]:
    """Median over repeats of the slowest rank's sample: for steps that start together after a barrier."""
    if not per_rank or not all(per_rank):
        return None
    return float(statistics.median(max(s) for s in zip(*per_rank)))


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@contextlib.contextmanager
def quiet(seen: Optional[set[str]] = None) -> Iterator[None]:
    """Silence both libraries' warnings and torch's distributed log lines; collect warning first lines in `seen`."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if seen is not None:
        seen.update(str(w.message).strip().splitlines()[0][:160] for w in caught if str(w.message).strip())


def settle(t: torch.Tensor) -> torch.Tensor:
    """Wait for an asynchronous collective's result (torch DTensor's functional collectives return lazily)."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def local_bytes(t: Any) -> int:
    """Bytes this rank holds for a tensor or DTensor of either library."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return int(t.numel() * t.element_size())


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> bool:
    """Same shape and values within `tol` (relative to the reference's magnitude)."""
    if got.shape != want.shape:
        return False
    if want.numel() == 0:
        return True
    scale = max(1.0, float(want.double().abs().max()))
    return float((got.double() - want.double()).abs().max()) <= tol * scale


def one_process_world(settings: Settings) -> int:
    """The pool a one-process measurement runs on (`on_first_rank`): its own 1-process pool in a
    full run; in a quick run the 2-rank pool the other benchmarks start anyway (a pool start is
    seconds of `import torch`), where rank 0 runs it alone."""
    return 2 if settings.quick else 1


def on_first_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on rank 0 alone, None on the others at once (a run_distributed body for one
    process's measurement on a pool of more: `fn` must issue no collectives)."""
    import torch.distributed as dist

    return fn(*args) if dist.get_rank() == 0 else None
