"""Dry run and automatic planning of a Llama-3-8B-shaped model for a (8, 8) dp x tp mesh, on one process.

shardwise: the HF Llama built on the meta device, cut by `MegatronPlanner` over tp and made
ZeRO-3 over dp on an `AbstractMesh((8, 8))`, then `shardwise.debug.dry_run` of forward,
backward and AdamW step: every collective and the memory per rank reported.
torch: what a torch user does today for the same question (torchtitan's "fake backend"
dry run): a fake process group of 64 ranks (`init_process_group("fake")`), the model cut by
`parallelize_module` (the same Megatron cuts) and `fully_shard` per layer over dp, and the
step run under `FakeTensorMode` (no data); it reports nothing by itself.

The planner table: `AutoPlanner` choosing dp / ZeRO-3 / tp roles for the (8, 8) mesh by dry
runs, and the layout solver alone (`planner._layout_plan.plan_layouts`: the step traced, every
op's strategies as choices, a MILP solved by HiGHS, 32 layers clustered to 2) for the tp dim
of 8 with one dp rank's batch, with the weights' layouts it chose.

Each side runs in a fresh Python process of its own, so its wall time (from importing the
library to the end of the step) and its peak resident memory are its own; importing torch
and transformers is timed apart. A quick run (the smoke test) imports them once in one
process and forks each side from it, side by side. The issue's bar for shardwise: under 60 s
and under 2 GB on this 2-core box.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._common import Column, Settings, Table

__all__ = ["run"]

FULL_MODEL = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
QUICK_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
MESH = (8, 8)


def _shardwise(config: dict[str, Any], seq: int) -> dict[str, Any]:
    import torch
    import transformers

    import shardwise as sw
    from shardwise.debug import dry_run
    from shardwise.parallel import MegatronPlanner, data_parallel, shard_module

    start = time.perf_counter()
    mesh = sw.AbstractMesh(MESH, ("dp", "tp"))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    shard_module(model, MegatronPlanner(), mesh["tp"])
    data_parallel(model, mesh, dp_dim="dp", shard_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model: Any, opt: Any, ids: Any) -> None:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    ids = torch.randint(0, config["vocab_size"], (1, seq))
    report = dry_run(step, model, opt, ids, mesh=mesh)
    return {"seconds": time.perf_counter() - start, "collectives": len(report.collectives),
            "peak_gib": report.memory.peak / 2**30, "params_mib": report.memory.peaks["parameters"] / 2**20}


def _torch(config: dict[str, Any], seq: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=MESH[0] * MESH[1], store=FakeStore())
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    plan: dict[str, Any] = {}
    for i in range(config["num_hidden_layers"]):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config["vocab_size"], (1, seq))
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"seconds": seconds}


def _planner(config: dict[str, Any], seq: int) -> dict[str, Any]:
    import torch
    import transformers

    import shardwise as sw
    from shardwise.planner import AutoPlanner, CostModel

    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    planner = AutoPlanner(sw.AbstractMesh(MESH, ("dp", "tp")), example_inputs=(torch.randint(0, 100, (MESH[0], seq)),),
                          cost=CostModel.gpu_cluster(), memory_budget=80 * 2**30)
    planner.build_plan(model)
    assert planner.report is not None
    chosen = ", ".join(f"{n}={r}" for n, r in zip(planner.report.mesh_dim_names, planner.report.chosen.roles))
    return {"seconds": time.perf_counter() - start, "candidates": len(planner.report.candidates), "chosen": chosen}


def _solver(config: dict[str, Any], seq: int) -> dict[str, Any]:
    import torch
    import transformers

    import shardwise as sw
    from shardwise.planner import CostModel
    from shardwise.planner._layout_plan import plan_layouts

    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    solved = plan_layouts(model, sw.AbstractMesh((MESH[1],), ("tp",)), (torch.randint(0, 100, (1, seq)),),
                          lambda out: out.logits.float().logsumexp(-1).mean(), CostModel.gpu_cluster())
    cuts = {name.rsplit(".", 2)[-2]: str(lay) for name, lay in solved.parameters.items()}
    return {"seconds": time.perf_counter() - start, "solve_seconds": solved.solution.solve_seconds,
            "variables": solved.solution.variables, "optimal": solved.solution.optimal, "cuts": cuts}


SIDES = {"shardwise": _shardwise, "torch": _torch, "planner": _planner, "solver": _solver}


def _import(llama: bool = False) -> float:
    """Seconds to import torch and transformers (timed apart from the run); and transformers'
    Llama, which every side builds, when `llama` (the quick run's: imported once for all sides)."""
    started = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    if llama:
        import transformers.models.llama.modeling_llama  # noqa: F401
    return time.perf_counter() - started


def _side(which: str, quick: bool, imported: float) -> dict[str, Any]:
    config, seq = (QUICK_MODEL, 128) if quick else (FULL_MODEL, 4096)
    out = SIDES[which](config, seq)
    out["import_seconds"] = imported
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _child(which: str, quick: bool) -> None:
    imported = _import()
    print("RESULT " + json.dumps(_side(which, quick, imported)), flush=True)


def _forked(whiches: list[str]) -> int:
    """A quick run's sides: torch and transformers (its Llama too) imported once, then each side
    in a process forked from this one (fresh: no process group, nothing run yet), side by side;
    every side's RESULT line in the order asked, or exit status 1 naming the sides that failed."""
    import tempfile
    import traceback

    imported = _import(llama=True)
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-dry-run-") as folder:
        pids = {}
        for which in whiches:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the side: write its result, and leave without running the parent's cleanup
                code = 1
                try:
                    result = _side(which, True, imported)
                    Path(folder, which + ".json").write_text(json.dumps(result))
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids[which] = pid
        failed = [which for which, pid in pids.items() if os.waitpid(pid, 0)[1] != 0]
        for which in whiches:
            if which not in failed:
                print("RESULT " + Path(folder, which + ".json").read_text(), flush=True)
    if failed:
        print(f"bench.dry_run: {', '.join(failed)} failed (tracebacks above)", file=sys.stderr, flush=True)
        return 1
    return 0


WHICHES = ["shardwise", "torch", "planner", "solver"]


def _measure(whiches: list[str], settings: Settings) -> list[dict[str, Any]]:
    """Each side's result from a fresh process of its own, one after another, so each is timed
    alone. A quick run (whose timings mean nothing: the smoke test's time) starts one process
    that imports torch and transformers once and forks a fresh process per side, side by side."""
    if not settings.quick:
        commands = [[sys.executable, "-m", "bench.dry_run", which] for which in whiches]
        return [_result(args, subprocess.run(args, capture_output=True, text=True, timeout=settings.timeout))
                for args in commands]
    args = [sys.executable, "-m", "bench.dry_run", "--quick", *whiches]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=settings.timeout)
    except BaseException:  # a timeout (or an interrupt): the forked sides go with their parent
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != len(whiches):
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}")
    return [dict(json.loads(line[len("RESULT "):])) for line in lines]


