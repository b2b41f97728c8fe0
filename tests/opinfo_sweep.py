"""The OpInfo sweep: every float32 CPU op of PyTorch's `op_db` on DTensors against plain tensors.

Each op runs on up to `samples` of its OpInfo sample inputs (those that run on plain
tensors), every tensor argument split `Shard` on its largest evenly divisible dim (per
mesh dim, `Replicate` if none divides), and every output is compared with the plain
result: its global shape and dtype, then every rank's piece against `torch.chunk` of the
plain result (`tests/oracle.py`), which is `full_tensor()` piece by piece without a
collective per output (`Partial` outputs are reduced with `full_tensor()`). Ops with
random or uninitialised outputs (`RANDOM_OPS`, or any op whose second plain run with the
same seed differs) must run and give the right shapes; their values are not compared.
Outcomes per op:

| status | meaning |
|---|---|
| `pass` | every tried sample matched and no aten call went through the replicated fallback |
| `fallback` | every tried sample matched, but some aten call ran replicated (no strategy) |
| `error` | a sample raised on some rank (`detail`: first line, `aten`: the last aten op dispatched) |
| `mismatch` | a sample ran and gave a wrong value: a silent error, the worst outcome |
| `skip` | no sample of the op runs on plain tensors |

Why the sweep is built the way it is: it runs as ONE multi-rank body per mesh
(`sweep_chunk`) that loops over the ops, because starting a body per op costs more than
most ops. One op must not take the others down, so each op runs inside `try` on every
rank and the ranks then agree on the outcome over a process group of their own (never
one the DTensors use). If the ranks fell out of step (one raised before a collective the
others entered: their collective counts differ), the chunk stops; the harness sees the
uneven counts and replaces the pool, and the driver (`run_sweep`) starts the next chunk
at the next op. A rank that crashes or hangs is caught the same way: rank 0 writes each
op's name before it runs it and each outcome after, to a progress file the driver reads.

Fallback detection wraps DTensor's dispatch entry and the dispatcher's `propagate` (its `OutputSharding.fallback`
flag); errors are attributed to the last aten op dispatched. The dispatch plan cache starts
empty and keeps no plan that ran replicated: it is cleared after any op that fell back
(and when the trace is installed and removed), so every plan an op finds in the cache was
made without a fallback, and an op whose call falls back always reaches `propagate` and is
seen. Ops reuse each other's plans otherwise (the same aten op on the same layouts and
shapes plans the same everywhere); making every plan anew for every sample cost most of
the sweep's time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Optional

import torch

from .oracle import local_piece

__all__ = [
    "MESHES",
    "RANDOM_OPS",
    "RESULTS_PATH",
    "STATUSES",
    "SweepResult",
    "aten_groups",
    "counts",
    "diff_lines",
    "dump",
    "load",
    "mesh_name",
    "op_key",
    "placements_for",
    "run_sweep",
    "sweep_chunk",
    "summary",
    "sweep_ops",
]

STATUSES = ("pass", "fallback", "error", "mismatch", "skip")

# Ops whose values are random or uninitialised: they must run, their values are not compared.
RANDOM_OPS = frozenset(
    {
        "bernoulli", "cauchy", "empty", "empty_like", "empty_permuted", "empty_strided", "exponential",
        "geometric", "log_normal", "multinomial", "new_empty", "new_empty_strided", "normal", "normal.in_place",
        "normal.number_mean", "rand_like", "randint", "randint_like", "randn", "randn_like", "uniform",
        "nn.functional.alpha_dropout", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
        "nn.functional.feature_alpha_dropout.with_train", "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d", "nn.functional.multi_head_attention_forward", "nn.functional.rrelu",
        "pca_lowrank", "svd_lowrank",
    }
)

# The meshes swept and the samples tried per op on each (world size = mesh size).
MESHES: tuple[tuple[tuple[int, ...], int], ...] = (((2,), 2), ((2, 2), 2))
RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "opinfo_results.json")

RTOL, ATOL = 1e-4, 1e-5  # float32, sums re-associated by the split

SweepResult = dict[str, dict[str, Any]]  # op key -> {"status": ..., optional "detail", "aten", ...}


def op_key(op: Any) -> str:
    """`name` or `name.variant`: unique over `op_db`."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def sweep_ops() -> list[Any]:
    """The `op_db` entries with float32 CPU support, in `op_db` order."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def placements_for(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[Any]:
    """Per mesh dim: `Shard` of the largest tensor dim whose (already split) size it divides evenly.

    >>> from shardwise import Shard
    >>> placements_for((4, 6), (2, 2)) == [Shard(1), Shard(0)]
    True
    """
    from shardwise import Replicate, Shard

    local = list(shape)
    out: list[Any] = []
    for n in mesh_shape:
        fits = [d for d in range(len(local)) if local[d] > 0 and local[d] % n == 0]
        if not fits:
            out.append(Replicate())
            continue
        d = max(fits, key=lambda k: (local[k], -k))
        out.append(Shard(d))
        local[d] //= n
    return out


def _map(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(fn, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return value


def _seed(key: str, salt: int = 0) -> None:
    seed = (zlib.crc32(key.encode()) + salt) & 0x7FFFFFFF
    torch.default_generator.manual_seed(seed)  # the CPU generator only: torch.manual_seed also queues CUDA work
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def _call(op: Any, sample: Any) -> Any:
    return op(sample.input, *sample.args, **sample.kwargs)


def _mapped(fn: Callable[[torch.Tensor], Any], sample: Any) -> Any:
    """A sample (input, args, kwargs) with every tensor replaced by `fn(tensor)`."""
    return SimpleNamespace(input=_map(fn, sample.input), args=_map(fn, tuple(sample.args)), kwargs=_map(fn, dict(sample.kwargs)))


def _cloned(sample: Any) -> Any:
    return _mapped(lambda t: t.clone(), sample)


def _pieces(got: Any, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What to compare for one output: this rank's piece and the oracle's piece of `want`.

    Comparing every rank's piece with `torch.chunk` of the plain result checks the same
    thing as comparing `full_tensor()` (the full tensor is the pieces put together) without
    a collective per output; a Partial output has no piece to compare, so it is reduced.
    """
    from shardwise import DTensor, Partial

    if not isinstance(got, DTensor):
        return got, want
    if any(isinstance(p, Partial) for p in got.placements):
        return got.full_tensor(), want
    coordinate = got.device_mesh.get_coordinate()
    assert coordinate is not None
    return got._local_tensor, local_piece(want, tuple(got.device_mesh.shape), got.placements, coordinate, dict(got.shard_order))


