"""Train steps: a tensor-parallel MLP on 2 ranks and the parity GPT on a (dp, tp) = (2, 2) mesh.

A step is zero_grad, forward, backward and an AdamW step. Both libraries get the same
model (deep copies of one seeded module) sharded the same way: the MLP through each
library's `parallelize_module` with ColwiseParallel / RowwiseParallel, the GPT by
hand-placed weights (Megatron: q, k, v, up split by output features, proj and down by
input features, everything else replicated; the batch split over dp), as
tests/parallel/test_model_parity.py places them. A third sharded copy runs the same step through
`shardwise.compile`: its first call creates the optimizer state, its second (in the warmup)
traces, and every timed call replays. A plain single-process copy steps in the same
interleaved loop, on every rank, as the yardstick. Every copy takes the same number of
steps, so afterwards their parameters must agree, and the compiled copy must have replayed
one program: the `check` column says so. For the MLP, a copy written by hand on the local
pieces with one explicit all_reduce, stepping AdamW on its fused kernel (the kernel the
compiled step's trace uses), is the floor the compiled step is measured against.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Column, interleaved, Settings, Table, close, per_repeat_max_median, quiet, ratio
from ._libs import LIBS, Lib, load, math_attention

__all__ = ["HandTP", "mlp", "gpt_plan", "place", "mlp_body", "gpt_body", "run"]

_COLUMN, _ROW = ("q", "k", "v", "up"), ("proj", "down")
COMPILED = "shardwise_compiled"  # the copy stepped by shardwise.compile(step)
HAND = "hand"  # the MLP step written by hand on local pieces with an explicit all_reduce
_SHARDED = LIBS + (COMPILED,)


def mlp(d: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


def gpt_plan(lib: Lib, name: str) -> list[Any]:
    """(dp, tp) placements of one GPT parameter: replicated over dp, Megatron over tp."""
    parts = name.split(".")
    tp = lib.Replicate()
    if len(parts) == 4 and parts[0] == "blocks":
        if parts[2] in _COLUMN:
            tp = lib.Shard(0)  # nn.Linear weight (out, in) and bias (out,): split the outputs
        elif parts[2] in _ROW and parts[3] == "weight":
            tp = lib.Shard(1)  # split the inputs; the output is Partial until reduced
    return [lib.Replicate(), tp]


def place(model: nn.Module, lib: Lib, mesh: Any, plan: Callable[[Lib, str], list[Any]]) -> nn.Module:
    """A deep copy of `model` with every parameter a DTensor of `lib` placed by `plan`; tied ones stay tied."""
    out = copy.deepcopy(model)
    made: dict[int, nn.Parameter] = {}
    for name, p in list(out.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            made[id(p)] = nn.Parameter(lib.distribute_tensor(p.detach(), mesh, plan(lib, name)))
        path, _, attr = name.rpartition(".")
        setattr(out.get_submodule(path) if path else out, attr, made[id(p)])
    return out


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _time_steps(settings: Settings, steps: dict[str, Callable[[], Any]],
                models: dict[str, nn.Module]) -> dict[str, Any]:
    """Check first losses, warm up, time interleaved, then compare every copy's parameters with plain's."""
    import torch.distributed as dist


    first = {k: float(_full(fn()).detach()) for k, fn in steps.items()}
    for fn in steps.values():
        for _ in range(min(settings.warmup, 2)):
            fn()
    samples = interleaved(steps, settings.repeats, before=dist.barrier)
    if HAND in first:  # its parameters are pieces: its first loss must be one process's
        first_ok = abs(first[HAND] - first["plain"]) <= 1e-4 * max(1.0, abs(first["plain"]))
    plain = dict(models["plain"].named_parameters())
    result: dict[str, Any] = {"samples": samples, "first_loss": first}
    if HAND in first:
        result[f"{HAND}_ok"] = first_ok
    for name in _SHARDED:
        worst = 0.0
        same = abs(first[name] - first["plain"]) <= 1e-4 * max(1.0, abs(first["plain"]))
        for pname, p in models[name].named_parameters():
            got, want = _full(p.detach()), plain[pname].detach()
            same = same and close(got, want, 1e-3)
            worst = max(worst, float((got - want).abs().max()))
        result[f"{name}_ok"] = same
        result[f"{name}_max_param_diff"] = worst
    return result


def mlp_body(settings: Settings) -> dict[str, Any]:
    d, hidden, batch = settings.mlp
    torch.manual_seed(0)
    ref = mlp(d, hidden)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    models: dict[str, nn.Module] = {"plain": copy.deepcopy(ref)}
    for name in LIBS:
        lib = load(name)
        mesh = lib.mesh((2,))
        for copy_name in (name, COMPILED) if name == "shardwise" else (name,):
            models[copy_name] = lib.parallelize_module(copy.deepcopy(ref), mesh,
                                                       {"0": lib.ColwiseParallel(), "2": lib.RowwiseParallel()})
    import torch.distributed as dist

    models[HAND] = HandTP(ref, dist.get_rank(), 2)
    # the floor steps AdamW on the fused kernel, the one a compiled step replays (`_compile_optim`)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, **({"fused": True} if k == HAND else {}))
            for k, m in models.items()}
    compiled = _compile(_mlp_step)
    steps: dict[str, Callable[[], Any]] = {
        k: functools.partial(compiled if k == COMPILED else _mlp_step, m, opts[k], x, y) for k, m in models.items()
    }
    return _run_steps(settings, steps, models, compiled)


class _AllReduce(torch.autograd.Function):
    """Megatron's g: sum the row-split layer's partial outputs; the gradient passes as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class HandTP(nn.Module):
    """The TP MLP written by hand on this rank's pieces (the yardstick for a compiled step):
    column-split first Linear, row-split second, one explicit all_reduce."""

    def __init__(self, ref: nn.Sequential, rank: int, n: int) -> None:
        super().__init__()
        rows = ref[0].weight.shape[0] // n
        cut = slice(rank * rows, (rank + 1) * rows)
        self.w1 = nn.Parameter(ref[0].weight.detach()[cut].clone())
        self.b1 = nn.Parameter(ref[0].bias.detach()[cut].clone())
        self.w2 = nn.Parameter(ref[2].weight.detach()[:, cut].clone())
        self.b2 = nn.Parameter(ref[2].bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(x, self.w1, self.b1))  # (batch, hidden / n)
        return _AllReduce.apply(F.linear(h, self.w2)) + self.b2  # type: ignore[no-untyped-call,no-any-return]


