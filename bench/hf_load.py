"""Loading a transformers checkpoint into shards: shardwise's HuggingFaceStorageReader against torch's (DCP).

transformers' `save_pretrained` writes a seeded Llama once, split into several safetensors
files behind an index. On 4 gloo ranks (2 in a quick run) the same model, differently seeded, is
sharded per layer and at the root by each library's `fully_shard` over them all, and loaded from that
directory with `load(model.state_dict(), storage_reader=HuggingFaceStorageReader(path))`
of each library, interleaved after a barrier (a fresh reader per load, headers included).

Per rank: the tensor bytes shardwise's reader counts (`bytes_read`) against the bytes of
the rank's own pieces; and the host memory a load adds on top of the state dict it fills,
three ways, none of which sees everything: torch's allocator (`memory.peak_allocated`),
Python's heap (tracemalloc: shardwise reads into a `bytearray` there) and the rise of the
resident set's high-water mark (`/proc/self/clear_refs`; it alone sees torch's reader,
which reads through `mmap` with safetensors, and it counts whatever the process touches).
Bound: the largest single piece the rank reads. After the loads every parameter is
compared bitwise with what transformers' `from_pretrained` gives.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import tracemalloc
from collections.abc import Callable
from typing import Any, Optional

import torch

from ._common import (Column, Settings, Table, interleaved, local_bytes, on_first_rank, per_repeat_max_median, quiet,
                      ratio)
from .memory import peak_allocated

__all__ = ["body", "run"]

WORLD = 4  # ranks of the full run
QUICK_WORLD = 2  # a quick run's (the smoke test's): every rank still reads only its own pieces, half the ranks' work
WHO = ("shardwise", "torch")


def _config(settings: Settings) -> Any:
    import transformers

    hidden, width, layers, vocab, _ = settings.hf_load
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=width,
                                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)


def _llama(settings: Settings, seed: int) -> Any:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(settings))


def _save(settings: Settings, root: str) -> None:
    """The checkpoint every load reads: a Llama seeded apart from the loaded ones, in several files."""
    _llama(settings, 0).save_pretrained(root, max_shard_size=settings.hf_load[4])


def _shard(who: str, model: Any) -> Any:
    import torch.distributed as dist

    world = dist.get_world_size()
    if who == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            torch_fully_shard(layer, mesh=torch_mesh)
        torch_fully_shard(model, mesh=torch_mesh)
        return model
    import shardwise as sw
    from shardwise.fsdp import fully_shard

    mesh = sw.init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _python_peak(fn: Callable[[], object]) -> int:
    """Highest bytes Python's allocators held above the start while `fn` ran (tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _rss_rise(fn: Callable[[], object]) -> Optional[int]:
    """Rise of the resident set's high-water mark above the resident set at the start (None where
    the kernel does not let a process reset its mark)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        before = status("VmRSS")
    except OSError:
        return None
    fn()
    return status("VmHWM") - before


def body(settings: Settings, path: str) -> dict[str, Any]:
    """Every rank: load `path` into both libraries' sharded Llamas; samples, bytes and checks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers

    from shardwise import checkpoint

    base = _llama(settings, 1)
    models = {who: _shard(who, copy.deepcopy(base)) for who in WHO}
    del base
    states = {who: models[who].state_dict() for who in WHO}
    readers: list[Any] = []

    def sw_load() -> None:
        readers.append(checkpoint.HuggingFaceStorageReader(path))
        checkpoint.load(states["shardwise"], storage_reader=readers[-1])

    def torch_load() -> None:
        dcp.load(states["torch"], storage_reader=dcp.HuggingFaceStorageReader(path))

    loads = {"shardwise": sw_load, "torch": torch_load}
    out: dict[str, Any] = {who: {} for who in WHO}
    with quiet():
        for who, fn in loads.items():
            fn()  # warm up, and fill the model for the check below
            dist.barrier()
            out[who]["allocator"] = peak_allocated(fn)
            dist.barrier()
            # tracemalloc around torch's HF reader kills the process now and then (SIGSEGV in a native
            # thread of that load, seen in about half the runs here): torch's Python heap is not measured
            out[who]["python"] = _python_peak(fn) if who == "shardwise" else None
            dist.barrier()
            out[who]["rss"] = _rss_rise(fn)
            dist.barrier()
        samples = interleaved(loads, settings.repeats, before=dist.barrier)
    transformers.utils.logging.disable_progress_bar()
    want = transformers.LlamaForCausalLM.from_pretrained(path).state_dict() if dist.get_rank() == 0 else {}
    for who in WHO:
        own = [local_bytes(v) for v in states[who].values()]
        out[who]["seconds"] = samples[who]
        out[who]["own"] = sum(own)
        out[who]["largest"] = max(own)
        full = {k: v.full_tensor() for k, v in models[who].state_dict().items()}  # every rank: collectives
        same = set(full) == set(want) and all(torch.equal(full[k], want[k]) for k in want)
        out[who]["check"] = ("ok" if same else "WRONG") if dist.get_rank() == 0 else None
    out["shardwise"]["bytes_read"] = readers[-1].bytes_read
    return out


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    hidden, width, layers, vocab, max_shard_size = settings.hf_load
    world = QUICK_WORLD if settings.quick else WORLD
    root = tempfile.mkdtemp(prefix="shardwise-bench-hf-load-")
    try:
        if settings.quick:  # by a worker, which imports transformers anyway: not this process too
            run_distributed(on_first_rank, world, _save, settings, root, timeout=settings.timeout)
        else:
            _save(settings, root)
        files = sum(name.endswith(".safetensors") for name in os.listdir(root))
        per_rank = run_distributed(body, world, settings, root, timeout=settings.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = sum(r["shardwise"]["own"] for r in per_rank) / 2**20
    table = Table(
        "hf_load",
        f"load a transformers Llama ({hidden} hidden, {layers} layers, vocab {vocab}; {mb:.0f} MB fp32 in {files} "
        f"safetensors files) into fully_shard on {world} ranks: ms (slowest rank, median of {settings.repeats}), MiB per "
        f"rank (largest rank)",
        [Column("who", "who"), Column("ms", "load ms", ".1f"), Column("time_vs_torch", "time / torch", ".2f"),
         Column("read_mib", "read", ".2f"), Column("read_vs_own", "read / own", ".3f"),
         Column("own_mib", "own pieces", ".2f"), Column("largest_mib", "largest piece", ".2f"),
         Column("allocator_mib", "allocator peak", ".2f"), Column("python_mib", "python peak", ".2f"),
         Column("rss_mib", "RSS rise", ".2f"), Column("extra_vs_largest", "(alloc+py) / largest", ".2f"),
         Column("check", "check")],
    )
    medians = {who: per_repeat_max_median([r[who]["seconds"] for r in per_rank]) for who in WHO}
    for who in WHO:
        ranks = [r[who] for r in per_rank]
        row: dict[str, Any] = {"who": f"{who} HuggingFaceStorageReader"}
        seconds = medians[who]
        row["ms"] = None if seconds is None else seconds * 1e3
        row["time_vs_torch"] = ratio(medians[who], medians["torch"])
        for key in ("own", "largest", "allocator", "python", "rss"):
            values = [r[key] for r in ranks]
            row[key] = None if None in values else max(values)
            row[f"{key}_mib"] = None if row[key] is None else row[key] / 2**20
        if who == "shardwise":
            row["read"] = max(r["bytes_read"] for r in ranks)
            row["read_mib"] = row["read"] / 2**20
            row["read_vs_own"] = max(r["bytes_read"] / r["own"] for r in ranks)
        row["extra_vs_largest"] = max((r["allocator"] + (r["python"] or 0)) / r["largest"] for r in ranks)
        row["check"] = ranks[0]["check"]
        table.rows.append(row)
    table.notes.append("read: tensor bytes shardwise's reader read (its bytes_read); torch's reader reads through "
                       "mmap (safetensors' safe_open + get_slice), which it does not count")
    table.notes.append("allocator peak: torch's CPU allocator, net, during one load; python peak: tracemalloc during "
                       "another (shardwise's reads land in a bytearray; not measured for torch's reader, whose "
                       "process tracemalloc crashes now and then); RSS rise: VmHWM after a third load minus "
                       "VmRSS before it (sees mmap'd file pages too). All on top of the state dict being filled")
    table.notes.append("check: every parameter, gathered, bitwise equal to transformers' from_pretrained")
    return [table]
