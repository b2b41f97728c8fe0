"""`dry_run` of expert parallelism by token dispatch: the all_to_all bytes and expert memory of a real run.

A small Mixtral (8 experts, top-2, 2 MoE layers) under `ExpertParallel(tokens="split")` and
`data_parallel` over 4 ranks takes one AdamW step, its routers replaced by deterministic
ones: round robin (slot j of token t to expert (t * 2 + j) % 8: what `routing="uniform"`
assumes), and a skewed rule that differs per rank (given to the dry run as a function). On
4 real gloo ranks every rank's all_to_alls (`comm_log`) and its MoE section (`moe_report`)
must equal the dry run's for that rank, routed the same way. The DeepSeek-V3-671B-shaped
bench (`bench/moe_dry.py`), cut to 5 layers over 2 stages, must report per MoE layer the
bytes the formula gives. Bad `routing=` values are refused with the fix.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.debug import CommCounter, MoeReport, dry_run, moe_report
from shardwise.parallel import ExpertParallel, data_parallel, parallelize_module
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, ROWS, SEQ = 8, 2, 2, 5  # 10 tokens, 20 routes per rank: 8 experts get 2 or 3 (remainders)


def _skewed(rank: int, token: int) -> int:
    """The skewed rule's first expert for `token` on `rank` (its second is the next one)."""
    return (3 * rank + token * token) % EXPERTS


def _skewed_routes(ep_rank: int, tokens: int, top_k: int, num_experts: int) -> list[int]:
    """What the skewed routers send from `ep_rank`: routes per expert, for `dry_run(routing=...)`."""
    counts = Counter((_skewed(ep_rank, t) + j) % num_experts for t in range(tokens) for j in range(top_k))
    return [counts[e] for e in range(num_experts)]


class _FixedRouter(nn.Module):
    """Mixtral's router with the experts chosen by a rule (weights still the softmax of its logits)."""

    def __init__(self, hidden: int, rule: str, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, hidden) * 0.1)
        self.rule, self.rank = rule, rank

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.weight.shape[1])
        logits = nn.functional.linear(x, self.weight)
        tokens = range(x.shape[0])
        first = [t * TOP_K if self.rule == "round robin" else _skewed(self.rank, t) for t in tokens]
        index = torch.tensor([[(f + j) % EXPERTS for j in range(TOP_K)] for f in first], device=x.device)
        weights = torch.softmax(logits.float(), dim=-1).gather(1, index)
        return logits, weights / weights.sum(-1, keepdim=True), index


def _sharded(mesh: Any, rule: str, rank: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                        experts_implementation="batched_mm")  # (the eager loop cannot run on meta)
    model = transformers.MixtralForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.gate = _FixedRouter(config.hidden_size, rule, rank)
    parallelize_module(model, mesh, {f"model.layers.{i}.mlp.experts": ExpertParallel(tokens="split") for i in range(2)})
    data_parallel(model, mesh, dp_dim="ep")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: Any, opt: Any, ids: torch.Tensor) -> None:
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(rank))


def _real(rule: str) -> tuple[list[int], MoeReport]:
    rank = dist.get_rank()
    model, opt = _sharded(sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), rule, rank)
    with sw.comm_log() as log, CommCounter(model) as counter:
        _step(model, opt, _ids(rank))
    return [r.bytes_received for r in log if r.op == "all_to_all"], moe_report(model, counter, opt)


@pytest.mark.parametrize("rule", ["round robin", "skewed"])
def test_a_dry_run_sends_and_holds_what_each_real_rank_does_under_the_same_routing(rule: str) -> None:
    real = run_distributed(_real, 4, rule)
    mesh = sw.AbstractMesh((4,), ("ep",))
    with torch.device("meta"):
        model, opt = _sharded(mesh, rule, 0)  # (the routers' choice on meta is unread: routing= says it)
    routing = "uniform" if rule == "round robin" else _skewed_routes
    report = dry_run(_step, model, opt, _ids(0), mesh=mesh, ranks=range(4), routing=routing)
    for rank, (log, moe) in enumerate(real):
        mine = report.rank(rank)
        assert [c.bytes for c in mine.collectives if c.kind == "all_to_all"] == log, (rule, rank)
        assert mine.moe is not None and mine.moe.layers == moe.layers, (rule, rank, mine.moe, moe)
        (first, _) = mine.moe.layers
        assert (first.experts, first.local_experts, first.routes) == (8, 2, ROWS * SEQ * TOP_K)
        assert first.forward[0] == 3 and first.backward[0] == 2  # counts, routes out, results back; and transposed
    if rule == "skewed":  # the ranks route differently, so they receive differently
        assert len({report.rank(r).moe.layers[0].forward for r in range(4)}) > 1  # type: ignore[union-attr]
    else:
        assert "routing: uniform" in str(report) and "default" not in str(report.rank(0).moe)
        assert report.to_dict()["ranks"][2]["moe"]["layers"][1]["path"] == "model.layers.1.mlp.experts"


