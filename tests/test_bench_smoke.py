"""The benchmark suite runs end to end: `python -m bench --quick` prints every table and row and writes its JSON.

One quick run (tiny shapes, 1 repeat) in a subprocess, as `make bench` would start it,
shared by the tests below. No timing is asserted; what is asserted is that every
benchmark row is there for both libraries, and that every row's own check passed: both
libraries computed the single-device result, the train steps left every copy with the
same parameters, and the dispatcher spy counted shardwise's bytes exactly as
`shardwise.comm_log()` did (so its counts for torch can be trusted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.overhead import MESHES, OPS
from bench.redistribute import CASES

pytestmark = pytest.mark.multirank  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"python -m bench --quick exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert out.exists(), f"no JSON written to {out}\n{proc.stdout[-2000:]}"
    return proc, json.loads(out.read_text())


def test_quick_run_writes_machine_info(quick_run: Any) -> None:
    _, record = quick_run
    machine = record["machine"]
    for key in ("cpu_count", "torch", "timestamp", "load_average_start", "load_average_end"):
        assert machine.get(key) is not None, f"machine info lacks {key}: {machine}"
    assert len(machine["load_average_start"]) == 3 and len(machine["load_average_end"]) == 3
    assert {"overhead", "moe"} <= set(machine["seconds"]) and all(s >= 0 for s in machine["seconds"].values())
    assert record["settings"]["quick"] is True
    assert record["errors"] == {}
    assert set(record["benchmarks"]) == {"overhead", "redistribute", "overlap", "steps", "memory", "fsdp", "checkpoint",
                                         "collective_bookkeeping", "hf_load", "cross_mesh", "dry_run", "planner", "planner_quality", "planner_pipeline",
                                         "planner_quality_llama", "context_parallel", "long_run",
                                         "optimizer", "pipeline_steps", "moe", "ft"}


def test_fsdp_rows_train_alike_with_one_collective_per_unit(quick_run: Any) -> None:
    _, record = quick_run
    rows = {r["who"]: r for r in record["benchmarks"]["fsdp"]["rows"]}
    assert set(rows) == {"torch", "shardwise fully_shard", "data_parallel"}
    for r in rows.values():
        assert r["check"] == "ok", r
        assert r["peak"] > 0 and isinstance(r["step_ms"], float), r
    ours, theirs = rows["shardwise fully_shard"]["collective_counts"], rows["torch"]["collective_counts"]
    assert ours == theirs == {"all_gather": 4, "reduce_scatter": 2}, (ours, theirs)  # 2 blocks: 2 forward + 2 backward


def test_every_overhead_row_is_there_for_both_libraries(quick_run: Any) -> None:
    proc, record = quick_run
    rows = record["benchmarks"]["overhead"]["rows"]
    assert [(r["mesh"], r["op"]) for r in rows] == [(str(m), op) for m in MESHES for op in OPS]
    for r in rows:
        assert r["check"] == "ok", r
        for key in ("plain", "shardwise_time", "torch_time", "shardwise_overhead", "torch_overhead"):
            assert isinstance(r[key], float), (key, r)  # not the ratio: None when torch's overhead drowns in noise
    assert "per-op overhead" in proc.stdout and "load average" in proc.stdout
    for op in OPS:
        assert op in proc.stdout


def test_every_redistribute_row_has_time_and_bytes(quick_run: Any) -> None:
    proc, record = quick_run
    rows = record["benchmarks"]["redistribute"]["rows"]
    want = [(str(shape), f"({s})->({d})") for shape, cases in CASES.items() for s, d in cases]
    assert [(r["mesh"], r["transition"]) for r in rows] == want
    for r in rows:
        assert r["check"] == "ok", r  # results right for both; spy bytes == comm_log bytes for shardwise
        for name in ("shardwise", "torch"):
            assert isinstance(r[f"{name}_ms"], float) and isinstance(r[f"{name}_bytes"], int), r
    for _, transition in want:
        assert transition in proc.stdout
    # A transition that moves data must show bytes for both; (R)->(S0) moves none for either.
    moved = {r["transition"]: (r["shardwise_bytes"], r["torch_bytes"]) for r in rows if r["mesh"] == "(4,)"}
    assert moved["(R)->(S0)"] == (0, 0) and all(b > 0 for b in moved["(S0)->(R)"])


def test_train_steps_and_memory_rows(quick_run: Any) -> None:
    proc, record = quick_run
    steps = record["benchmarks"]["steps"]["rows"]
    assert [r["model"].split()[0:2] for r in steps] == [["TP", "MLP"], ["GPT", "2"]]
    for r in steps:
        assert r["check"] == "ok", r  # every copy ended with the single-process parameters
        assert all(isinstance(r[k], float) for k in ("plain_ms", "shardwise_ms", "torch_ms", "ratio")), r
    memory = {r["who"]: r for r in record["benchmarks"]["memory"]["rows"]}
    assert set(memory) == {"1 process", "shardwise", "torch"}
    single = memory["1 process"]
    for name in ("shardwise", "torch"):
        # Half the MLP's weights live on each of the 2 ranks, so each holds less than one process does.
        assert 0 < memory[name]["params"] < single["params"]
        assert memory[name]["peak"] < single["peak"]
    assert "memory of the TP MLP step" in proc.stdout and "train step" in proc.stdout


def test_the_pipeline_step_row_trains_every_copy_alike_and_replays_one_program(quick_run: Any) -> None:
    proc, record = quick_run
    row = record["benchmarks"]["pipeline_steps"]["rows"][0]
    assert row["schedule"] == "1f1b (AdamW)", row
    assert row["check"] == "ok", row  # every copy's stage ended with the one-process parameters
    assert row["compiled_programs"] == [1, 1], row
    for k in ("plain_ms", "shardwise_ms", "shardwise_compiled_ms", "torch_ms", "hand_ms", "compiled_vs_hand"):
        assert isinstance(row[k], float), (k, row)
    assert "pipeline train step" in proc.stdout


def test_every_pipeline_schedule_row_matches_one_process_and_measures_its_bubble(quick_run: Any) -> None:
    from bench._pipeline_schedules import CASES

    _, record = quick_run
    rows = record["benchmarks"]["pipeline_steps"]["rows"][1:]
    assert [r["schedule"] for r in rows] == [c.label for c in CASES]
    assert {c.schedule for c in CASES} == {"gpipe", "1f1b", "interleaved", "looped_bfs", "zero_bubble", "zbv",
                                           "dualpipev"}
    for case, r in zip(CASES, rows):
        assert r["check"] == "ok", r  # both libraries' loss and gradients equal one process's
        assert len(set(r["cores"])) == 2 or len(os.sched_getaffinity(0)) < 2, r  # each rank on its own core
        assert isinstance(r["shardwise_ms"], float) and isinstance(r["vs_1f1b"], float), r
        # torch either stepped (a time, a ratio) or refused the case (its error text in the row)
        assert isinstance(r["torch_ms"], float) and isinstance(r["ratio"], float) or "torch_error" in r, r
        assert r["torch_class"] == case.torch_class, r
        for k in ("bubble", "compute_bubble", "formula"):
            assert isinstance(r[k], float) and 0.0 <= r[k] < 1.0, (k, r)
        assert "rank 0 |" in r["compute_timeline"] and "rank 1 |" in r["compute_timeline"], r  # both ranks merged
    formula = {r["schedule"]: r["formula"] for r in rows}  # the pure schedules' cost model, exact
    assert formula["1f1b"] == pytest.approx(0.2) and formula["gpipe"] == pytest.approx(0.2)
    assert formula["zbv"] < formula["1f1b"] and formula["dualpipev"] < formula["1f1b"]


def test_overlap_rows_time_sync_and_async_for_both_libraries(quick_run: Any) -> None:
    proc, record = quick_run
    rows = record["benchmarks"]["overlap"]["rows"]
    assert [r["library"] for r in rows] == ["shardwise", "torch"]
    for r in rows:
        assert r["check"] == "ok", r  # sync and async both gave the single-device result
        assert isinstance(r["sync_ms"], float) and isinstance(r["async_ms"], float), r
    assert "async redistribute" in proc.stdout


def test_checkpoint_and_collective_bookkeeping_rows(quick_run: Any) -> None:
    proc, record = quick_run
    rows = {r["case"]: r for r in record["benchmarks"]["checkpoint"]["rows"]}
    assert list(rows) == ["save", "load", "async_save (until it returns)", "SHA-256 of one rank's share (within save)"]
    for case in ("save", "load", "async_save (until it returns)"):  # both libraries timed (what loads back was checked)
        assert isinstance(rows[case]["shardwise"], float) and isinstance(rows[case]["torch"], float), rows[case]
    paths = [r["path"] for r in record["benchmarks"]["collective_bookkeeping"]["rows"]]
    assert paths == ["dist.all_reduce", "shardwise door", "door, SHARDWISE_CHECK=1"]
    assert "checkpoint of" in proc.stdout and "all_reduce of 8 fp32" in proc.stdout


def test_hf_load_rows_read_only_own_pieces_and_equal_from_pretrained(quick_run: Any) -> None:
    proc, record = quick_run
    rows = {r["who"]: r for r in record["benchmarks"]["hf_load"]["rows"]}
    assert set(rows) == {"shardwise HuggingFaceStorageReader", "torch HuggingFaceStorageReader"}
    for r in rows.values():  # both loads gave transformers' from_pretrained weights, bitwise
        assert r["check"] == "ok" and isinstance(r["ms"], float), r
    ours = rows["shardwise HuggingFaceStorageReader"]
    assert ours["read_vs_own"] <= 1.05, ours  # each rank read its own pieces' bytes
    assert ours["allocator"] + ours["python"] <= ours["largest"] + 2**20, ours  # one piece + a fixed buffer
    assert "load a transformers Llama" in proc.stdout


def test_cross_mesh_rows_move_the_lower_bound(quick_run: Any) -> None:
    proc, record = quick_run
    rows = record["benchmarks"]["cross_mesh"]["rows"]
    assert len(rows) == 3 and "redistribute to another mesh" in proc.stdout
    for r in rows:  # both checked against the tensor; the busiest rank receives exactly the lower bound
        assert r["check"] == "ok" and r["received"] == r["bound"] > 0, r
        assert isinstance(r["shardwise"], float) and isinstance(r["torch"], float), r


def test_entry_point_rejects_unknown_benchmarks() -> None:
    proc = subprocess.run([sys.executable, "bench/run.py", "--only", "overhead,nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "overhead,redistribute,overlap,steps,memory" in proc.stderr


def test_the_dry_run_row_reports_both_sides(quick_run: Any) -> None:
    proc, record = quick_run
    rows = {r["who"]: r for r in record["benchmarks"]["dry_run"]["rows"]}
    assert set(rows) == {"shardwise dry_run", "torch fake PG + FakeTensorMode"}
    for r in rows.values():
        assert isinstance(r["seconds"], float) and r["seconds"] > 0 and r["rss"] > 0, r
    assert "collectives" in rows["shardwise dry_run"]["reports"] and "dry run of a 2-layer" in proc.stdout
    planned = record["benchmarks"]["planner"]["rows"][0]
    assert planned["who"] == "shardwise AutoPlanner" and planned["seconds"] > 0 and "of 4 candidates" in planned["chosen"]


def test_the_planner_quality_rows_measure_every_plan(quick_run: Any) -> None:
    _, record = quick_run
    rows = record["benchmarks"]["planner_quality"]["rows"]
    assert [r["plan"].split(" (")[0] for r in rows] == ["AutoPlanner", "megatron", "data parallel"]
    for r in rows:
        assert isinstance(r["measured_ms"], float) and isinstance(r["modelled_ms"], float), r
    piped = record["benchmarks"]["planner_pipeline"]["rows"]  # the planner's cut isolates the heavy block
    assert [r["split"] for r in piped] == ["planned [1, 5]", "even [3, 3]"], piped
    assert piped[0]["modelled_ms"] < piped[1]["modelled_ms"] and all(isinstance(r["measured_ms"], float) for r in piped)


def test_the_context_parallel_rows_check_every_rotation(quick_run: Any) -> None:
    table = quick_run[1]["benchmarks"]["context_parallel"]
    rows = [r for r in table["rows"] if r["who"].startswith("shardwise")]
    assert {r["who"].split()[-1] for r in rows} == {"allgather", "ulysses", "ring"}
    assert any("ContextParallel()" in r["who"] for r in rows)  # the plan style: the one-process program unchanged
    assert rows and all(r["check"] == "ok" and r["peak_vs_one"] is not None for r in rows)
    assert any(r["who"] == "torch context_parallel" for r in table["rows"])


def test_the_long_run_rows_show_no_growth_for_shardwise(quick_run: Any) -> None:
    rows = quick_run[1]["benchmarks"]["long_run"]["rows"]
    ours = [r for r in rows if r["lib"] == "shardwise"]
    assert {(r["loop"], r["optimizer"]) for r in ours} == {("tp", "foreach"), ("tp", "fused"), ("tp", "for-loop"),
                                                           ("zero3", "foreach"), ("dp-x-tp", "foreach"),
                                                           ("compiled-tp", "foreach")}
    assert {r["loop"] for r in rows if r["lib"] == "torch"} == {"tp", "zero3", "dp-x-tp"}
    for r in ours:  # flat after warm-up (before the float-keyed plans: about 40 objects a step with foreach)
        assert r["objects"] is not None and r["objects"] < 0.5, r


def test_the_optimizer_rows_compare_dtensor_steps_with_local_ones(quick_run: Any) -> None:
    rows = quick_run[1]["benchmarks"]["optimizer"]["rows"]
    assert {(r["kind"], r["n"]) for r in rows} == {(k, n) for k in ("default", "foreach", "fused") for n in (10, 50)}
    assert all(isinstance(r["shardwise_vs_local"], float) and isinstance(r["torch_vs_local"], float) for r in rows)


def test_the_moe_rows_dispatch_tokens_and_equal_one_process(quick_run: Any) -> None:
    _, record = quick_run
    rows = {r["who"]: r for r in record["benchmarks"]["moe"]["rows"]}
    assert len(rows) == 5, list(rows)
    one, replicated, split, capacity, compiled = rows.values()
    assert compiled["programs"] >= 1 and compiled["eager"] == 0, compiled  # it replays: no host synchronisation
    for r in (replicated, split, capacity, compiled):  # the loss of one process on the global batch (dropping alike)
        assert r["check"] == "ok" and r["peak_vs_one"] is not None and isinstance(r["step_ms"], float), r
    assert set(replicated["collective_counts"]) == {"all_reduce"}, replicated  # one per MoE layer
    assert set(split["collective_counts"]) == {"all_to_all", "all_reduce"}, split  # routes; the dense gradients
    assert split["dropped"].startswith("0 of ") and not capacity["dropped"].startswith("0 of "), (split, capacity)


def test_the_ft_rows_kill_groups_and_lose_no_committed_step(quick_run: Any) -> None:
    rows = {r["lib"]: r for r in quick_run[1]["benchmarks"]["ft"]["rows"]}
    ours = rows["shardwise"]  # (a torchft row too, when a scratch env with torchft 0.2 is on this machine)
    assert ours["check"] == "ok" and ours["failures"] >= 1 and ours["committed"] == 40, ours
    assert isinstance(ours["goodput"], float) and isinstance(ours["rec_med"], float), ours
