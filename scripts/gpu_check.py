"""The device check: one prepared run that records what shardwise does on a lent GPU (or on the CPU).

    bash scripts/gpu_check.sh OUTDIR          # one CUDA GPU, NCCL; 8 minutes at most
    bash scripts/gpu_check.sh --cpu OUTDIR    # the same sections on the CPU with gloo, about a minute
    bash scripts/gpu_check.sh --cpu --side-by-side OUTDIR   # the test suite's rehearsal: all at once

It writes OUTDIR/summary.md (tables to read) and OUTDIR/summary.json (the same numbers), plus
OUTDIR/logs/<section>.log (each section's whole output) and the profiler traces of section 6.

Why this shape: device time comes in short slices and a rerun costs minutes, so one run must
bring back everything it can even when a part of it breaks or hangs. The parent process never
imports torch. Each section runs in child processes of its own (this script with `--child NAME`,
pytest, or the demo's launcher) under its own time limit, and comes back as "ok", "failed"
(with the last lines of its error) or "skipped" (with why). A section that runs out of time is
killed with its process group and is "failed", keeping what its child had written so far; when
the total budget is spent, the sections left are "skipped: out of time". The summaries are
always written, and the exit status is 0 unless they could not be.

Every timing is a median of host wall-clock samples; on CUDA the device is synchronised only
where a section says so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BUDGET = {"cuda": 450.0, "cpu": 90.0}  # seconds for the whole run
MIN_START = {"cuda": 15.0, "cpu": 3.0}  # a section with less time than this left is skipped
TAIL_LINES = 30  # lines of a failure's output kept in the summaries
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, by a word of the device name

# ---------------------------------------------------------------------------------------------
# The parent: sections, their time limits, the summaries
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """One isolated part of the check: `run(ctx)` returns its result (status, facts, rows, notes)."""

    name: str
    title: str
    budget: dict[str, float]  # seconds, by mode
    run: Callable[["Context"], dict[str, Any]]


@dataclass
class Context:
    """What a section's parent-side function needs: the mode, where to write, its deadline."""

    mode: str  # "cuda" or "cpu"
    outdir: Path
    deadline: float  # time.monotonic() by which the section must be done
    section: str

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def launch(self, cmd: list[str], env: Optional[dict[str, str]] = None,
               limit: Optional[float] = None) -> tuple[Optional[int], str]:
        """Run `cmd` from the repository root in a process group of its own; (exit status, or None
        when it ran out of time and was killed with its children, and its output). The output
        is appended to this section's log."""
        timeout = max(1.0, min(self.left(), limit if limit is not None else self.left()))
        if self.mode == "cpu":  # one thread per process: on a shared machine, no spinning threads' noise
            env = {"OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            code: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            stop(proc)
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a grandchild we could not reach holds the pipe
                out = ""
            code = None
            out += f"\n[gpu_check: killed after {timeout:.0f} s]\n"
        with open(self.outdir / "logs" / f"{self.section}.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n{out}\n")
        return code, out

    def child(self, name: str) -> dict[str, Any]:
        """Run this script's worker `name` in a child process; its result, or a failure with the
        child's last lines (keeping the rows it had written when it was stopped)."""
        result_path = self.outdir / "logs" / f"{name}.json"
        result_path.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--child", name, "--result",
               str(result_path), "--deadline", str(time.time() + self.left() - 2), str(self.outdir)]
        if self.mode == "cpu":
            cmd.insert(2, "--cpu")
        code, out = self.launch(cmd)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        if code == 0 and result:
            return result
        why = "ran out of time" if code is None else f"exited with status {code}"
        return {**result, "status": "failed", "error": f"the child {why}:\n{tail(out)}"}


def stop(proc: subprocess.Popen[str]) -> None:
    """End a timed-out command and everything it started: SIGTERM to its process group (torchrun
    then stops its workers), SIGKILL after 5 s to the group and to every descendant found
    before (torchrun starts each worker in a session of its own)."""
    family = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in family:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc (Linux); [] where there is none."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_environment(ctx: Context) -> dict[str, Any]:
    """What ran the check (torch, CUDA, the device, NCCL, CPUs, Python, the commit)."""
    return ctx.child("environment")


