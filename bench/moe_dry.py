"""Dry run of a DeepSeek-V3-671B-shaped model on 1,024 ranks (pp 16 x ep 64), every pipeline stage, on one process.

The model: transformers' `DeepseekV3Config` at the published 671B sizes (61 layers, the
first 3 dense; hidden 7168, dense intermediate 18432; 256 routed experts of intermediate
2048, top-8 in 8 groups of which 4 are chosen, 1 shared expert; multi-head latent attention
with 128 heads, q_lora_rank 1536, kv_lora_rank 512, head dims 128 + 64 rope, values 128;
vocab 129280), bfloat16, its layers built on the meta device.

The layout is DeepSeek-V3's: 16 pipeline stages, and within a stage 64 ranks that are both
its expert-parallel and its data-parallel ranks (`ExpertParallel(tokens="split")` on every
`mlp.experts`, 4 whole experts per rank; `data_parallel` over the same 64 for the rest).

How a pp rank's step is dry-run: shardwise's pipeline cuts Hugging Face models with
`hf_sequential`, which does not know DeepSeek-V3's layers, so each pp rank's step is
dry-run as its stage alone: its layers (the first stage with the embedding, the last with
the final norm, the LM head and the loss) run forward on one micro-batch of `seq` tokens per
rank and backward from the gradient the next stage would send, then AdamW steps. All 16
stages are dry-run, one after the other, each as the rank at ep coordinate 0 of its stage
(`ranks=[stage * 64]`; under uniform routing every ep rank of a stage sends and holds the
same), so together the runs cover every layer once. Not in the reports: the activations
and gradients sent between stages (one hidden state per micro-batch each way, seq x 7168 x
2 bytes), and the micro-batches after the first (a step of m micro-batches sends m times
each MoE layer's all_to_alls).

    python -m bench.moe_dry [--layers 61] [--pp 16] [--ep 64] [--seq 4096] [--stages 0,1,15]

prints one row per stage (seconds, MoE layers, all_to_all bytes per layer and pass, expert
memory and peak per rank) and the total seconds, wall and CPU (the machine is shared: under
load, the CPU seconds are the ones to read); the bar is 30 s on this 2-core machine.
`--stages` dry-runs only those pp ranks. The peak per rank is large (about 64 GiB on a stage
of 4 layers at 4096 tokens) because a dry run models a CPU rank's kernels: for MLA's head
dims (192 for queries and keys, 128 for values) CPU attention takes the unfused math path,
which holds every head's 4096 x 4096 scores; a GPU's fused kernel would not.
`tests/debug/test_moe_dry_run.py` runs it with fewer layers and checks the bytes against
the formula.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Stage", "deepseek_v3_671b", "dry_run_stage", "main", "stage_layers"]

LAYERS, PP, EP, SEQ = 61, 16, 64, 4096


def deepseek_v3_671b(**changes: Any) -> Any:
    """transformers' DeepseekV3Config at DeepSeek-V3's published sizes (`changes` on top)."""
    import transformers

    sizes: dict[str, Any] = dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=163840, attn_implementation="sdpa", experts_implementation="grouped_mm",
        dtype="bfloat16")
    return transformers.DeepseekV3Config(**{**sizes, **changes})


def stage_layers(layers: int, pp: int) -> list[range]:
    """The decoder layers of each of `pp` stages: the larger stages first (61 over 16: 13 of 4, 3 of 3)."""
    size, extra = divmod(layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = size + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


class Stage(nn.Module):
    """Decoder layers `layers` of a DeepSeek-V3 (named by their index in the whole model), with
    the token embedding on the first stage and the final norm and LM head on the last."""

    def __init__(self, config: Any, layers: range, first: bool, last: bool) -> None:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        super().__init__()
        self.first, self.last = first, last
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): hf.DeepseekV3DecoderLayer(config, i) for i in layers})
        self.rotary_emb = hf.DeepseekV3RotaryEmbedding(config)
        self.norm = hf.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x  # (batch, seq, hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers.values():
            hidden = layer(hidden, position_ids=positions, position_embeddings=rotary)
        if self.norm is None or self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))  # (batch, seq, vocab)


def _step(stage: Stage, opt: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor) -> None:
    """One micro-batch through the stage and back, then the optimizer: the last stage's loss is
    the next-token cross-entropy on `target` (labels), the others' backward starts from
    `target` (the gradient the next stage sends)."""
    opt.zero_grad()
    out = stage(x)
    if stage.last:
        F.cross_entropy(out[:, :-1].flatten(0, 1).float(), target[:, 1:].flatten()).backward()
    else:
        out.backward(target)
    opt.step()


def dry_run_stage(config: Any, layers: Sequence[range], stage: int, *, pp: int, ep: int, seq: int,
                  routing: Any = None) -> Any:
    """The dry run of pp rank `stage`'s step (see the module docstring) on an abstract (pp, ep)
    mesh: the stage built on the meta device, experts over ep, the rest data parallel over ep."""
    import shardwise as sw
    from shardwise.debug import dry_run
    from shardwise.parallel import ExpertParallel, data_parallel, parallelize_module

    mesh = sw.AbstractMesh((pp, ep), ("pp", "ep"))
    first, last = stage == 0, stage == len(layers) - 1
    with torch.device("meta"):
        model = Stage(config, layers[stage], first, last).to(config.dtype)
    experts = [path for path, _ in model.named_modules() if path.endswith("mlp.experts")]
    parallelize_module(model, mesh["ep"], {path: ExpertParallel(tokens="split") for path in experts})
    data_parallel(model, mesh["ep"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hidden = (1, seq, config.hidden_size)
    x = torch.empty((1, seq), dtype=torch.long, device="meta") if first else \
        torch.empty(hidden, dtype=config.dtype, device="meta", requires_grad=True)
    target = torch.empty((1, seq), dtype=torch.long, device="meta") if last else \
        torch.empty(hidden, dtype=config.dtype, device="meta")
    return dry_run(_step, model, opt, x, target, mesh=mesh, ranks=[stage * ep], routing=routing)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_dry", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (61: the whole model)")
    p.add_argument("--pp", type=int, default=PP, help="pipeline stages")
    p.add_argument("--ep", type=int, default=EP, help="expert- and data-parallel ranks per stage")
    p.add_argument("--seq", type=int, default=SEQ, help="tokens per rank and micro-batch")
    p.add_argument("--stages", default=None, help="comma-separated pp ranks to dry-run (default: every stage)")
    args = p.parse_args(argv)
    stages = range(args.pp) if args.stages is None else [int(s) for s in args.stages.split(",")]
    if any(not 0 <= s < args.pp for s in stages):
        p.error(f"--stages {args.stages}: pp ranks in [0, {args.pp - 1}]")
    start = time.perf_counter()
    import shardwise  # noqa: F401
    import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401

    imported, cpu_start = time.perf_counter(), time.process_time()
    config = deepseek_v3_671b(num_hidden_layers=args.layers)
    layers = stage_layers(args.layers, args.pp)
    print(f"DeepSeek-V3-671B-shaped ({args.layers} layers), abstract mesh (pp {args.pp} x ep {args.ep}) = "
          f"{args.pp * args.ep} ranks, {args.seq} tokens per rank, one micro-batch per stage; imports "
          f"{imported - start:.1f} s")
    print(f"{'stage':>5} {'layers':>8} {'seconds':>8} {'moe':>4} {'fwd a2a/layer':>14} {'bwd a2a/layer':>14} "
          f"{'experts params':>15} {'+grads+optim':>13} {'peak/rank':>11}")
    for s in stages:
        began = time.perf_counter()
        report = dry_run_stage(config, layers, s, pp=args.pp, ep=args.ep, seq=args.seq)
        seconds = time.perf_counter() - began
        moe = report.ranks[0].moe
        n = len(moe.layers) if moe is not None else 0
        t = moe.totals() if moe is not None else dict.fromkeys(("forward", "backward", "parameters", "gradients",
                                                                "optimizer"), 0)
        span = f"{layers[s].start}-{layers[s].stop - 1}"
        print(f"{s:>5} {span:>8} {seconds:>8.2f} {n:>4} {_gib(t['forward'] / max(n, 1)):>14} "
              f"{_gib(t['backward'] / max(n, 1)):>14} {_gib(t['parameters']):>15} "
              f"{_gib(t['parameters'] + t['gradients'] + t['optimizer']):>13} {_gib(report.memory.peak):>11}")
    total, cpu = time.perf_counter() - imported, time.process_time() - cpu_start
    print(f"{len(stages)} stage(s) built, sharded and dry-run in {total:.1f} s ({cpu:.1f} s of CPU; bar: 30 s), "
          f"{time.perf_counter() - start:.1f} s with imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