def _same(got: Any, want: Any, path: str = "out") -> Optional[str]:
    """None if `got` (DTensors: piece by piece) equals `want`, else a short description of the first difference."""
    from shardwise import DTensor

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{path}: shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
        full, want = _pieces(got, want)
        if full.shape != want.shape:
            return f"{path}: local piece of shape {tuple(full.shape)}, expected {tuple(want.shape)} ({_layout(got)})"
        try:
            torch.testing.assert_close(full, want, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError:
            if want.is_floating_point() or want.is_complex():
                err = (full.double() - want.double()).abs().nan_to_num(math.inf).max().item() if want.numel() else 0.0
                return f"{path}: max abs error {err:.3g}{_layout(got)}"
            bad = int((full != want).sum().item())
            return f"{path}: {bad} of {want.numel()} elements differ{_layout(got)}"
        return None
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{path}: expected a sequence of {len(want)}, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, want)):
            diff = _same(g, w, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(got, torch.Tensor):
        got = got.full_tensor().item() if isinstance(got, DTensor) else got.item()
    if isinstance(want, float) and isinstance(got, (int, float)):
        return None if math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(got) and math.isnan(want)) else f"{path}: {got} != {want}"
    return None if got == want else f"{path}: {got!r} != {want!r}"


def _layout(t: Any) -> str:
    from shardwise import DTensor

    return f" (output {t._spec.layout_str()})" if isinstance(t, DTensor) else ""


def _deterministic(op: Any, sample: Any, key: str, want: Any) -> bool:
    """Whether a second plain run (same seed) gives the same values: not so for random/empty ops."""
    _seed(key, 1)
    again = _call(op, _cloned(sample))
    return _same(again, want) is None