def test_the_deepseek_v3_bench_reports_the_formulas_bytes_per_moe_layer() -> None:
    """The 671B shapes, 5 layers (3 dense, 2 MoE) over pp 2 x ep 64; the MoE stage alone."""
    from bench.moe_dry import deepseek_v3_671b, dry_run_stage, stage_layers

    config, seq, ep = deepseek_v3_671b(num_hidden_layers=5), 256, 64
    layers = stage_layers(5, 2)
    assert [list(r) for r in layers] == [[0, 1, 2], [3, 4]] and stage_layers(61, 16)[-1] == range(58, 61)
    report = dry_run_stage(config, layers, 1, pp=2, ep=ep, seq=seq)
    moe = report.ranks[0].moe
    assert report.ranks[0].rank == 64 and moe is not None and "the default" in moe.routing
    e, k, h, local = 256, 8, 7168, 4  # bfloat16: 2 bytes a value
    routes_away = seq * k * (e - local) // e  # under uniform routing, of this rank's routes and of those it receives
    assert [m.path for m in moe.layers] == ["layers.3.mlp.experts", "layers.4.mlp.experts"]
    for m in moe.layers:
        assert (m.experts, m.local_experts, m.routes) == (e, local, seq * k)
        assert m.forward == (3, 2 * routes_away * h * 2 + (ep - 1) * local * 8), m  # + the int64 route counts
        assert m.backward == (2, 2 * routes_away * h * 2), m
        assert m.parameters == local * 3 * 2048 * h * 2 == m.gradients
        assert m.optimizer >= 2 * m.parameters  # AdamW's two moments (and its step count)


def test_bad_routing_values_are_refused_with_the_fix() -> None:
    mesh = sw.AbstractMesh((4,), ("ep",))
    with torch.device("meta"):
        model, opt = _sharded(mesh, "round robin", 0)
    step = (_step, model, opt, _ids(0))
    with pytest.raises(ValueError, match=r"gives 3 shares, but model.layers.0.mlp.experts routes over 8 experts: give "
                                         r"one share per expert"):
        dry_run(*step, mesh=mesh, routing=[0.5, 0.25, 0.25])
    with pytest.raises(ValueError, match=r"share -0.25 of expert 1 is not a number >= 0"):
        dry_run(*step, mesh=mesh, routing=[0.5, -0.25, 0.75] + [0.0] * 5)
    with pytest.raises(ValueError, match=r"the shares sum to 0.5, not 1; .*\(e.g. counts / counts.sum\(\)\)"):
        dry_run(*step, mesh=mesh, routing=[0.0625] * 8)
    with pytest.raises(ValueError, match=r"dry_run\(routing='zipf'\): give 'uniform', a share per expert"):
        dry_run(*step, mesh=mesh, routing="zipf")
    with pytest.raises(TypeError, match=r"got int"):
        dry_run(*step, mesh=mesh, routing=3)
    with pytest.raises(ValueError, match=r"expert 0 the share 0.6 .* each share is at most 1/top_k = 0.5"):
        dry_run(*step, mesh=mesh, routing=[0.6] + [0.4 / 7] * 7)
    with pytest.raises(ValueError, match=r"returned \[20, 0, 0, 0, 0, 0, 0, 0\] .* give 8 ints, each in \[0, 10\] \(a "
                                         r"token routes to an expert once\), summing to 20"):
        dry_run(*step, mesh=mesh, routing=lambda rank, tokens, k, e: [tokens * k] + [0] * (e - 1))
    shares = torch.tensor([1.0, 1, 1, 1, 2, 2, 4, 4]) / 16  # a tensor of shares is taken as its values
    assert dry_run(*step, mesh=mesh, routing=shares).ranks[0].moe is not None
