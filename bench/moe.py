"""Expert parallelism: a DeepSeek-V3-shaped train step, token dispatch against replicated tokens, on 4 ranks.

One gloo run of 4 ranks, one global batch of 4 sequences (2 and 2 in a quick run: `QUICK_EP`),
the same weights for every contender (transformers' `DeepseekV3ForCausalLM`, eager experts, float32, AdamW):
- one process: rank 0 alone steps on the whole batch while the others wait;
- replicated tokens: `ExpertParallel()` on every `mlp.experts`, every rank runs the whole
  batch, its own experts on every route that reaches them, one all-reduce per layer after;
- token dispatch: `ExpertParallel(tokens="split")` and `data_parallel(dp_dim="ep")`, each rank
  its own sequence, each route sent to its expert's owner by all_to_all and back by another;
- the same with `capacity_factor=1.25` (fixed split sizes, routes beyond them dropped);
- that step under `shardwise.compile` (the capacity form has no host synchronisation: it replays).
Per contender: the slowest rank's step (forward, backward, AdamW), the median over repeats
timed in rotating alternation after a barrier; peak bytes per rank (resident parameters,
optimizer state and batch, plus the highest point of the allocator's running sum during one
step, as `memory.py` counts it; the largest rank); the bytes a rank receives in one step
(`CommCounter`); and the loss check: on the first two steps (the same weights, then one
AdamW step on), the mean of the dispatch ranks' losses and the replicated form's loss equal
one process's on the global batch. A capacity that drops routes changes the loss by design:
its row is checked against one process whose experts drop the same routes (a few lines
here, independent of shardwise's dispatch), and counts the drops of the first step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from ._common import Column, Settings, Table, interleaved, local_bytes, per_repeat_max_median, quiet, ratio
from .memory import peak_allocated

__all__ = ["body", "run"]

EP = 4  # ranks of the full run
QUICK_EP = 2  # a quick run's (the smoke test's): the same dispatch, 4 experts a rank, half the ranks' work
CAPACITY = 1.25
WHO = ("one", "replicated", "split", "capacity", "compiled")
DISPATCH = ("split", "capacity", "compiled")
LABEL = {"one": "1 process (rank 0, whole batch)", "replicated": "ExpertParallel() tokens replicated",
         "split": "ExpertParallel(tokens=\"split\") + data_parallel",
         "capacity": f"  ... capacity_factor={CAPACITY}", "compiled": "  ... the same, shardwise.compile"}
TIME_TARGET = 0.6  # token dispatch's step / the replicated form's (the issue's, full size)
PEAK_TARGET = 0.35  # token dispatch's peak per rank / one process's
TOLERANCE = 1e-4  # relative, float32


def _ep(settings: Settings) -> int:
    """The ep ranks (and sequences in the global batch)."""
    return QUICK_EP if settings.quick else EP


def _config(settings: Settings) -> tuple[dict[str, Any], int]:
    """DeepseekV3Config's sizes (1 dense layer, then MoE layers of 8 routed experts, top 2, 1
    shared expert, one routing group) and the sequence length. Quick: one MoE layer (every
    contender's code path runs per layer, and the compiled contender's three traces, the
    smoke test's largest cost, grow with the layers)."""
    if settings.quick:
        return dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                    qk_nope_head_dim=4, v_head_dim=8), 16
    return dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
                num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=128,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32), 256