class _Trace:
    """The aten ops dispatched on DTensors (last one kept) and the ones that ran replicated."""

    def __init__(self) -> None:
        self.last: Any = None
        self.seen: dict[str, None] = {}  # every aten op dispatched, in first-call order
        self.fallback: set[str] = set()
        self.fell_back = False  # a plan that runs replicated may be in the plan cache (not reset per sample)

    def reset(self) -> None:
        self.last, self.seen, self.fallback = None, {}, set()

    def forget_fallbacks(self) -> None:
        """Empty the dispatch plan cache if a plan that ran replicated may be in it: a later op
        with the same call then propagates afresh, and its fallback is seen (and counted) again."""
        from shardwise._tensor import _dispatch

        if self.fell_back:
            _dispatch._PLANS.clear()
            self.fell_back = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from shardwise._ops import _plan
        from shardwise._tensor import _dispatch
        from shardwise._tensor._dtensor import DTensor

        # DTensor's dispatch entry (a class attribute), and the propagator as plan making calls it.
        orig_entry, orig_propagate = DTensor.__dict__["__torch_dispatch__"], getattr(_plan, "propagate")

        def entry(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.last = func
            self.seen[str(func)] = None
            return _dispatch.torch_dispatch(cls, func, types, args, kwargs)

        def propagate(schema: Any, rule: Any = None) -> Any:
            result = orig_propagate(schema, rule)
            if result.fallback:
                self.fallback.add(str(schema.op))
                self.fell_back = True
            return result

        # no plan made before (a fallback among them would be found without `propagate`), and
        # none made here (without strict mode) left for what runs after
        _dispatch._PLANS.clear()
        setattr(DTensor, "__torch_dispatch__", classmethod(entry))
        setattr(_plan, "propagate", propagate)
        try:
            yield
        finally:
            setattr(DTensor, "__torch_dispatch__", orig_entry)
            setattr(_plan, "propagate", orig_propagate)
            _dispatch._PLANS.clear()
            self.fell_back = False


def _run_op(op: Any, key: str, mesh: Any, samples: int, trace: _Trace) -> dict[str, Any]:
    """One op's outcome on this rank (never raises), under `trace.installed()`."""
    try:
        return _run_samples(op, key, mesh, samples, trace)
    finally:
        trace.forget_fallbacks()  # no plan that ran replicated left for the next op to find


def _run_samples(op: Any, key: str, mesh: Any, samples: int, trace: _Trace) -> dict[str, Any]:
    from shardwise import distribute_tensor

    mesh_shape = tuple(mesh.shape)
    tried = 0
    fallback: set[str] = set()
    checked = True
    _seed(key)
    try:
        # The samples `op.sample_inputs` yields, without its per-sample bookkeeping (it
        # inspects the call stack for every sample: most of the sweep's time otherwise).
        source = iter(op.sample_inputs_func(op, "cpu", torch.float32, False))
    except Exception as exc:  # the OpInfo cannot even make samples
        return {"status": "skip", "detail": f"sample_inputs: {type(exc).__name__}: {_first_line(exc)}"}
    for n in range(8):  # look at a few samples to find `samples` that run on plain tensors
        if tried >= samples:
            break
        try:
            sample = next(source)
        except StopIteration:
            break
        except Exception:
            break
        try:
            _seed(key, 1)
            want = _call(op, _cloned(sample))
        except Exception:
            continue
        tried += 1
        check = key not in RANDOM_OPS and _deterministic(op, sample, key, want)
        checked = checked and check
        dist_sample = _mapped(
            lambda t: distribute_tensor(t.clone(), mesh, placements_for(tuple(t.shape), mesh_shape), src_data_rank=None),
            sample,
        )
        trace.reset()
        try:
            _seed(key, 1)
            got = _call(op, dist_sample)
            diff = _same(got, want) if check else _ran_only(got, want)
        except Exception as exc:
            return {"status": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}", "aten": _name(trace.last), "sample": n}
        fallback |= trace.fallback
        if diff is not None:  # every aten op of the sample is a suspect
            return {"status": "mismatch", "detail": diff, "sample": n, "aten": list(trace.seen)}
    if tried == 0:
        return {"status": "skip", "detail": "no sample runs on plain tensors"}
    out: dict[str, Any] = {"status": "fallback" if fallback else "pass", "samples": tried}
    if fallback:
        out["aten"] = sorted(fallback)
    if not checked:
        out["values"] = "not compared (random or uninitialised output)"
    return out


def _ran_only(got: Any, want: Any) -> Optional[str]:
    """For random/empty ops: the outputs must exist with the right global and local shapes."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
        piece, expected = _pieces(got, want)
        return None if piece.shape == expected.shape else f"local piece of shape {tuple(piece.shape)}, expected {tuple(expected.shape)}"
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        for g, w in zip(got, want):
            diff = _ran_only(g, w)
            if diff:
                return diff
    return None


def _name(op: Any) -> Optional[str]:
    return None if op is None else str(op)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def _collective_counts(skip: Any) -> dict[str, int]:
    """Collectives issued so far per process group this rank belongs to (the sync group left out)."""
    from torch.distributed import distributed_c10d as c10d

    return {
        pg.group_name: pg._get_sequence_number_for_group()  # type: ignore[attr-defined]
        for pg in c10d._world.pg_map
        if pg is not skip
    }


def _in_step(counts: torch.Tensor) -> bool:
    """Whether every group's members issued the same number of collectives.

    `counts[rank, group]` is the count, -1 where the rank is not in the group.
    """
    return all(len(set(c[c >= 0].tolist())) <= 1 for c in counts.T)


_SYNC: list[Any] = []


def _sync_group() -> Any:
    """A process group of our own for agreeing on outcomes; the DTensors never use it.

    Its timeout outlasts a collective timeout, so a rank stuck in the op's collective
    times out there first and still meets the others here.
    """
    import torch.distributed as dist

    if not _SYNC:
        _SYNC.append(dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=600), backend="gloo"))
    return _SYNC[0]


class _Agreement:
    """The ranks agree on an op's outcome, in one small collective when they already do.

    Each rank sends its status code and its collective count per process group (a fixed
    list of the groups, agreed on once); only when the statuses differ do the ranks
    exchange their full outcomes, so the worst one is recorded with its rank.
    """

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group, self.world = group, dist.get_world_size()
        names: list[Any] = [None] * self.world
        dist.all_gather_object(names, sorted(_collective_counts(group)), group=group)
        self.index = {name: i for i, name in enumerate(sorted({n for ns in names for n in ns}))}

    def __call__(self, mine: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        import torch.distributed as dist

        row = torch.full((1 + len(self.index),), -1, dtype=torch.int64)
        row[0] = STATUSES.index(mine["status"])
        for name, n in _collective_counts(self.group).items():
            if name in self.index:
                row[1 + self.index[name]] = n
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows)
        out_of_step = not _in_step(table[:, 1:])
        if len(set(table[:, 0].tolist())) == 1:
            return mine, out_of_step
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        return _merge(everyone), out_of_step


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One outcome from every rank's: an error anywhere wins, then a mismatch, then a fallback.

    Among errors, a collective's timeout is the symptom and another rank's error the cause.
    """
    timed_out = lambda r: "timed out" in str(r.get("detail", "")).lower()  # noqa: E731
    for status in ("error", "mismatch", "fallback", "skip"):
        for rank, r in sorted(enumerate(per_rank), key=lambda x: timed_out(x[1])):
            if r["status"] == status:
                out = dict(r)
                if status in ("error", "mismatch") and rank:
                    out["rank"] = rank
                return out
    return per_rank[0]


def sweep_chunk(
    mesh_shape: tuple[int, ...],
    keys: list[str],
    samples: int,
    progress: Optional[str] = None,
    budget: float = 1e9,
    extra: Optional[Callable[[], dict[str, Any]]] = None,
) -> dict[str, Any]:
    """The body run on every rank: ops `keys` in order until done, out of step, or out of `budget` seconds.

    `extra()` (a module-level function: it travels by pickle) adds ops to `op_db`'s, by key.
    Returns `{"results": {key: outcome}, "next": index of the first op not run, "times": {key: s}}`.
    """
    import shardwise as sw

    strict = sw._ops.is_strict()
    sw.set_strict(False)  # an op without a strategy is what `fallback` counts, not an error
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's (the trace lists those ops), the samples'
            return _sweep(mesh_shape, keys, samples, progress, budget, extra)
    finally:
        sw.set_strict(strict)


def _sweep(
    mesh_shape: tuple[int, ...],
    keys: list[str],
    samples: int,
    progress: Optional[str],
    budget: float,
    extra: Optional[Callable[[], dict[str, Any]]],
) -> dict[str, Any]:
    import torch.distributed as dist

    import shardwise as sw

    torch.set_default_dtype(torch.float32)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    group = _sync_group()
    agree = _Agreement(group)
    by_key = {op_key(op): op for op in sweep_ops()}
    by_key.update(extra() if extra is not None else {})
    rank = dist.get_rank()
    log = open(progress, "a") if progress and rank == 0 else None
    results: dict[str, Any] = {}
    times: dict[str, float] = {}
    start = time.monotonic()
    trace = _Trace()
    i = 0
    try:
        with trace.installed():
            for i, key in enumerate(keys):
                if time.monotonic() - start > budget:
                    return {"results": results, "next": i, "times": times}
                if log:
                    log.write(json.dumps({"start": key}) + "\n")
                    log.flush()
                t0 = time.monotonic()
                op = by_key.get(key)
                if op is None:
                    mine: dict[str, Any] = {"status": "skip", "detail": "not in this torch's op_db"}
                else:
                    try:
                        mine = _run_op(op, key, mesh, samples, trace)
                    except Exception as exc:  # outside the sample's call: making or gathering inputs
                        mine = {"status": "error", "detail": f"{type(exc).__name__}: {_first_line(exc)}", "aten": _name(trace.last)}
                outcome, out_of_step = agree(mine)
                if out_of_step:
                    outcome = {
                        "status": "error",
                        "detail": "ranks fell out of step (different collective counts): " + str(outcome.get("detail", "")),
                        "aten": outcome.get("aten"),
                    }
                results[key] = outcome
                times[key] = time.monotonic() - t0
                if log:
                    log.write(json.dumps({"done": key, "outcome": outcome}) + "\n")
                    log.flush()
                if out_of_step:  # the harness replaces the pool; the driver goes on at the next op
                    return {"results": results, "next": i + 1, "times": times}
    finally:
        if log:
            log.close()
    return {"results": results, "next": len(keys), "times": times}


def run_sweep(
    mesh_shape: tuple[int, ...],
    samples: int = 2,
    keys: Optional[list[str]] = None,
    chunk_budget: float = 400.0,
    verbose: bool = False,
    extra: Optional[Callable[[], dict[str, Any]]] = None,
) -> tuple[SweepResult, dict[str, float]]:
    """Drive `sweep_chunk` on `prod(mesh_shape)` ranks over every op (or `keys`), surviving crashes.

    Returns (outcome per op key, seconds per op key).
    """
    import tempfile

    from shardwise.testing import DistributedTestError, run_distributed

    if keys is None:
        keys = [op_key(op) for op in sweep_ops()]
    world = math.prod(mesh_shape)
    results: SweepResult = {}
    times: dict[str, float] = {}
    i = 0
    while i < len(keys):
        with tempfile.TemporaryDirectory() as tmp:
            progress = os.path.join(tmp, "progress.jsonl")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # the pool replaced after an out-of-step op
                    out = run_distributed(
                        sweep_chunk, world, mesh_shape, keys[i:], samples, progress, chunk_budget, extra,
                        timeout=chunk_budget + 200.0,
                    )[0]
                results.update(out["results"])
                times.update(out["times"])
                i += out["next"]
            except DistributedTestError as exc:
                done, current = _read_progress(progress)
                results.update(done)
                if current is None:
                    raise
                results[current] = {"status": "error", "detail": f"ranks crashed or hung: {_first_line(exc)}"}
                i = keys.index(current) + 1
                if verbose:
                    print(f"sweep {mesh_shape}: {current} took the pool down; going on from op {i}")
    return results, times


def _read_progress(path: str) -> tuple[SweepResult, Optional[str]]:
    done: SweepResult = {}
    current: Optional[str] = None
    if not os.path.exists(path):
        return done, current
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "start" in rec:
                current = rec["start"]
            else:
                done[rec["done"]] = rec["outcome"]
                current = None
    return done, current


def counts(results: SweepResult) -> dict[str, int]:
    """How many ops have each status."""
    out = {s: 0 for s in STATUSES}
    for r in results.values():
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


def aten_groups(results: SweepResult, status: str) -> list[tuple[str, int, list[str]]]:
    """(aten op, number of ops, a few op keys) for one status, most frequent first."""
    groups: dict[str, list[str]] = {}
    for key, r in results.items():
        if r["status"] != status:
            continue
        atens = r.get("aten")
        for a in atens if isinstance(atens, list) else [atens or "?"]:
            groups.setdefault(a, []).append(key)
    return sorted(((a, len(ks), ks[:5]) for a, ks in groups.items()), key=lambda g: (-g[1], g[0]))


# -- the recorded outcomes (tests/opinfo_results.json) ------------------------------------


def mesh_name(mesh_shape: tuple[int, ...]) -> str:
    """`(2, 2)` -> `"2x2"`: the key of a mesh in the results file."""
    return "x".join(str(n) for n in mesh_shape)


def load(path: str = RESULTS_PATH) -> dict[str, SweepResult]:
    """Recorded outcomes: mesh name -> op key -> outcome."""
    with open(path) as f:
        data = json.load(f)
    return {name: dict(ops) for name, ops in data["meshes"].items()}


def dump(results: dict[str, SweepResult], path: str = RESULTS_PATH) -> None:
    """Write outcomes with their counts, sorted, one op per line (diffs stay readable)."""
    meshes = {name: {k: results[name][k] for k in sorted(results[name])} for name in sorted(results)}
    head = {
        "about": "Per-op outcomes of the OpInfo sweep (tests/opinfo_sweep.py); regenerate with "
        "scripts/update_opinfo_results.py. Statuses: " + ", ".join(STATUSES),
        "torch": torch.__version__.split("+")[0],
        "samples_per_op": {mesh_name(m): n for m, n in MESHES},
        "counts": {name: counts(r) for name, r in meshes.items()},
    }
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)},")
    lines.append('  "meshes": {')
    for i, (name, ops) in enumerate(meshes.items()):
        lines.append(f"    {json.dumps(name)}: {{")
        body = [f"      {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in ops.items()]
        lines.append(",\n".join(body))
        lines.append("    }" + ("," if i < len(meshes) - 1 else ""))
    lines.append("  }")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def diff_lines(old: SweepResult, new: SweepResult) -> list[str]:
    """Human-readable status changes from `old` to `new`."""
    out = []
    for key in sorted(set(old) | set(new)):
        a = old.get(key, {}).get("status", "absent")
        b = new.get(key, {}).get("status", "absent")
        if a != b:
            arrow = "promoted" if b == "pass" else "REGRESSED" if a == "pass" or b == "mismatch" else "changed"
            out.append(f"{arrow}: {key}: {a} -> {b}" + (f" ({new[key].get('detail')})" if key in new and "detail" in new[key] else ""))
    return out


def summary(name: str, results: SweepResult, seconds: Optional[float] = None, top: int = 10) -> str:
    """Counts for one mesh and the aten ops behind most errors, mismatches and fallbacks."""
    c = counts(results)
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    lines = [f"mesh {name}: {len(results)} ops{took}: " + ", ".join(f"{s} {c[s]}" for s in STATUSES)]
    for status in ("mismatch", "error", "fallback"):
        groups = aten_groups(results, status)
        if groups:
            lines.append(f"  top {status} aten ops: " + "; ".join(f"{a} x{n} ({', '.join(ks)})" for a, n, ks in groups[:top]))
    return "\n".join(lines)
