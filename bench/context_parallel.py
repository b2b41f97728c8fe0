"""Context parallel: a 2-layer Llama-shaped model's train step on long sequences, one process against cp=4.

(A quick run: cp=2 and one K/V head, see `_cp`.)

One process runs forward and backward of the whole sequence (transformers' sdpa attention:
torch's CPU flash kernel, causal); then 4 gloo ranks run the same step under
`shardwise.experimental.context_parallel` (head-tail pieces), with the K/V all-gather
rotation, the ring and Ulysses, and through the `ContextParallel()` plan style (the
one-process program unchanged, the model's own loss). Per length: the peak bytes the step allocates on the rank
that allocates most (torch's allocator, net, through the profiler, on top of the model),
the slowest rank's seconds, and the loss check: the cp ranks' token-weighted losses add up
to one process's. torch's own `context_parallel` is tried at the smallest length; on CPU it
fails at once (no sharding strategy for the CPU flash kernel), and the table says so.
Plain causal attention needs no mask in any rotation: allgather and the ring call torch's
fused CPU flash kernel per visible pair of chunks, Ulysses calls SDPA in sequence order. A
case that fails (out of memory, say) is reported in its row and the others still run.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ._common import Column, Settings, Table, on_first_rank, one_process_world, quiet, ratio
from .memory import peak_allocated

__all__ = ["body", "run"]

CP = 4  # ranks of the full run
KV_HEADS = 2  # the full run's K/V heads: fewer than cp, so Ulysses gives each query head its own copy
ROTATIONS = ("allgather", "ulysses", "ring")


def _cp(settings: Settings) -> tuple[int, int]:
    """(cp ranks, K/V heads). Quick (the smoke test): 2 ranks and 1 K/V head, still fewer K/V
    heads than cp (Ulysses' grouped-query path, as at full size), for half the ranks' work and
    no pool of 4 loading transformers' Llama (the other benchmarks that build one run on 2 too)."""
    return (2, 1) if settings.quick else (CP, KV_HEADS)


def _lengths(settings: Settings) -> tuple[int, ...]:
    """Sequence lengths. Quick (the smoke test): one, as every length runs the same rotations."""
    return (128,) if settings.quick else (4096, 8192, 16384, 32768)


def _model(settings: Settings) -> Any:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=_cp(settings)[1],
                                      max_position_embeddings=65536)
    return transformers.LlamaForCausalLM(config)


def _batch(seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(seq))
    positions = torch.arange(seq).unsqueeze(0)
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    return ids, positions, shift


def _step(model: Any, ids: torch.Tensor, positions: torch.Tensor, shift: torch.Tensor, counted: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=positions).logits
    loss = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum") / counted
    loss.backward()
    return loss.detach()


def _timed(fn: Any, repeats: int) -> tuple[list[float], int]:
    peak = peak_allocated(fn)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds, peak


def one_process(settings: Settings, seq: int) -> dict[str, Any]:
    model = _model(settings)
    ids, positions, shift = _batch(seq)
    counted = int((shift != -100).sum())
    losses: list[torch.Tensor] = []
    with quiet():
        seconds, peak = _timed(lambda: losses.append(_step(model, ids, positions, shift, counted)),
                               1 if seq > 8192 else min(settings.repeats, 3))
    return {"seconds": seconds, "peak": peak, "loss": losses[-1].item()}


def body(settings: Settings, seq: int, rotate: str) -> dict[str, Any]:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.experimental import context_parallel, set_load_balance, set_rotate_method

    set_rotate_method(rotate)
    set_load_balance(True)
    model = _model(settings)
    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    ids, positions, shift = _batch(seq)
    counted = int((shift != -100).sum())
    losses: list[torch.Tensor] = []
    with quiet(), context_parallel(mesh, buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1]):
        dist.barrier()
        seconds, peak = _timed(lambda: losses.append(_step(model, ids, positions, shift, counted)),
                               1 if seq > 8192 else min(settings.repeats, 3))
    total = losses[-1].clone()
    dist.all_reduce(total)
    return {"seconds": seconds, "peak": peak, "loss": total.item()}


def style(settings: Settings, seq: int) -> dict[str, Any]:
    """The same step through `ContextParallel()` (allgather): the one-process program unchanged,
    the model's own loss, the gradients summed over cp by the style."""
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.experimental import set_load_balance, set_rotate_method
    from shardwise.parallel import ContextParallel, parallelize_module

    set_rotate_method("allgather")
    set_load_balance(True)
    model = _model(settings)
    parallelize_module(model, sw.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",)),
                       ContextParallel())
    ids = _batch(seq)[0]
    losses: list[torch.Tensor] = []

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())

    with quiet():
        dist.barrier()
        seconds, peak = _timed(step, 1 if seq > 8192 else min(settings.repeats, 3))
    return {"seconds": seconds, "peak": peak, "loss": losses[-1].item()}