def run_device_tests(ctx: Context) -> dict[str, Any]:
    """tests/device (tests written to run on a real device) with SHARDWISE_TEST_DEVICE set."""
    if not (ROOT / "tests" / "device").is_dir():
        return {"status": "skipped", "reason": "tests/device does not exist in this checkout"}
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/device", "-p", "no:cacheprovider"]
    code, out = ctx.launch(cmd, env={"SHARDWISE_TEST_DEVICE": ctx.mode})
    counts = pytest_counts(out)
    row = {"command": " ".join(cmd[1:]), **counts}
    result: dict[str, Any] = {"columns": [["command", "command", ""]] + [[k, k, ""] for k in counts], "rows": [row]}
    if code == 0:
        return {**result, "status": "ok"}
    if code == 5:
        return {**result, "status": "skipped", "reason": "pytest collected no tests in tests/device"}
    why = "ran out of time" if code is None else f"pytest exited with status {code}"
    return {**result, "status": "failed", "error": f"{why}:\n{tail(out)}"}


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line ("3 passed, 1 failed in 2.0s")."""
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found:
            return {("error" if word.startswith("error") else word): int(n) for n, word in found}
    return {}


def run_demo(ctx: Context) -> dict[str, Any]:
    """`shardwise demo` (CharGPT, (dp, tp) mesh, loss compared with one process) for 3 steps.

    On CUDA the demo's processes use NCCL, which refuses two ranks on one GPU; so 1x1 is the
    run that must pass, and 1x2 is a probe whose failure is recorded with its cause. On the
    CPU, 1x1 (one gloo process: a rehearsal; section 6 runs two ranks)."""
    meshes = {"cuda": [("1x1", True), ("1x2", False)], "cpu": [("1x1", True)]}[ctx.mode]
    rows, errors, notes = [], [], []
    for mesh, required in meshes:
        cmd = [sys.executable, "-m", "shardwise.cli", "demo", "--device", ctx.mode, "--steps", "3", "--mesh", mesh,
               "--png", str(ctx.outdir / f"demo-{mesh}.png")]
        limit = None if required else max(1.0, min(60.0, ctx.left() - 1))
        code, out = ctx.launch(cmd, limit=limit)
        row: dict[str, Any] = {"mesh": mesh, "exit": "timeout" if code is None else code, **demo_numbers(out)}
        rows.append(row)
        if code != 0:
            message = f"--mesh {mesh}: {'ran out of time' if code is None else f'exit status {code}'}:\n{tail(out, 12)}"
            if required:
                errors.append(message)
            else:
                notes.append(f"probe (not counted): {message}")
    result = {"columns": [["mesh", "mesh", ""], ["exit", "exit", ""], ["tokens_per_s", "tokens/s", ".0f"],
                          ["first_loss", "first loss", ".4f"], ["last_loss", "last loss", ".4f"],
                          ["parity", "vs one process", ""]], "rows": rows, "notes": notes}
    if errors:
        return {**result, "status": "failed", "error": "\n".join(errors)}
    return {**result, "status": "ok"}


def demo_numbers(output: str) -> dict[str, Any]:
    """tokens/s, the loss curve's ends and the parity verdict from the demo's report."""
    out: dict[str, Any] = {}
    trained = re.search(r"trained \d+ steps in [\d.]+ s \(([\d,]+) tokens/s\): loss ([\d.]+) -> ([\d.]+)", output)
    if trained:
        out["tokens_per_s"] = float(trained.group(1).replace(",", ""))
        out["first_loss"], out["last_loss"] = float(trained.group(2)), float(trained.group(3))
    parity = re.search(r"^parity: (.*)$", output, re.MULTILINE)
    if parity:
        out["parity"] = parity.group(1).split(":")[-1].strip()
    return out


def run_in_child(name: str) -> Callable[[Context], dict[str, Any]]:
    def run(ctx: Context) -> dict[str, Any]:
        return ctx.child(name)

    run.__doc__ = f"The worker {name!r}, in a child process."
    return run


# In the order they run. The device tests (the suite's own, and the most variable in time) go
# last, so that on a slow machine they, not the measurements, are what runs out of time.
SECTIONS = [
    Section("environment", "environment", {"cuda": 30, "cpu": 15}, run_environment),
    Section("demo", "shardwise demo, 3 steps", {"cuda": 70, "cpu": 30}, run_demo),
    Section("per_op", "per-op host overhead, 1-rank mesh, 8x8 fp32", {"cuda": 45, "cpu": 20}, run_in_child("per_op")),
    Section("llama", "Llama train steps on a 1-rank tensor-parallel mesh", {"cuda": 150, "cpu": 30},
            run_in_child("llama")),
    Section("overlap", "fully_shard: all_gather overlapped with compute, 2 ranks", {"cuda": 55, "cpu": 30},
            run_in_child("overlap")),
    Section("device_tests", "device tests (tests/device)", {"cuda": 100, "cpu": 40}, run_device_tests),
]


def check(mode: str, outdir: Path, budget: Optional[float] = None, only: Optional[list[str]] = None,
          side_by_side: bool = False) -> dict[str, Any]:
    """Run the sections in order (those in `only`, when given) within the total budget
    (TOTAL_BUDGET unless given; the sections' own budgets scale with it); the summary as one dict.

    `side_by_side` (the CPU rehearsal's option, see `main`): the chosen sections all start at
    once, each in its own thread of this process (they only wait on their children), and each
    may use the whole total budget, since they share the wall clock; the summary is the same."""
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    total = budget or TOTAL_BUDGET[mode]
    scale = total / TOTAL_BUDGET[mode]
    start = time.monotonic()
    end = start + total
    summary: dict[str, Any] = {"mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "total_budget_s": total, "sections": {}}

    def run_section(section: Section, limit: float) -> dict[str, Any]:
        began = time.monotonic()
        ctx = Context(mode, outdir, began + limit, section.name)
        try:
            result = section.run(ctx)
        except Exception as exc:  # a bug in this script's own section code: recorded, the rest goes on
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - began, 1)
        result["budget_s"] = round(limit, 1)
        return result

    def record(section: Section, result: dict[str, Any]) -> None:
        summary["sections"][section.name] = {"title": section.title, **result}
        print(f"gpu_check: {section.name}: {result['status']} ({result.get('seconds', 0)} s)", flush=True)

    if side_by_side:
        chosen = [s for s in SECTIONS if only is None or s.name in only]
        results: dict[str, dict[str, Any]] = {}
        if total >= MIN_START[mode]:
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(chosen))) as pool:
                futures = {pool.submit(run_section, s, total): s for s in chosen}
                for future in concurrent.futures.as_completed(futures):
                    results[futures[future].name] = future.result()
                    print(f"gpu_check: {futures[future].name} done", flush=True)
        for section in SECTIONS:
            if only is not None and section.name not in only:
                record(section, {"status": "skipped", "reason": "not chosen (--only)"})
            else:
                record(section, results.get(section.name, {"status": "skipped", "reason": "out of time"}))
        summary["seconds"] = round(time.monotonic() - start, 1)
        return summary
    for section in SECTIONS:
        result: dict[str, Any]
        left = end - time.monotonic()
        if only is not None and section.name not in only:
            result = {"status": "skipped", "reason": "not chosen (--only)"}
        elif left < MIN_START[mode]:
            result = {"status": "skipped", "reason": "out of time"}
        else:
            result = run_section(section, min(section.budget[mode] * scale, left))
        record(section, result)
    summary["seconds"] = round(time.monotonic() - start, 1)
    return summary


def render(summary: dict[str, Any]) -> str:
    """summary.md: one part per section, facts and rows as Markdown tables."""
    env = summary["sections"].get("environment", {}).get("facts", {})
    device = env.get("device_name", "?")
    lines = [f"# shardwise device check ({summary['mode']}: {device})", "",
             f"Started {summary['started']}; took {summary['seconds']} s of a {summary['total_budget_s']:.0f} s budget.",
             "Times are medians of host wall-clock samples.", "",
             "| section | status | seconds |", "|---|---|---|"]
    for name, s in summary["sections"].items():
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', '-')} |")
    for i, (name, s) in enumerate(summary["sections"].items(), 1):
        title = s["title"] + (f" ({s['device']})" if s.get("device") else "")
        lines += ["", f"## {i}. {title}: {s['status']}", ""]
        if s.get("reason"):
            lines += [f"Skipped: {s['reason']}", ""]
        if s.get("facts"):
            lines += ["| fact | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in s["facts"].items()] + [""]
        if s.get("rows"):
            columns = s["columns"]
            lines += ["| " + " | ".join(c[1] for c in columns) + " |", "|" + "---|" * len(columns)]
            for row in s["rows"]:
                lines.append("| " + " | ".join(cell(row.get(c[0]), c[2]) for c in columns) + " |")
            lines.append("")
        lines += [f"* {n}" for n in s.get("notes", [])]
        if s.get("error"):
            lines += ["", "```", s["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value).replace("|", "/").replace("\n", " ")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo (a quick rehearsal)")
    parser.add_argument("--budget", type=float, help="total seconds (default: 450 on CUDA, 90 on the CPU); "
                        "each section's own limit scales with it")
    parser.add_argument("--only", help="run only these sections (comma-separated names, e.g. llama,overlap: "
                        f"a rerun of what failed); the names: {', '.join(s.name for s in SECTIONS)}")
    parser.add_argument("--side-by-side", action="store_true",
                        help="with --cpu only: start the sections all at once, each allowed the whole --budget "
                             "(the test suite's rehearsal: its timings mean nothing, what counts is that every "
                             "section runs and comes back ok; a device run times one section at a time)")
    parser.add_argument("--child", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("outdir", help="where to write summary.md, summary.json, logs and traces")
    args = parser.parse_args(argv)
    mode = "cpu" if args.cpu else "cuda"
    outdir = Path(os.environ.get("GPU_CHECK_CALLER_DIR", os.getcwd())) / args.outdir
    if args.child:
        return run_worker(args.child, mode, outdir, Path(args.result), args.deadline)
    only = args.only.split(",") if args.only else None
    unknown = sorted(set(only or ()) - {s.name for s in SECTIONS})
    if unknown:
        parser.error(f"--only {args.only}: no section named {', '.join(unknown)}")
    if args.side_by_side and mode != "cpu":
        parser.error("--side-by-side is for the CPU rehearsal (--cpu): on a device each section is timed alone")
    summary = check(mode, outdir, args.budget, only, args.side_by_side)
    try:
        (outdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        (outdir / "summary.md").write_text(render(summary))
    except OSError as exc:
        print(f"gpu_check: could not write the summaries in {outdir}: {exc}", file=sys.stderr)
        return 1
    print(f"gpu_check: wrote {outdir / 'summary.md'} and summary.json in {summary['seconds']} s\n")
    print(render(summary))
    return 0


# ---------------------------------------------------------------------------------------------
# The workers: run in a child process each (`--child NAME`); they import torch
# ---------------------------------------------------------------------------------------------


@dataclass
class Worker:
    """A child's view: the device, the output folder, its deadline, and the result it writes
    (rewritten after every step, so a child stopped for time still brings back what it had)."""

    device: str
    outdir: Path
    result_path: Path
    deadline: float  # time.time()
    result: dict[str, Any]

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        """Write the result whole or not at all: a child killed while saving leaves the last one."""
        part = self.result_path.with_suffix(".part")
        part.write_text(json.dumps(self.result, default=str))
        os.replace(part, self.result_path)


def run_worker(name: str, mode: str, outdir: Path, result_path: Path, deadline: Optional[float]) -> int:
    worker = Worker(mode, outdir, result_path, deadline or time.time() + 60, {"status": "ok"})
    WORKERS[name](worker)
    worker.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written: tearing down process groups (NCCL's may hang) is not worth the budget


def environment(w: Worker) -> None:
    """Versions and sizes a reader needs to interpret every other number in the summary."""
    import torch
    import torch.distributed as dist

    facts: dict[str, Any] = {"mode": w.device, "torch": torch.__version__, "cuda (torch built with)": torch.version.cuda,
                             "cuda available": torch.cuda.is_available(), "python": platform.python_version(),
                             "cpu count": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update({"device_name": props.name, "device memory GiB": round(props.total_memory / 2**30, 1),
                      "device count": torch.cuda.device_count(), "bf16 peak flops (assumed)": peak_flops(props.name)})
    if w.device == "cpu":
        facts["device_name"] = f"cpu ({platform.processor() or platform.machine()})"
    facts["nccl available"] = dist.is_available() and dist.is_nccl_available()
    if facts["nccl available"] and torch.cuda.is_available():
        version = torch.cuda.nccl.version()  # a tuple, or an int in older builds
        facts["nccl version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    facts["gloo available"] = dist.is_available() and dist.is_gloo_available()
    try:
        facts["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        facts["transformers"] = "not installed"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        facts["git commit"] = commit.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError) as exc:
        facts["git commit"] = f"skipped: {exc}"
    w.result["facts"] = facts
    if w.device == "cuda" and not torch.cuda.is_available():
        w.result.update(status="failed", error="CUDA is not available to torch on this machine")


def peak_flops(device_name: str) -> Optional[float]:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def init_one_rank(device: str) -> None:
    """A world of one process: the group every 1-rank mesh below is cut from (NCCL on CUDA)."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the OS picks a free one
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else f"cpu, {os.cpu_count()} cores"


PER_OP = ("add", "mul scalar", "mm S(0)xR", "sum", "relu", "softmax", "layer_norm")  # from bench/overhead.py


def per_op(w: Worker) -> None:
    """Host time per call of small ops, where the library's own work is all there is to see.

    On 8x8 tensors the kernel is negligible, so (DTensor call - plain call on the local
    tensor) is what each library adds on the host: propagation lookup, wrapping, dispatch. Both
    libraries on a 1-rank mesh of this device, timed interleaved with the plain op (bench's
    `interleaved`: the order rotates every repeat), the median per contender. On CUDA the
    device is synchronised between samples, never inside one: the samples are host time."""
    import torch

    sys.path.insert(0, str(ROOT))  # bench/ lives beside src/
    from bench._common import close, interleaved, median
    from bench._libs import LIBS, load
    from bench.overhead import OPS

    init_one_rank(w.device)
    repeats, inner = (101, 20) if w.device == "cuda" else (21, 10)
    sync = torch.cuda.synchronize if w.device == "cuda" else None
    torch.manual_seed(0)
    a, b = torch.randn(8, 8, device=w.device), torch.randn(8, 8, device=w.device)
    args: dict[str, tuple[Any, ...]] = {"plain": (a, b, b)}
    for name in LIBS:
        lib = load(name)
        mesh = lib.init_device_mesh(w.device, (1,))
        args[name] = (lib.distribute_tensor(a, mesh, [lib.Shard(0)]), lib.distribute_tensor(b, mesh, [lib.Shard(0)]),
                      lib.distribute_tensor(b, mesh, [lib.Replicate()]))
    rows: list[dict[str, Any]] = []
    w.result.update(device=device_name(w.device), rows=rows, columns=[
        ["op", "op", ""], ["plain_us", "plain us", ".2f"], ["shardwise_us", "shardwise us", ".2f"],
        ["torch_us", "torch DTensor us", ".2f"], ["shardwise_overhead_us", "shardwise ovh", ".2f"],
        ["torch_overhead_us", "torch ovh", ".2f"], ["ratio", "ovh ratio sw/torch", ".2f"], ["check", "check", ""]],
        notes=[f"{repeats} interleaved samples of {inner} calls each per contender; overhead = median of "
               "(DTensor sample - plain sample); ratio > 1: shardwise adds more than torch"])
    for op_name in PER_OP:
        op = OPS[op_name]
        want = op(a, b, b)
        calls = {name: (lambda op=op, xs=xs: op(*xs)) for name, xs in args.items()}
        wrong = [name for name in LIBS if not close(calls[name]().full_tensor(), want)]
        for fn in calls.values():
            for _ in range(10):
                fn()
        samples = interleaved(calls, repeats, inner, before=sync)
        us = {name: 1e6 * (median(s) or 0.0) for name, s in samples.items()}
        row: dict[str, Any] = {"op": op_name, "plain_us": us["plain"], "check": "ok" if not wrong else f"WRONG: {wrong}"}
        for name in LIBS:
            row[f"{name}_us"] = us[name]
            row[f"{name}_overhead_us"] = 1e6 * (median([s - p for s, p in zip(samples[name], samples["plain"])]) or 0.0)
        torch_ovh = row["torch_overhead_us"]
        row["ratio"] = row["shardwise_overhead_us"] / torch_ovh if torch_ovh > 0 else None
        rows.append(row)
        if wrong:
            w.result.update(status="failed", error=f"{op_name}: result differs from the op on one device for {wrong}")
        w.save()


LLAMA: dict[str, tuple[dict[str, Any], int, int]] = {  # (LlamaConfig keywords, batch, sequence length)
    "cuda": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048), 4, 2048),
    # the rehearsal's: one layer (every layer is cut and stepped alike; the compiled variant's two
    # traces, most of this section's time on the CPU, grow with the layers)
    "cpu": (dict(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=32), 2, 32),
}
LLAMA_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise"}
VARIANTS = ("plain", "shardwise", "shardwise compiled", "torch DTensor")