def _model(sizes: dict[str, Any], seq: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    options: dict[str, Any] = dict(sizes, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                                   n_shared_experts=1, n_group=1, topk_group=1, max_position_embeddings=seq,
                                   experts_implementation="eager")  # transformers' own loop over experts
    config = transformers.DeepseekV3Config(**options)
    model: nn.Module = transformers.DeepseekV3ForCausalLM(config)
    return model


def _experts_paths(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n.endswith("mlp.experts")]


def _parallel(who: str, model: nn.Module, mesh: Any) -> nn.Module:
    from shardwise.parallel import ExpertParallel, data_parallel, parallelize_module

    if who == "replicated":
        return parallelize_module(model, mesh, {p: ExpertParallel() for p in _experts_paths(model)})
    style = ExpertParallel(tokens="split", capacity_factor=None if who == "split" else CAPACITY)
    parallelize_module(model, mesh, {p: style for p in _experts_paths(model)})
    return data_parallel(model, mesh, dp_dim="ep")


def _train(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return loss.detach()


def _stepper(model: nn.Module, ids: torch.Tensor, compiled: Any = None
             ) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """A step of AdamW on `model`; through `compiled` (a `shardwise.compile` of `_train`) if given."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = compiled or _train
    return (lambda: train(model, opt, ids)), opt


def _drop_beyond_capacity(model: nn.Module, rows: int) -> None:
    """Make one process's experts drop what `capacity_factor=CAPACITY` drops: per block of `rows`
    tokens (one rank's sequence) and per expert, the routes past its capacity in token order
    (weight 0, so they add nothing and their weights get no gradient)."""
    for path in _experts_paths(model):
        module = model.get_submodule(path)
        forward, total = module.forward, int(getattr(module, "num_experts"))

        def dropping(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     forward: Callable[..., torch.Tensor] = forward, total: int = total) -> torch.Tensor:
            k = index.shape[-1]
            capacity = max(1, math.ceil(CAPACITY * rows * k / total))
            hot = torch.nn.functional.one_hot(index.reshape(-1, rows * k), total)  # (blocks, routes, experts)
            slot = ((hot.cumsum(1) - 1) * hot).sum(-1)  # each route's place within its expert, in its block
            return forward(x, index, torch.where(slot.view_as(index) < capacity, weights, torch.zeros_like(weights)))

        module.forward = dropping


def _routes(model: nn.Module) -> tuple[int, int]:
    """(routes dropped, routes sent) by every dispatching experts module's last forward, over the ep ranks."""
    import torch.distributed as dist

    from shardwise.parallel import route_counts

    counts = torch.zeros(2, dtype=torch.int64)
    for path in _experts_paths(model):
        found = route_counts(model.get_submodule(path))
        counts += torch.tensor([0 if found.dropped is None else int(found.dropped.sum()), found.routes])
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def _measure(who: str, model: nn.Module, ids: torch.Tensor, step: Callable[[], torch.Tensor],
             opt: torch.optim.Optimizer, settings: Settings) -> dict[str, Any]:
    """The contender's first two losses (the mean over ranks where each holds its own rows),
    dropped routes, resident and step bytes, and one step's collectives; leaves it warm."""
    import torch.distributed as dist

    from shardwise.debug import CommCounter

    out: dict[str, Any] = {"losses": []}
    for k in range(2):
        loss = step()
        if who in DISPATCH:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
            if k == 0:
                out["dropped"] = _routes(model)
        out["losses"].append(loss.item())
    opt.zero_grad(set_to_none=True)
    out["resident"] = (sum(local_bytes(p) for p in model.parameters()) + local_bytes(ids)
                       + sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor)))
    samples = []
    for _ in range(1 if settings.quick else 3):  # gloo's thread frees finished buffers when it will: a median
        opt.zero_grad(set_to_none=True)
        samples.append(peak_allocated(step))
    out["extra"] = sorted(samples)[len(samples) // 2]
    out["peak"] = out["resident"] + out["extra"]
    with CommCounter(model) as counter:
        step()
    totals = counter.totals()
    out["wire"] = sum(b for _, b in totals.values())
    out["collectives"] = {kind: [n, b] for kind, (n, b) in totals.items()}
    return out


def body(settings: Settings) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    import shardwise as sw

    sizes, seq = _config(settings)
    rank = dist.get_rank()
    ep = _ep(settings)
    ids = torch.randint(0, sizes["vocab_size"], (ep, seq), generator=torch.Generator().manual_seed(1))
    base = _model(sizes, seq)
    mesh = sw.init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    out: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], Optional[torch.Tensor]]] = {}
    traced: Any = None  # the compiled contender's step
    with quiet():
        for who in WHO:
            if who == "one" and rank != 0:  # the others idle while rank 0 steps alone
                out[who], steps[who] = {}, lambda: None
                continue
            model = copy.deepcopy(base) if who == "one" else _parallel(who, copy.deepcopy(base), mesh)
            batch = ids[rank:rank + 1] if who in DISPATCH else ids
            compiled = sw.compile(_train) if who == "compiled" else None
            traced = compiled or traced
            step, opt = _stepper(model, batch, compiled)
            out[who] = _measure(who, model, batch, step, opt, settings)
            steps[who] = step
            if who == "one":  # the capacity form's reference: one process dropping the same routes
                reference = copy.deepcopy(base)
                _drop_beyond_capacity(reference, seq)
                dropping = _stepper(reference, ids)[0]
                out[who]["dropping_losses"] = [dropping().item() for _ in range(2)]
                del reference, dropping
        dist.barrier()
        samples = interleaved(steps, settings.repeats, before=dist.barrier)
    for who in WHO:
        out[who]["seconds"] = samples[who]
    # every signature met (grads present or not at the call) traced into a program, none run eagerly
    out["compiled"]["programs"] = (traced.programs(), traced.eager()) if traced is not None else (0, 0)
    return out