def _failed(exc: BaseException) -> str:
    return "failed: " + str(exc).splitlines()[0][:120]


def torch_context_parallel(settings: Settings, seq: int) -> Optional[str]:
    """None when torch's context_parallel runs the step here; else the first line of its error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import torch.distributed as dist

    model = _model(settings)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids, positions, shift = _batch(seq)
    try:
        with quiet(), context_parallel(mesh, buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1]):
            _step(model, ids, positions, shift, int((shift != -100).sum()))
    except Exception as exc:  # noqa: BLE001 - the table reports whatever torch raised
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    cp, kv = _cp(settings)
    table = Table(
        "context_parallel",
        f"context parallel: 2-layer Llama-shaped train step (hidden 128, 4 heads, {kv} K/V heads), one process vs "
        f"cp={cp} on {cp} ranks: peak MiB allocated per rank during the step (largest rank), seconds (slowest rank)",
        [Column("seq", "tokens"), Column("who", "who"), Column("peak_mib", "peak MiB", ".1f"),
         Column("peak_vs_one", "peak / 1 process", ".2f"), Column("s", "step s", ".2f"),
         Column("time_vs_one", "time / 1 process", ".2f"), Column("check", "loss check")],
    )
    for seq in _lengths(settings):
        try:
            single = run_distributed(on_first_rank, one_process_world(settings), one_process, settings, seq,
                                     timeout=settings.timeout)[0]
        except Exception as exc:  # noqa: BLE001 - reported in the row
            table.rows.append({"seq": seq, "who": "1 process", "peak": None, "check": _failed(exc)})
            continue
        table.rows.append({"seq": seq, "who": "1 process", "peak": single["peak"], "peak_mib": single["peak"] / 2**20,
                           "peak_vs_one": 1.0, "s": min(single["seconds"]), "time_vs_one": 1.0, "check": "-"})
        for rotate in (*ROTATIONS, "style"):
            who = f"shardwise cp={cp} " + (rotate if rotate != "style" else "ContextParallel() allgather")
            try:
                per_rank = (run_distributed(style, cp, settings, seq, timeout=settings.timeout) if rotate == "style"
                            else run_distributed(body, cp, settings, seq, rotate, timeout=settings.timeout))
            except Exception as exc:  # noqa: BLE001 - reported in the row
                table.rows.append({"seq": seq, "who": who, "peak": None, "check": _failed(exc)})
                continue
            peak = max(r["peak"] for r in per_rank)
            seconds = min(max(r["seconds"][i] for r in per_rank) for i in range(len(per_rank[0]["seconds"])))
            close = abs(per_rank[0]["loss"] - single["loss"]) <= 1e-4 * max(1.0, abs(single["loss"]))
            table.rows.append({"seq": seq, "who": who, "peak": peak,
                               "peak_mib": peak / 2**20, "peak_vs_one": ratio(peak, single["peak"]), "s": seconds,
                               "time_vs_one": ratio(seconds, min(single["seconds"])),
                               "check": "ok" if close else "WRONG"})
    failure = run_distributed(torch_context_parallel, cp, settings, _lengths(settings)[0], timeout=settings.timeout)[0]
    table.rows.append({"seq": _lengths(settings)[0], "who": "torch context_parallel",
                       "check": "runs" if failure is None else "fails"})
    if failure is not None:
        table.notes.append(f"torch's context_parallel on CPU: {failure}")
    budget = table.rows[0]["peak"]
    fits = [r["seq"] for r in table.rows if r["who"].endswith("allgather") and r["peak"] is not None
            and budget is not None and r["peak"] <= budget]
    if budget is not None:
        table.notes.append(f"within one process's peak at {table.rows[0]['seq']} tokens ({budget / 2**20:.1f} MiB), "
                           f"cp={cp} allgather ran up to {max(fits) if fits else 'none'} of the lengths tried")
    table.notes.append("peak: torch's CPU allocator, net, during one step, on top of the model and its inputs; "
                       "one process runs transformers' sdpa (CPU flash kernel, causal); allgather and the ring run "
                       "the same kernel per visible pair of chunks, Ulysses runs SDPA in sequence order")
    return [table]
