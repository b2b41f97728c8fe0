"""Token dispatch beside torchtitan 0.3's expert parallelism: one DeepSeek-V3-shaped MoE layer's train step on 4 ranks.

torchtitan is not a dependency of shardwise, so this benchmark is not part of `python -m
bench` nor of the smoke test; it runs against a scratch install that reuses our torch
(never let pip touch torch: every install is --no-deps):

    python -m pip install --target /tmp/ttenv --no-deps torchtitan==0.3.0 spmd_types==0.2.3 \\
        tyro docstring_parser typeguard triton
    PYTHONPATH=/tmp/ttenv .venv/bin/python -m bench.moe_torchtitan [--quick] [--repeats N] [--backend B]

(from the repository root; torchtitan's MoE imports spmd_types, its config imports tyro, its
token dispatcher module imports triton at the top, for kernels the CPU path never runs; on a
loaded machine `SHARDWISE_TEST_TIMEOUT=600` gives the 4 workers longer to start). Without
torchtitan it prints one line, "skipped: torchtitan not importable (...)", and exits 0.

One gloo run of 4 ranks, float32, one sequence per rank (the shapes of `moe.py` at full
size: hidden 256, 8 routed experts, top 2, 1 shared expert, expert width 256, 256 tokens);
every contender starts from the same weights, drawn once for transformers' block and copied:
- torchtitan: its `MoE` (`TokenChoiceTopKRouter`, `RoutedExperts` = `GroupedExperts` +
  `AllToAllTokenDispatcher`, a shared `FeedForward`), sharded as torchtitan shards it:
  `set_moe_sharding_config(enable_ep=True)` and `Module.parallelize(ParallelDims(dp_shard=4,
  ep=4))`, run inside its train context; each route goes to its expert's owner by
  all_to_all (after an all_to_all of the counts) and back. Its backend is
  `spmd_backend="partial_dtensor"` (DTensor on the model-parallel axes, the expert weights
  `Shard(0)` over ep; functional `all_to_all_single`): the default, "spmd_types", cannot
  dispatch over gloo: its uneven all_to_all (`spmd_types/_collectives.py`,
  `_AllToAllUneven.forward`) calls the list form `dist.all_to_all`, and gloo's list form takes
  equal pieces only ("ProcessGroupGloo::alltoall: invalid tensor size at index 1 (expected
  (121, 256), got (140, 256))" on every rank at the first dispatch; `--backend spmd_types`
  shows it).
  As shipped, `GroupedExperts` casts tokens and weights to bfloat16 for `torch._grouped_mm`;
- torchtitan, experts in float32: the same with `GroupedExperts.forward` replaced by a loop
  over the local experts in float32 (torchtitan 0.3 has no `use_grouped_mm=False`; the loop
  is what older torchtitan ran on that flag), so it computes what the other two compute;
- shardwise: transformers' `DeepseekV3MoE` (eager experts) with
  `ExpertParallel(tokens="split")` on its `experts`.
The step: forward of the layer on this rank's (1, 256, 256) input (which requires grad, as a
layer's input inside a model does), loss = mean of the output squared, backward, the dense
parameters' gradients (router, shared expert: whole on every rank) averaged over the 4 ranks,
AdamW over the layer's parameters (this rank's pieces). That average is data parallelism's
job: shardwise's `data_parallel(dp_dim="ep")` (as `moe.py`; shardwise refuses to step plain
parameters whose gradients differ between ranks), and for torchtitan one all-reduce of those
gradients in one bucket, as DDP would (torchtitan's trainer shards them with FSDP2 instead,
`apply_fsdp_to_decoder`: more bytes, less memory; left out so the two sides differ in their
expert parallelism only).

Per contender: the slowest rank's step, median over repeats timed in rotating alternation
after a barrier; the bytes a rank receives in one step (the largest rank), counted at torch's
door for both (a dispatch mode over `torch.ops.c10d` and the functional collectives, each
collective as shardwise's `CommCounter` counts it: an all_to_all without this rank's own
slice); and a check: on the first step (the same weights), each rank's output and input
gradient against the float32 torchtitan layer's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ._common import FULL, QUICK, Column, Settings, Table, interleaved, load_average, per_repeat_max_median, quiet, ratio

__all__ = ["missing", "body", "run", "main"]

EP = 4
EXPERTS, TOP_K, SHARED, SCALE = 8, 2, 1, 2.5  # DeepSeek-V3's routing: sigmoid scores, top-k renormalised, x 2.5
WHO = ("tt", "tt32", "sw")
LABEL = {"tt": "torchtitan 0.3 MoE + EP (as shipped: experts in bfloat16, torch._grouped_mm)",
         "tt32": "torchtitan 0.3 MoE + EP, experts in float32 (loop over local experts)",
         "sw": "shardwise ExpertParallel(tokens=\"split\"), transformers DeepseekV3MoE"}
TOLERANCE = 1e-4  # relative, float32
BACKENDS = ("partial_dtensor", "spmd_types")  # torchtitan's spmd_backend: the first runs on gloo, its default does not


def _sizes(settings: Settings) -> tuple[int, int, int]:
    """(hidden, expert width, tokens per rank): `moe.py`'s at full size."""
    return (32, 16, 16) if settings.quick else (256, 256, 256)