def _check(got: list[float], want: list[float]) -> tuple[float, str]:
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    return worst, "ok" if worst <= TOLERANCE else f"off by {worst:.1e} relative"


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    sizes, seq = _config(settings)
    ep = _ep(settings)
    per_rank = run_distributed(body, ep, settings, timeout=3 * settings.timeout)
    moe_layers = sizes["num_hidden_layers"] - 1
    table = Table(
        "moe",
        f"expert parallelism, DeepSeek-V3-shaped train step (hidden {sizes['hidden_size']}, 1 dense + {moe_layers} "
        f"MoE layers of 8 experts, top 2, 1 shared, expert width {sizes['moe_intermediate_size']}, float32, AdamW), "
        f"global batch {ep} x {seq} tokens, ep={ep}: step (slowest rank), MiB per rank (largest rank); targets at "
        f"full size: token dispatch time / replicated <= {TIME_TARGET}, peak / 1 process <= {PEAK_TARGET}",
        [Column("who", "who"), Column("step_ms", "step ms", ".1f"),
         Column("time_vs_replicated", "time / replicated", ".2f"), Column("resident_mib", "resident", ".1f"),
         Column("extra_mib", "step extra", ".1f"), Column("peak_mib", "peak", ".1f"),
         Column("peak_vs_one", "peak / 1 process", ".2f"), Column("wire_mib", "MiB received / step", ".2f"),
         Column("collectives", "collectives per step (MiB rank 0 receives)"), Column("dropped", "routes dropped"),
         Column("check", "loss check")],
    )
    seconds = {who: per_repeat_max_median([r[who]["seconds"] for r in per_rank]) for who in WHO}
    ranks = {who: per_rank[:1] if who == "one" else per_rank for who in WHO}
    peaks = {who: max(r[who]["peak"] for r in ranks[who]) for who in WHO}
    for who in WHO:
        row: dict[str, Any] = {"who": LABEL[who]}
        step = seconds[who]
        row["step_ms"] = None if step is None else step * 1e3
        row["time_vs_replicated"] = ratio(seconds[who], seconds["replicated"])
        for key in ("resident", "extra", "peak", "wire"):
            row[key] = max(r[who][key] for r in ranks[who])
            row[f"{key}_mib"] = row[key] / 2**20
        row["peak_vs_one"] = ratio(peaks[who], peaks["one"])
        kinds = per_rank[0][who]["collectives"]
        row["collectives"] = ", ".join(f"{k} {n} ({b / 2**20:.2f} MiB)" for k, (n, b) in kinds.items()) or "-"
        row["collective_counts"] = {k: n for k, (n, _) in kinds.items()}
        if "dropped" in per_rank[0][who]:
            dropped, routes = per_rank[0][who]["dropped"]
            row["dropped"] = f"{dropped} of {routes}"
        want = per_rank[0]["one"]["dropping_losses" if who in ("capacity", "compiled") else "losses"]
        row["loss_error"], row["check"] = (0.0, "-") if who == "one" else _check(per_rank[0][who]["losses"], want)
        if who == "compiled":
            row["programs"], row["eager"] = per_rank[0][who]["programs"]
            row["check"] += "" if row["programs"] and not row["eager"] else " (not replayed: ran eagerly)"
        table.rows.append(row)
    table.notes.append("loss check: the first two steps' losses (the same weights, then one AdamW step on) against "
                       "1 process on the global batch, within 1e-4 relative; token dispatch: the mean over ranks of "
                       "each rank's loss on its own sequence; the capacity form: against 1 process dropping the same "
                       f"routes (per sequence and expert, those past ceil({CAPACITY} x tokens x top_k / experts) in "
                       "token order; the 1-process row drops none)")
    table.notes.append("peak = resident (parameters, AdamW state, batch) + the highest point of the allocator's "
                       "running sum during one step (gradients, activations, buffers torch allocates); the dense "
                       "parameters are whole on every rank (data_parallel without shard_parameters), the experts a "
                       f"{'a quarter' if ep == 4 else f'1/{ep}'} each; 1 process: rank 0 while the {ep - 1} others wait")
    table.notes.append("shardwise.compile: the first call makes AdamW's state and runs eagerly, the second is "
                       "traced, every later one replays the traced program (checked: no signature ran eagerly, loss as eager's)")
    table.notes.append("MiB received: the largest rank's, counted by shardwise.debug.CommCounter around one step")
    return [table]