def train_step(model: Any, opt: Any, ids: Any) -> Any:
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.detach()


def llama(w: Worker) -> None:
    """Whole train steps of a Llama (about 0.9B parameters in bf16 on CUDA, a tiny fp32 one on
    the CPU): forward, backward and AdamW, the load a user brings.

    Each decoder layer is cut by the Megatron plan (q/k/v/gate/up column-wise, o/down row-wise)
    with `parallelize_module` on a 1-rank mesh: nothing is split, but every projection, its
    gradient and its optimizer update go through DTensor dispatch, so the time over plain torch
    is the library's host cost at a real model's size. Variants, one at a time (memory), each
    from the same seed: plain torch; shardwise eager; `shardwise.compile` of the whole step
    (call 1 creates the optimizer state, call 2 traces, the timed calls replay); torch's DTensor
    with its own `parallelize_module`. A step is timed with the device synchronised before and
    after. MFU = 6 * parameters * tokens/s / the device's bf16 peak (attention's own FLOPs left
    out), null on the CPU."""
    try:
        import transformers
    except ImportError as exc:
        w.result.update(status="skipped", reason=f"transformers is not importable: {exc}")
        return
    import torch

    transformers.utils.logging.set_verbosity_error()
    init_one_rank(w.device)
    config_kwargs, batch, seq = LLAMA[w.device]
    dtype = torch.bfloat16 if w.device == "cuda" else torch.float32
    config = transformers.LlamaConfig(**config_kwargs)
    peak = peak_flops(device_name(w.device)) if w.device == "cuda" else None
    warmup, timed = (2, 5) if w.device == "cuda" else (2, 4)
    rows: list[dict[str, Any]] = []
    w.result.update(device=device_name(w.device), rows=rows, notes=[], columns=[
        ["variant", "variant", ""], ["step_ms", "step ms", ".1f"], ["tokens_per_s", "tokens/s", ".0f"],
        ["mfu", "MFU", ".3f"], ["vs_plain", "time / plain", ".2f"], ["first_loss", "first loss", ".4f"],
        ["loss_diff", "max loss diff vs plain", ".1e"], ["peak_gib", "peak GiB", ".1f"], ["error", "error", ""]])
    losses: dict[str, list[float]] = {}
    for variant in VARIANTS:
        row: dict[str, Any] = {"variant": variant}
        rows.append(row)
        if w.left() < (20 if w.device == "cuda" else 3):
            row["error"] = "skipped: out of time"
            continue
        try:
            while True:
                try:
                    row.update(llama_variant(variant, config, dtype, w.device, batch, seq, warmup, timed))
                    break
                except torch.cuda.OutOfMemoryError:
                    if variant != "plain" or batch == 1:
                        raise
                    batch //= 2
                    w.result["notes"].append(f"out of memory: batch lowered to {batch}")
                    free_memory()
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        free_memory()
        losses[variant] = row.pop("losses", [])
        tokens = batch * seq
        if row.get("step_ms"):
            row["tokens_per_s"] = tokens / (row["step_ms"] / 1e3)
            row["mfu"] = 6 * row["parameters"] * row["tokens_per_s"] / peak if peak else None
            if rows[0].get("step_ms"):
                row["vs_plain"] = row["step_ms"] / rows[0]["step_ms"]
        if losses.get(variant) and losses.get("plain"):
            row["loss_diff"] = max(abs(x - y) for x, y in zip(losses[variant], losses["plain"]))
        w.save()
    params = next((r["parameters"] for r in rows if r.get("parameters")), 0)
    w.result["notes"] += [
        f"{params / 1e6:.4g}M parameters, {dtype}, batch {batch} x seq {seq} = "
        f"{batch * seq} tokens per step, {config.num_hidden_layers} layers, AdamW (fused on CUDA); "
        f"{warmup} warm-up steps (compiled: 1 eager + trace + 1 replay), median of {timed} timed steps",
        "MFU counts 6 x parameters x tokens (no attention FLOPs) against a bf16 peak of "
        f"{peak:.3g} FLOP/s" if peak else "MFU: no peak known for this device"]
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-3
    if all(r.get("error") == "skipped: out of time" for r in rows):
        w.result.update(status="skipped", reason="out of time")
        return
    problems = [f"{r['variant']}: {r['error']}" for r in rows[:3] if r.get("error")]
    problems += [f"{r['variant']}: losses differ from plain by {r['loss_diff']:.2e} (tolerance {tolerance})"
                 for r in rows[1:3] if (r.get("loss_diff") or 0) > tolerance]
    if problems:
        w.result.update(status="failed", error="\n".join(problems))