def missing() -> Optional[str]:
    """Why torchtitan's MoE and expert parallelism cannot be imported here, or None when they can."""
    try:
        import torchtitan.distributed.parallel_dims  # noqa: F401
        import torchtitan.models.common.moe  # noqa: F401
        import torchtitan.models.common.moe_sharding  # noqa: F401
    except Exception as exc:  # a missing dependency of theirs is as final as their absence
        return f"{type(exc).__name__}: {exc}"
    return None


# -- counting at torch's door -------------------------------------------------------------


def _group(pg_or_name: Any) -> tuple[int, int]:
    """(this rank's index, size) of a process group given as an object or by name (functional collectives)."""
    import torch.distributed as dist

    if isinstance(pg_or_name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg_or_name = _resolve_process_group(pg_or_name)
    elif not isinstance(pg_or_name, dist.ProcessGroup):  # c10d's ops see it boxed, as a ScriptObject
        pg_or_name = dist.ProcessGroup.unbox(pg_or_name)
    return int(pg_or_name.rank()), int(pg_or_name.size())


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _all_to_all(out_rows: int, row_bytes: int, splits: Optional[Sequence[int]], index: int, size: int) -> int:
    """What an all_to_all brings in, this rank's own slice left out."""
    pieces = list(splits) if splits else [out_rows // size] * size
    return sum(p for j, p in enumerate(pieces) if j != index) * row_bytes


def _received(name: str, args: Sequence[Any]) -> Optional[int]:
    """Bytes this rank receives in the collective `name` (c10d or functional) called with `args`;
    None for an op that is no collective."""
    if name == "c10d::alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
        out = args[0]
        index, size = _group(args[2])
        return _all_to_all(out.shape[0], _row_bytes(out), args[3], index, size)
    if name in ("_c10d_functional::all_to_all_single", "_c10d_functional_autograd::all_to_all_single"):
        x, index_size = args[0], _group(args[3])  # (input, output_split_sizes, input_split_sizes, group_name)
        rows = sum(args[1]) if args[1] else x.shape[0]
        return _all_to_all(rows, _row_bytes(x), args[1], *index_size)
    if name == "c10d::allreduce_":  # (tensors, group, op, ...): a ring's 2 (n - 1) / n
        _, size = _group(args[1])
        return sum(int(2 * (size - 1) / size * _bytes(t)) for t in args[0])
    if name == "_c10d_functional::all_reduce":  # (input, op, group_name)
        _, size = _group(args[2])
        return int(2 * (size - 1) / size * _bytes(args[0]))
    if name == "c10d::_allgather_base_":  # (output, input, group, ...)
        _, size = _group(args[2])
        return (size - 1) * _bytes(args[1])
    if name == "_c10d_functional::all_gather_into_tensor":  # (input, group_size, group_name)
        return (int(args[1]) - 1) * _bytes(args[0])
    if name == "c10d::_reduce_scatter_base_":  # (output, input, group, ...)
        _, size = _group(args[2])
        return (size - 1) * _bytes(args[0])
    if name == "_c10d_functional::reduce_scatter_tensor":  # (input, op, group_size, group_name)
        size = int(args[2])
        return (size - 1) * _bytes(args[0]) // size
    if name == "c10d::broadcast_":  # (tensors, group, root_rank, ...)
        index, _ = _group(args[1])
        return 0 if index == int(args[2]) else sum(_bytes(t) for t in args[0])
    if name.startswith("c10d::"):
        return 0  # counted, bytes unknown (barriers and the like)
    return None  # no collective (compute, or the functional collectives' wait and wrap ops)


_KINDS = {"alltoall_base": "all_to_all", "all_to_all_single": "all_to_all", "allreduce": "all_reduce",
          "allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}  # c10d's, functional's


class Wire(TorchDispatchMode):
    """Every collective torch.distributed runs on this thread inside the block: count and bytes in, per kind."""

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        received = _received(name, args)
        if received is not None:
            op = name.split("::")[-1].strip("_")
            kind = _KINDS.get(op, op)
            tally = self.totals.setdefault(kind, [0, 0])
            tally[0] += 1
            tally[1] += received
        return out


# -- the contenders -----------------------------------------------------------------------


def _hf_block(hidden: int, inter: int) -> nn.Module:
    """transformers' DeepseekV3MoE (eager experts), weights drawn from seed 0."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=inter,
                                           n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=SHARED,
                                           n_group=1, topk_group=1, routed_scaling_factor=SCALE, norm_topk_prob=True,
                                           experts_implementation="eager")
    torch.manual_seed(0)
    block = DeepseekV3MoE(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def _float32_experts(self: nn.Module, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """`GroupedExperts.forward` without its bfloat16 cast: each local expert's rows, SwiGLU, in float32."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    pieces = torch.split(x_RD, num_tokens_per_expert_E.tolist())  # (rows of expert e, hidden) each
    return torch.cat([(F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T for e, rows in enumerate(pieces)])


def _tt_dims(backend: str) -> Any:
    """torchtitan's ParallelDims for 4 ranks of data parallelism with ep=4 borrowing them."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils

    parallel_dims.device_type = "cpu"  # torchtitan takes "cuda" when torch sees no accelerator
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=EP, world_size=EP,
                                      spmd_backend=backend)  # type: ignore[arg-type]
    utils.set_spmd_backend(backend)  # what torchtitan's trainer does with its config's
    dims.build_mesh()
    return dims


def _tt_block(hf: nn.Module, dims: Any, hidden: int, inter: int, float32: bool) -> nn.Module:
    """torchtitan's MoE with `hf`'s weights, sharded for EP as torchtitan's DeepSeek-V3 shards it."""
    import spmd_types as spmd
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config, make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    init = {"weight": nn.init.zeros_, "bias": nn.init.zeros_}  # overwritten below by hf's weights
    config = make_moe_config(
        num_experts=EXPERTS,
        router=make_router_config(dim=hidden, num_experts=EXPERTS, gate_param_init=init, top_k=TOP_K,
                                  score_func="sigmoid", route_norm=True, route_scale=SCALE),
        routed_experts=make_routed_experts_config(dim=hidden, hidden_dim=inter, num_experts=EXPERTS, top_k=TOP_K,
                                                  param_init={n: nn.init.zeros_ for n in ("w1_EFD", "w2_EDF", "w3_EFD")},
                                                  comm_backend="standard"),
        shared_experts=make_ffn_config(dim=hidden, hidden_dim=inter * SHARED, w1_param_init=init, w2w3_param_init=init))
    set_moe_sharding_config(config, enable_ep=True, enable_sp=False,
                            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
    block: nn.Module = config.build()
    block.init_states()  # type: ignore[operator]
    experts = block.routed_experts.inner_experts
    with torch.no_grad():
        block.router.gate.weight.copy_(hf.gate.weight)
        experts.w1_EFD.copy_(hf.experts.gate_up_proj[:, :inter])  # HF's gate half
        experts.w3_EFD.copy_(hf.experts.gate_up_proj[:, inter:])  # its up half
        experts.w2_EDF.copy_(hf.experts.down_proj)
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(block.shared_experts, mine).weight.copy_(getattr(hf.shared_experts, theirs).weight)
    if float32:
        experts.forward = _float32_experts.__get__(experts)  # before parallelize wraps the forward
    block.parallelize(dims)  # type: ignore[operator]
    return block


def _sw_block(hf: nn.Module, mesh: Any) -> nn.Module:
    """`hf`'s copy with its experts dispatched over the ep ranks and the rest data-parallel (as `moe.py`)."""
    from shardwise.parallel import ExpertParallel, data_parallel, parallelize_module

    block = parallelize_module(copy.deepcopy(hf), mesh, {"experts": ExpertParallel(tokens="split")})
    return data_parallel(block, mesh, dp_dim="ep")


def _average_dense_gradients(block: nn.Module) -> None:
    """What data parallelism does for torchtitan's dense parameters (router, shared expert), as one bucket: the
    mean over the ranks of their gradients, by one all-reduce (the experts' are DTensors, complete already)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in block.parameters() if p.grad is not None and not isinstance(p, DTensor)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, piece in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def _stepper(block: nn.Module, x: torch.Tensor, titan: Optional[Callable[[], Any]]
             ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """One train step (forward, backward, AdamW) of `block` on `x`, torchtitan's inside its `titan` context;
    returns (output, input gradient)."""
    opt = torch.optim.AdamW([p for p in block.parameters() if p.requires_grad], lr=1e-3)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()  # a layer's input inside a model wants its gradient
        with contextlib.nullcontext() if titan is None else titan():
            out = block(inp)
            out.float().pow(2).mean().backward()
        if titan is not None:
            _average_dense_gradients(block)
        opt.step()
        assert inp.grad is not None
        return out.detach(), inp.grad

    return step


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def _drop_unnumbered_groups() -> None:
    """Destroy the process groups that keep no sequence number: torchtitan's "fake" ones (its mesh dims of size
    1); the worker harness reads every group's number after a body, and those raise."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        try:
            pg._get_sequence_number_for_group()
        except RuntimeError:
            dist.destroy_process_group(pg)


def body(settings: Settings, backend: str) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist
    from torchtitan.distributed.utils import get_spmd_context

    import shardwise as sw
    from shardwise.debug import CommCounter

    hidden, inter, seq = _sizes(settings)
    rank = dist.get_rank()
    x = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(100 + rank))
    out: dict[str, dict[str, Any]] = {who: {} for who in WHO}
    steps: dict[str, Callable[[], object]] = {}
    with quiet():
        hf = _hf_block(hidden, inter)
        dims = _tt_dims(backend)
        titan = get_spmd_context(parallel_dims=dims)
        blocks = {"tt": _tt_block(hf, dims, hidden, inter, float32=False),
                  "tt32": _tt_block(hf, dims, hidden, inter, float32=True),
                  "sw": _sw_block(hf, sw.init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",)))}
        first: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for who in WHO:
            step = _stepper(blocks[who], x, None if who == "sw" else titan)
            first[who] = step()  # the same weights for all three
            step()
            with Wire() as wire:
                if who == "sw":
                    with CommCounter(blocks[who]) as counter:
                        step()
                    out[who]["counter"] = sum(b for _, b in counter.totals().values())
                else:
                    step()
            out[who]["wire"] = sum(b for _, b in wire.totals.values())
            out[who]["collectives"] = wire.totals
            steps[who] = step
        for who in WHO:
            y, g = first[who]
            out[who]["error"] = max(_error(y, first["tt32"][0]), _error(g, first["tt32"][1]))
        dist.barrier()
        samples = interleaved(steps, settings.repeats, before=dist.barrier)
        dist.barrier()
        _drop_unnumbered_groups()
    for who in WHO:
        out[who]["seconds"] = samples[who]
    return out


def run(settings: Settings, backend: str = BACKENDS[0]) -> list[Table]:
    from shardwise.testing import run_distributed

    hidden, inter, seq = _sizes(settings)
    per_rank = run_distributed(body, EP, settings, backend, timeout=3 * settings.timeout)
    table = Table(
        "moe_torchtitan",
        f"token dispatch beside torchtitan 0.3's expert parallelism: one DeepSeek-V3-shaped MoE layer (hidden "
        f"{hidden}, {EXPERTS} experts, top {TOP_K}, {SHARED} shared, expert width {inter}, float32), 1 x {seq} tokens "
        f"per rank, ep={EP}, train step (forward, backward, AdamW): step (slowest rank), MiB a rank receives "
        f"(largest rank)",
        [Column("who", "who"), Column("step_ms", "step ms", ".1f"), Column("time_vs_tt", "time / torchtitan", ".2f"),
         Column("time_vs_tt32", "time / torchtitan fp32", ".2f"), Column("wire_mib", "MiB received / step", ".3f"),
         Column("wire_vs_tt", "bytes / torchtitan", ".2f"), Column("dispatch_mib", "of which all_to_all", ".3f"),
         Column("dispatch_vs_tt", "all_to_all / torchtitan", ".2f"),
         Column("collectives", "collectives per step (rank 0: count, MiB received)"), Column("check", "check")],
    )
    seconds = {who: per_repeat_max_median([r[who]["seconds"] for r in per_rank]) for who in WHO}
    wire = {who: max(r[who]["wire"] for r in per_rank) for who in WHO}
    dispatch = {who: max(r[who]["collectives"].get("all_to_all", [0, 0])[1] for r in per_rank) for who in WHO}
    for who in WHO:
        row: dict[str, Any] = {"who": LABEL[who], "step_ms": None if seconds[who] is None else seconds[who] * 1e3,
                               "time_vs_tt": ratio(seconds[who], seconds["tt"]),
                               "time_vs_tt32": ratio(seconds[who], seconds["tt32"]),
                               "wire": wire[who], "wire_mib": wire[who] / 2**20,
                               "wire_vs_tt": ratio(wire[who], wire["tt"]), "dispatch": dispatch[who],
                               "dispatch_mib": dispatch[who] / 2**20,
                               "dispatch_vs_tt": ratio(dispatch[who], dispatch["tt"])}
        kinds = per_rank[0][who]["collectives"]
        row["collectives"] = ", ".join(f"{k} {n} ({b / 2**20:.3f})" for k, (n, b) in sorted(kinds.items())) or "-"
        row["collective_counts"] = {k: n for k, (n, _) in kinds.items()}
        worst = max(r[who]["error"] for r in per_rank)
        row["error"] = worst
        if who == "tt32":
            row["check"] = "(reference)"
        elif who == "tt":
            row["check"] = f"bfloat16 experts: {worst:.1e} off float32"
        else:
            row["check"] = "ok" if worst <= TOLERANCE else f"off by {worst:.1e} relative"
        if "counter" in per_rank[0][who]:
            row["comm_counter"] = max(r[who]["counter"] for r in per_rank)
        table.rows.append(row)
    counted = table.rows[WHO.index("sw")].get("comm_counter")
    table.notes.append("MiB received: one step's collectives counted at torch's door for both (c10d and functional "
                       "collectives; an all_to_all without this rank's own slice, an all-reduce 2 (n-1)/n of its "
                       "buffer)" + ("" if counted is None else f"; shardwise's own CommCounter says "
                                    f"{counted / 2**20:.3f} MiB for its row"))
    table.notes.append("check: on the first step (the same weights for all three), each rank's layer output and input "
                       f"gradient against torchtitan's float32 layer, max abs difference / max abs, within "
                       f"{TOLERANCE:g} (the worst rank)")
    table.notes.append("torchtitan: MoE.Config from make_moe_config, set_moe_sharding_config(enable_ep=True), "
                       f"Module.parallelize(ParallelDims(dp_shard=4, ep=4)), spmd_backend={backend!r}, forward and "
                       "backward inside its train context (get_spmd_context); AllToAllTokenDispatcher; "
                       "parallel_dims.device_type set to 'cpu' (torchtitan takes 'cuda' when torch sees no GPU); "
                       "its default backend, 'spmd_types', fails on gloo at the first dispatch (the list form of "
                       "all_to_all, equal pieces only)")
    table.notes.append("dense parameters (router, shared expert) are whole on every rank; their gradients are "
                       "averaged over the 4 ranks in every row: shardwise's data_parallel(dp_dim='ep'), and for "
                       "torchtitan one all-reduce of them in one bucket (DDP's way; its trainer would use FSDP2)")
    return [table]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_torchtitan", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats; timings mean nothing")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per contender")
    parser.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                        help="torchtitan's spmd_backend (its default, spmd_types, fails on gloo)")
    args = parser.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"skipped: torchtitan not importable ({why})")
        return 0
    from shardwise.testing import shutdown_pools

    settings = (QUICK if args.quick else FULL).with_repeats(args.repeats)
    try:
        for table in run(settings, args.backend):
            table.load = load_average()
            print(table.render(), flush=True)
    finally:
        shutdown_pools()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