def _mlp_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)  # the Rowwise output comes back as a plain replicated tensor
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return loss.detach()


def _compile(fn: Callable[..., Any]) -> Any:
    import shardwise

    return shardwise.compile(fn)


def _run_steps(settings: Settings, steps: dict[str, Callable[[], Any]], models: dict[str, nn.Module],
               compiled: Any) -> dict[str, Any]:
    seen: set[str] = set()
    with quiet(seen):
        out = _time_steps(settings, steps, models)
    out["warnings"] = sorted(seen)
    out["compiled_programs"] = compiled.programs()  # one: every call after the trace replayed it
    return out


def gpt_body(settings: Settings) -> dict[str, Any]:
    from tests.models import GPT, GPTConfig, gpt_batch

    vocab, d_model, heads, seq, layers, batch = settings.gpt
    cfg = GPTConfig(vocab=vocab, d_model=d_model, heads=heads, seq=seq, layers=layers)
    torch.manual_seed(0)
    ref = GPT(cfg)
    idx, targets = gpt_batch(0, batch, cfg)
    models: dict[str, nn.Module] = {"plain": copy.deepcopy(ref)}
    inputs: dict[str, tuple[Any, Any]] = {"plain": (idx, targets)}
    contexts: dict[str, Callable[[], Any]] = {"plain": contextlib.nullcontext}
    for name in LIBS:
        lib = load(name)
        mesh = lib.mesh((2, 2), ("dp", "tp"))
        batch_layout = [lib.Shard(0), lib.Replicate()]
        for copy_name in (name, COMPILED) if name == "shardwise" else (name,):
            models[copy_name] = place(ref, lib, mesh, gpt_plan)
            inputs[copy_name] = (lib.distribute_tensor(idx, mesh, batch_layout),
                                 lib.distribute_tensor(targets, mesh, batch_layout))
            contexts[copy_name] = lib.implicit_replication  # position ids and the causal mask are plain tensors
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    compiled = _compile(_gpt_step)
    steps: dict[str, Callable[[], Any]] = {
        k: functools.partial(compiled if k == COMPILED else _gpt_step, m, opts[k], *inputs[k], contexts[k])
        for k, m in models.items()
    }
    return _run_steps(settings, steps, models, compiled)