def llama_variant(variant: str, config: Any, dtype: Any, device: str, batch: int, seq: int, warmup: int,
                  timed: int) -> dict[str, Any]:
    """Build one variant from seed 0, step it `warmup` times, then time `timed` steps."""
    import warnings

    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    parameters = sum(p.numel() for p in model.parameters())
    if variant != "plain":
        shard_llama(model, "torch" if variant == "torch DTensor" else "shardwise", device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    step: Any = train_step
    if variant == "shardwise compiled":
        import shardwise

        step = shardwise.compile(train_step)
        warmup += 1  # call 1 makes the optimizer state, call 2 traces, call 3 is the first replay
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    losses, times = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(warmup + timed):
            sync()
            start = time.perf_counter()
            loss = step(model, opt, ids)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - start)
            losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    out: dict[str, Any] = {"parameters": parameters, "step_ms": 1e3 * sorted(times)[len(times) // 2],
                           "first_loss": losses[0], "losses": losses}
    if device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if variant == "shardwise compiled" and step.programs() != 1:
        said = sorted({str(c.message).splitlines()[0][:200] for c in caught if "compile" in str(c.message)})
        out["error"] = f"{step.programs()} programs traced, want 1 (it ran eagerly?): {said}"
    return out


def shard_llama(model: Any, lib: str, device: str) -> None:
    """Cut every decoder layer by LLAMA_TP over a 1-rank mesh of `lib` (shardwise or torch)."""
    if lib == "shardwise":
        from shardwise import init_device_mesh
        from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    else:  # the reference we compare with
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
            ColwiseParallel, RowwiseParallel, parallelize_module)
    mesh = init_device_mesh(device, (1,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {path: styles[style]() for path, style in LLAMA_TP.items()})


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def overlap(w: Worker) -> None:
    """Whether fully_shard's prefetching gather of the next unit runs while this unit computes.

    Overlap needs a real gather, so more than one rank: two processes (shardwise.testing's
    gloo workers) on this one device, as NCCL refuses two ranks on one GPU; on CUDA a 1-D mesh
    over both ranks uses their gloo group with CUDA tensors (as tests/device does). A few pre-norm MLP blocks, each its own
    `fully_shard` unit, step with AdamW; torch.profiler records 3 steps after a warm-up and
    exports a chrome trace per rank into OUTDIR. From the trace: the time covered by all_gather
    events, and the fraction of it during which compute ran (matmul/activation/norm ops on the
    CPU; any non-communication kernel on the GPU)."""
    from shardwise.testing import run_distributed, shutdown_pools

    try:
        per_rank = run_distributed(overlap_body, 2, w.device, str(w.outdir), timeout=max(5.0, w.left() - 5))
    finally:
        shutdown_pools()
    w.result.update(device=device_name(w.device), rows=per_rank, columns=[
        ["rank", "rank", ""], ["gathers", "all_gather events", ""], ["gather_ms", "gather ms", ".2f"],
        ["overlapped_ms", "overlapped ms", ".2f"], ["fraction", "fraction overlapped", ".2f"],
        ["compute_ms", "compute ms", ".2f"], ["trace", "trace", ""]])
    names = sorted({n for r in per_rank for n in r.pop("gather_names")})
    w.result["notes"] = ["gather and compute times are unions of event intervals over 3 profiled steps; "
                         f"gather events: {', '.join(names) or 'none'}"]
    if any(r["gathers"] == 0 for r in per_rank):
        w.result.update(status="failed", error="no all_gather events in a rank's trace: nothing to measure")


def overlap_body(device: str, outdir: str) -> dict[str, Any]:
    """On each of the 2 ranks: build, shard, warm up, profile 3 steps, measure the trace."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    import shardwise as sw
    from shardwise.fsdp import fully_shard

    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(0)
    width, rows, blocks = (1024, 2048, 6) if device == "cuda" else (256, 64, 4)
    mesh = sw.init_device_mesh(device, (2,))  # the whole world: the workers' gloo group, CUDA tensors too
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                          nn.Linear(4 * width, width)) for _ in range(blocks)]).to(device)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(rows, width, device=device, generator=None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
    path = Path(outdir) / f"overlap-trace-rank{rank}.json"
    prof.export_chrome_trace(str(path))
    return {"rank": rank, "trace": path.name, **trace_overlap(json.loads(path.read_text()), device)}


COMPUTE_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::gelu", "aten::gelu_backward",
               "aten::native_layer_norm", "aten::native_layer_norm_backward"}


def trace_overlap(trace: dict[str, Any], device: str) -> dict[str, Any]:
    """The all_gather time of a chrome trace and how much of it overlaps compute (unions of intervals)."""
    gathers, compute, names = [], [], set()
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name, span = str(e.get("name", "")).lower(), (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if "all_gather" in name or "allgather" in name:
            gathers.append(span)
            names.add(str(e["name"]))
        elif (e.get("cat") == "kernel" and "nccl" not in name) if device == "cuda" else name in COMPUTE_OPS:
            compute.append(span)
    g, c = union(gathers), union(compute)
    gather_us = sum(b - a for a, b in g)
    both = sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in g for a2, b2 in c)
    return {"gathers": len(gathers), "gather_names": sorted(names), "gather_ms": gather_us / 1e3, "overlapped_ms": both / 1e3,
            "fraction": both / gather_us if gather_us else None, "compute_ms": sum(b - a for a, b in c) / 1e3}


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `spans`."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


WORKERS: dict[str, Callable[[Worker], None]] = {"environment": environment, "per_op": per_op, "llama": llama,
                                                "overlap": overlap}

if __name__ == "__main__":
    sys.exit(main())