def _result(args: list[str], proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):]))


def run(settings: Settings) -> list[Table]:
    config = QUICK_MODEL if settings.quick else FULL_MODEL
    ours, theirs, planned, solved = _measure(WHICHES, settings)
    rows = [
        {"who": "shardwise dry_run", "seconds": ours["seconds"], "rss": ours["max_rss_mib"],
         "imports": ours["import_seconds"], "reports": f"{ours['collectives']} collectives, peak "
                                                       f"{ours['peak_gib']:.1f} GiB/rank"},
        {"who": "torch fake PG + FakeTensorMode", "seconds": theirs["seconds"], "rss": theirs["max_rss_mib"],
         "imports": theirs["import_seconds"], "reports": "nothing (runs the step only)"},
    ]
    title = (f"dry run of a {config['num_hidden_layers']}-layer, hidden-{config['hidden_size']} Llama step, TP x "
             f"ZeRO-3 on a {MESH} mesh, one process")
    table = Table("dry_run", title, [Column("who", "who"), Column("seconds", "step + sharding s", ".2f"),
                                     Column("rss", "max RSS MiB", ".0f"), Column("imports", "imports s", ".1f"),
                                     Column("reports", "reports")], rows)
    table.notes.append(f"shardwise / torch time: {ours['seconds'] / theirs['seconds']:.2f}x; "
                       f"memory: {ours['max_rss_mib'] / theirs['max_rss_mib']:.2f}x (bar: < 60 s, < 2048 MiB)")
    plan = Table("planner", f"AutoPlanner for the same model on an abstract {MESH} mesh (dp x tp roles, "
                            f"GPU-cluster cost model, 80 GiB budget)",
                 [Column("who", "who"), Column("seconds", "planning s", ".2f"), Column("rss", "max RSS MiB", ".0f"),
                  Column("chosen", "chosen")],
                 [{"who": "shardwise AutoPlanner", "seconds": planned["seconds"], "rss": planned["max_rss_mib"],
                   "chosen": f"{planned['chosen']} of {planned['candidates']} candidates"},
                  {"who": "shardwise layout solver (MILP, tp dim)", "seconds": solved["seconds"],
                   "rss": solved["max_rss_mib"],
                   "chosen": f"{solved['variables']} variables, solved in {solved['solve_seconds']:.2f} s"
                             f"{'' if solved['optimal'] else ' (time limit)'}: " + _cuts(solved["cuts"])},
                  {"who": "autoparallel (published, 64 GPUs)", "seconds": 51.6, "rss": None,
                   "chosen": "ILP build 15.1 s + solve 36.5 s (autoparallel#438)"}])
    plan.notes.append(f"shardwise / autoparallel planning time: {planned['seconds'] / 51.6:.2f}x (bar: < 10 s); "
                      "autoparallel needs PyTorch nightly, so its figure is the published one, not run here")
    return [table, plan]


def _cuts(cuts: dict[str, str]) -> str:
    """The solver's layouts of the weights, grouped: `q_proj,k_proj (S(0)); o_proj (S(1))`."""
    by: dict[str, list[str]] = {}
    for name, lay in cuts.items():
        by.setdefault(lay, []).append(name)
    return "; ".join(f"{','.join(names)} {lay}" for lay, names in by.items())


if __name__ == "__main__":
    # `python -m bench.dry_run SIDE`: one side, a full run's process; `--quick SIDE...`: the quick run's, forked
    if sys.argv[1] == "--quick":
        raise SystemExit(_forked(sys.argv[2:]))
    _child(sys.argv[1], "--quick" in sys.argv[2:])