def _gpt_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Any, targets: Any,
              context: Callable[[], Any]) -> Any:
    opt.zero_grad(set_to_none=True)
    with context(), math_attention():
        loss = model(idx, targets)
        loss.backward()
        opt.step()
    return loss.detach()


def run(settings: Settings) -> list[Table]:
    from shardwise.testing import run_distributed

    d, hidden, batch = settings.mlp
    vocab, d_model, heads, seq, layers, gbatch = settings.gpt
    table = Table(
        "steps",
        "train step (zero_grad, forward, backward, AdamW), ms per step: median over repeats of the slowest rank",
        [Column("model", "model"), Column("mesh", "mesh"), Column("plain_ms", "1-process ms", ".2f"),
         Column("shardwise_ms", "shardwise ms", ".2f"), Column(f"{COMPILED}_ms", "sw compiled ms", ".2f"),
         Column("torch_ms", "torch ms", ".2f"), Column("ratio", "ratio sw/torch", ".2f"),
         Column("compiled_ratio", "ratio compiled/torch", ".2f"), Column(f"{HAND}_ms", "hand-written ms", ".2f"),
         Column("compiled_vs_hand", "ratio compiled/hand", ".2f"), Column("check", "check")],
    )
    cases = [
        (f"TP MLP {d}->{hidden}->{d}, batch {batch}", "(2,) tp", mlp_body, 2),
        (f"GPT {layers} blocks d={d_model} seq={seq} vocab={vocab}, batch {gbatch}", "(2,2) dp x tp", gpt_body, 4),
    ]
    for label, mesh, fn, world in cases:
        per_rank = run_distributed(fn, world, settings, timeout=settings.timeout)
        row: dict[str, Any] = {"model": label, "mesh": mesh}
        for k in ("plain",) + _SHARDED:
            ms = per_repeat_max_median([r["samples"][k] for r in per_rank])
            row[f"{k}_ms"] = None if ms is None else ms * 1e3
        row["ratio"] = ratio(row["shardwise_ms"], row["torch_ms"])
        row["compiled_ratio"] = ratio(row[f"{COMPILED}_ms"], row["torch_ms"])
        hand = per_repeat_max_median([r["samples"][HAND] for r in per_rank]) if HAND in per_rank[0]["samples"] else None
        row[f"{HAND}_ms"] = None if hand is None else hand * 1e3
        row["compiled_vs_hand"] = ratio(row[f"{COMPILED}_ms"], row[f"{HAND}_ms"])
        row["first_loss"] = per_rank[0]["first_loss"]
        for name in _SHARDED:
            row[f"{name}_max_param_diff"] = max(r[f"{name}_max_param_diff"] for r in per_rank)
        row["compiled_programs"] = [r["compiled_programs"] for r in per_rank]
        wrong = [n for n in _SHARDED + (HAND,) if not all(r.get(f"{n}_ok", True) for r in per_rank)]
        if any(n != 1 for n in row["compiled_programs"]):  # it ran eagerly, or traced more than once
            wrong.append(f"{COMPILED} (programs {row['compiled_programs']}, want 1)")
        row["check"] = "ok" if not wrong else "WRONG: " + ",".join(wrong)
        table.rows.append(row)
        for w in sorted({w for r in per_rank for w in r["warnings"]}):
            table.notes.append(f"{label}: warning: {w}")
    table.notes.append("hand-written: the MLP step on this rank's pieces with one explicit all_reduce "
                       "(Megatron's f/g by hand) and fused AdamW, the floor a compiled step is measured against")
    table.notes.append("sw compiled: shardwise.compile over the same step function, traced in the warmup, "
                       "so every timed call replays; AdamW steps on its fused kernel there (the others: "
                       "torch's default, foreach)")
    table.notes.append("1-process: the unsharded model stepping on each rank in the same loop; "
                       "GPT attention runs as its math decomposition for all three (torch DTensor has no "
                       "strategy for the CPU flash kernel)")
    return [table]
