"""Expert parallelism by token dispatch on unchanged Hugging Face MoE models, against one process.

Each rank of the ep group holds its own rows of the global batch (ep borrows the data-parallel
ranks). `ExpertParallel(tokens="split")` sends every route to its expert's owner with one
all_to_all and brings the results home with another; `data_parallel` averages the dense
parameters. After 3 AdamW steps in float64 every parameter and the loss must equal one process
stepping on the whole batch. The edge cases route by hand through one experts module.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.debug import CommCounter, comm_log
from shardwise.parallel import ExpertParallel, HFPlanner, data_parallel, parallelize_module, route_counts
from shardwise.testing import distributed

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
MOE: dict[str, Callable[[], Any]] = {  # the eager experts: the model's own loop, which has float64 CPU kernels
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager")),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        experts_implementation="eager")),
    # group-limited routing (2 groups, 1 chosen), one shared expert, the first layer dense
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **SMALL, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        moe_intermediate_size=16, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, experts_implementation="eager")),
    # biases on every expert, a clamped gated activation, experts called with other argument names
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **SMALL, head_dim=8, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager")),
}


BY_HF_PLAN = {"qwen3_moe", "gpt_oss"}  # the others name their experts' style by hand


def _experts_paths(model: Any) -> list[str]:
    return [path for path, m in model.named_modules() if path.endswith("mlp.experts")]


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss in the model's dtype (transformers' own loss upcasts to float32, so a
    float64 comparison computes it here)."""
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# DeepSeek-V3's router computes in float32 whatever the model's dtype (its linear casts both
# sides): its weight's gradient is a float32 sum over the tokens. Each rank sums its own rows,
# so against one process summing the whole batch at once it differs by float32 rounding (1e-7
# relative, 2e-8 in the parameters after 3 steps), as any data parallelism would. One process
# stepping on the same global batch in one backward per rank's rows (gradient accumulation:
# the same sum, each block's float32 part as the ranks compute it) is the exact reference.
FLOAT32_INSIDE = {"deepseek_v3"}


def _reference_backward(model: Any, which: str, ids: torch.Tensor, ep: int) -> torch.Tensor:
    """One process's loss on the global batch `ids`, its gradients accumulated."""
    if which not in FLOAT32_INSIDE:
        loss = _loss(model, ids)
        loss.backward()
        return loss.detach()
    total = torch.zeros((), dtype=torch.float64)
    for block in ids.chunk(ep):
        loss = _loss(model, block) / ep
        loss.backward()
        total += loss.detach()
    return total


def _three_steps(which: str, reference: Any, model: Any, n: int) -> tuple[float, float]:
    """3 AdamW steps: one process on the global batch of 2 rows per rank, each of the `n` ranks on
    its own 2 rows; (worst parameter difference, worst difference of the ranks' mean loss)."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    rank, worst_loss = dist.get_rank(), 0.0
    for _ in range(3):
        ids = torch.randint(0, 64, (2 * n, 8), generator=g)
        whole = _reference_backward(reference, which, ids, n)
        opts[0].step()
        opts[0].zero_grad()
        loss = _loss(model, ids[2 * rank:2 * rank + 2])
        loss.backward()
        opts[1].step()
        opts[1].zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst_loss = max(worst_loss, abs(mean.item() / n - whole.item()))
    return _worst(reference, model), worst_loss


def _worst(reference: Any, model: Any) -> float:
    """The largest difference of any parameter from one process's (DTensors made whole)."""
    return max(((q.full_tensor() if isinstance(q, sw.DTensor) else q).detach() - p.detach()).abs().max().item()
               for p, q in zip(reference.parameters(), model.parameters()))


def _train(which: str, dtype: torch.dtype, ep: int, capacity_factor: Any = None) -> tuple[float, float]:
    """(worst parameter difference, worst loss difference) from one process after 3 AdamW steps."""
    torch.manual_seed(0)
    reference = MOE[which]().to(dtype)
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    if which in BY_HF_PLAN:  # the model's own expert-parallel plan (config.base_model_ep_plan)
        parallelize_module(model, mesh, HFPlanner(plan="ep"))
    else:
        style = ExpertParallel(tokens="split", capacity_factor=capacity_factor)
        parallelize_module(model, mesh, {path: style for path in _experts_paths(model)})
    data_parallel(model, mesh, dp_dim="ep")
    return _three_steps(which, reference, model, ep)


@pytest.mark.parametrize("which", sorted(MOE))
@distributed(world_size=4)
def test_token_dispatch_on_4_ranks_trains_like_one_process_on_the_global_batch(which: str) -> None:
    worst, loss = _train(which, torch.float64, 4)
    assert worst < 1e-10 and loss < 1e-10, (which, worst, loss)


@distributed(world_size=2)
def test_token_dispatch_on_2_ranks_trains_like_one_process_on_the_global_batch() -> None:
    worst, loss = _train("deepseek_v3", torch.float64, 2)  # 8 experts, 4 per rank
    assert worst < 1e-10 and loss < 1e-10, (worst, loss)


@distributed(world_size=4)
def test_token_dispatch_in_float32_keeps_the_loss_within_1e_5() -> None:
    worst, loss = _train("qwen3_moe", torch.float32, 4)
    assert loss < 1e-5, loss


def _experts(num_experts: int) -> Any:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=num_experts,
                                        experts_implementation="eager")
    torch.manual_seed(0)
    module = MixtralExperts(config).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def _routes(case: str, tokens: list[int], num_experts: int, k: int) -> tuple[list[Any], list[Any], list[Any]]:
    """Every rank's (hidden states, expert ids, weights) for `case`; the same on every rank."""
    g = torch.Generator().manual_seed(3)
    xs, ids, ws = [], [], []
    for r, t in enumerate(tokens):
        x = torch.randn(t, 8, generator=g, dtype=torch.float64)
        scores = torch.rand(t, num_experts, generator=g, dtype=torch.float64)
        if case == "an expert no token reaches":
            scores[:, num_experts - 1] = -1.0
        if case == "every token to one expert":
            scores[:, 1] = 2.0
        w, i = torch.topk(scores, k, dim=-1)
        xs.append(x), ids.append(i), ws.append(w / w.sum(-1, keepdim=True))
    return xs, ids, ws


CASES = {  # case -> (tokens per rank, experts, top_k)
    "an expert no token reaches": ([5, 3, 4, 6], 4, 2),
    "every token to one expert": ([5, 3, 4, 6], 4, 1),
    "a rank that sends no route out": ([5, 0, 4, 6], 4, 2),
    "experts uneven over the ranks": ([5, 3, 4, 6], 7, 2),  # 2, 2, 2 and 1 per rank
    "fewer tokens than ranks": ([1, 0, 0, 1], 4, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@distributed(world_size=4)
def test_routing_edge_cases_match_one_process_outputs_and_gradients(case: str) -> None:
    tokens, num_experts, k = CASES[case]
    rank = dist.get_rank()
    xs, ids, ws = _routes(case, tokens, num_experts, k)
    reference = _experts(num_experts)
    x_all = torch.cat(xs).requires_grad_()
    w_all = torch.cat(ws).requires_grad_()
    y_all = reference(x_all, torch.cat(ids), w_all)
    dy = torch.randn(y_all.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (y_all * dy).sum().div(4).backward()  # the mean over ranks of each rank's own loss

    module = _experts(num_experts)
    parallelize_module(module, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), ExpertParallel(tokens="split"))
    start = sum(tokens[:rank])
    rows = slice(start, start + tokens[rank])
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    y = module(x, ids[rank], w)
    (y * dy[rows]).sum().backward()
    assert (y - y_all[rows]).abs().max().item() < 1e-12 if tokens[rank] else y.shape == (0, 8)
    assert (x.grad - 4 * x_all.grad[rows]).abs().max().item() < 1e-12 if tokens[rank] else True
    assert (w.grad - 4 * w_all.grad[rows]).abs().max().item() < 1e-12 if tokens[rank] else True
    for name, p in module.named_parameters():
        q = dict(reference.named_parameters())[name]
        assert p.grad is not None, (case, name)  # zeros where no route reached this rank's experts
        assert (p.grad.full_tensor() - q.grad).abs().max().item() < 1e-12, (case, name)
    assert route_counts(module).routes == tokens[rank] * k


@distributed(world_size=4)
def test_the_bytes_on_the_wire_are_the_routed_hidden_states_out_and_back_plus_the_counts() -> None:
    tokens, num_experts, k = [5, 3, 4, 6], 4, 2
    rank = dist.get_rank()
    xs, ids, ws = _routes("bytes", tokens, num_experts, k)
    module = _experts(num_experts)
    parallelize_module(module, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), ExpertParallel(tokens="split"))
    x = xs[rank].clone().requires_grad_()
    with CommCounter(module) as counter:
        module(x, ids[rank], ws[rank]).sum().backward()
    owner = {e: e for e in range(4)}  # 4 experts on 4 ranks: expert e lives on rank e
    sent_away = sum(1 for e in ids[rank].reshape(-1).tolist() if owner[e] != rank)
    arrived = sum(1 for r in range(4) if r != rank for e in ids[r].reshape(-1).tolist() if owner[e] == rank)
    route = 8 * 8  # a float64 hidden state of 8
    bound = {"forward": route * (arrived + sent_away) + 8 * 3,  # + one int64 count from each other rank
             "backward": route * (sent_away + arrived)}
    got = {phase: sum(b for _, b in counter.totals(phase).values()) for phase in ("forward", "backward")}
    assert got == bound, (got, bound)
    kinds = {phase: {kind: n for kind, (n, _) in counter.totals(phase).items()} for phase in ("forward", "backward")}
    assert kinds == {"forward": {"all_to_all": 3}, "backward": {"all_to_all": 2}}, kinds
    # who reduces an expert's gradient: the dispatch itself, an average over the ep ranks
    from shardwise.debug import gradient_reducers

    (reducer,) = gradient_reducers(module.gate_up_proj)
    assert (reducer.registrant, reducer.level, reducer.ranks) == ("ExpertParallel", "layout", (0, 1, 2, 3)), reducer
    assert reducer.op.startswith("avg (1/4 on the way back)"), reducer


def _kept(index: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which (token, slot) routes an expert taking `capacity` routes per rank keeps: the first ones
    in token order."""
    seen: dict[int, int] = {}
    keep = torch.zeros(index.shape, dtype=torch.bool)
    for t in range(index.shape[0]):
        for s in range(index.shape[1]):
            e = int(index[t, s])
            seen[e] = seen.get(e, 0) + 1
            keep[t, s] = seen[e] <= capacity
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
@distributed(world_size=4)
def test_capacity_form_counts_its_drops_and_equals_one_process_dropping_the_same_routes(factor: float) -> None:
    tokens, num_experts, k = [6, 6, 6, 6], 4, 2
    rank = dist.get_rank()
    xs, ids, ws = _routes("capacity", tokens, num_experts, k)
    capacity = max(1, -(-int(factor * 6 * k) // num_experts))
    keeps = [_kept(i, capacity) for i in ids]
    reference = _experts(num_experts)
    x_all = torch.cat(xs).requires_grad_()
    w_all = torch.cat(ws).requires_grad_()
    y_all = reference(x_all, torch.cat(ids), w_all * torch.cat(keeps))
    dy = torch.randn(y_all.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (y_all * dy).sum().div(4).backward()

    module = _experts(num_experts)
    parallelize_module(module, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)),
                       ExpertParallel(tokens="split", capacity_factor=factor))
    rows = slice(6 * rank, 6 * rank + 6)
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    y = module(x, ids[rank], w)
    (y * dy[rows]).sum().backward()
    assert (y - y_all[rows]).abs().max().item() < 1e-12
    assert (x.grad - 4 * x_all.grad[rows]).abs().max().item() < 1e-12
    assert (w.grad - 4 * w_all.grad[rows]).abs().max().item() < 1e-12
    for name, p in module.named_parameters():
        assert (p.grad.full_tensor() - dict(reference.named_parameters())[name].grad).abs().max().item() < 1e-12
    counts = route_counts(module)
    assert counts.capacity == capacity and int(counts.dropped) == int((~keeps[rank]).sum())
    assert (int(counts.dropped) > 0) == (factor < 4.0)


@pytest.mark.parametrize("which", ["mixtral", "gpt_oss"])
@distributed(world_size=4)
def test_capacity_form_replays_under_shardwise_compile_like_one_process(which: str) -> None:
    # regression: transformers' eager experts loop finds each expert's rows by `nonzero`, so a
    # compiled step with the capacity form ran eagerly ("aten.nonzero reads tensor values"), and
    # integer indexing (`x[token]`) was refused as if it were a boolean mask
    torch.manual_seed(0)
    reference = MOE[which]().double()
    model, eager = copy.deepcopy(reference), copy.deepcopy(reference)  # compiled, and its eager twin
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    # 2.0 = experts / top-k: every expert may take every token of a rank, so nothing is dropped
    # and the step is one process's on the whole batch
    for m in (model, eager):
        parallelize_module(m, mesh, {p: ExpertParallel(tokens="split", capacity_factor=2.0) for p in _experts_paths(m)})
        data_parallel(m, mesh, dp_dim="ep")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (reference, model, eager)]

    def step(model: Any, opt: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = sw.compile(step)
    g, rank = torch.Generator().manual_seed(1), dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):  # the first step makes AdamW's state, the second is traced, then replays
            ids = torch.randint(0, 64, (8, 8), generator=g)
            step(reference, opts[0], ids)
            compiled(model, opts[1], ids[2 * rank:2 * rank + 2])
            step(eager, opts[2], ids[2 * rank:2 * rank + 2])
            for path in _experts_paths(model):  # a replay updates the counts as eager does
                got, want = route_counts(model.get_submodule(path)), route_counts(eager.get_submodule(path))
                assert torch.equal(got.per_expert, want.per_expert) and int(got.dropped) == int(want.dropped) == 0
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert not messages and compiled.programs() == 1, (messages, compiled.programs())
    assert _worst(reference, model) < 1e-10


@distributed(world_size=2)
def test_capacity_form_refuses_ranks_holding_different_token_counts_on_every_rank() -> None:
    module = _experts(4)
    parallelize_module(module, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)),
                       ExpertParallel(tokens="split", capacity_factor=1.0))
    t = 3 + dist.get_rank()
    with pytest.raises(ValueError, match=r"MixtralExperts: the ep ranks \[0, 1\] hold \[3, 4\] tokens"):
        module(torch.randn(t, 8, dtype=torch.float64), torch.zeros(t, 2, dtype=torch.int64),
               torch.ones(t, 2, dtype=torch.float64))


def test_bad_settings_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"capacity_factor=0.*a number > 0"):
        ExpertParallel(tokens="split", capacity_factor=0)
    with pytest.raises(ValueError, match=r"capacity_factor=-1.0.*a number > 0"):
        ExpertParallel(tokens="split", capacity_factor=-1.0)
    with pytest.raises(ValueError, match=r"pads the token dispatch: it needs tokens=\"split\""):
        ExpertParallel(capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"tokens='local'.*one of \('replicated', 'split', 'sequence'\)"):
        ExpertParallel(tokens="local")
    with pytest.raises(ValueError, match=r"4 experts cannot cover 8 ranks"):
        parallelize_module(_experts(4), sw.AbstractMesh((8,), ("ep",)), ExpertParallel(tokens="split"))


@distributed(world_size=2)
def test_a_router_output_the_style_cannot_read_is_refused_naming_the_module() -> None:
    module = _experts(4)
    parallelize_module(module, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), ExpertParallel(tokens="split"))
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"MixtralExperts: top_k=5 is above the 4 experts"):
        module(x, torch.zeros(3, 5, dtype=torch.int64), torch.ones(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"MixtralExperts reads hidden_states \(tokens, hidden\).*got \(3, 8\), \(3, 2\), \(3, 1\)"):
        module(x, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"top_k_index must hold expert ids"):
        module(x, torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.float64))


def _train_with_fully_shard(which: str, dp: int, ep: int) -> tuple[float, float]:
    """ep borrowing part of the dp ranks, as torchtitan lays it out: the dp dim split into
    (efsdp, ep); experts split over ep and fully_shard over efsdp, the dense layers fully_shard
    over every dp rank. (worst parameter difference, worst loss difference) after 3 AdamW steps."""
    from shardwise.fsdp import fully_shard

    torch.manual_seed(0)
    reference = MOE[which]().double()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (dp,), mesh_dim_names=("dp_shard",))
    moe = mesh.unflatten("dp_shard", (dp // ep, ep), ("efsdp", "ep"))
    for path in _experts_paths(model):
        experts = model.get_submodule(path)
        parallelize_module(experts, moe["ep"], ExpertParallel(tokens="split"))
        fully_shard(experts, mesh=moe["efsdp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _three_steps(which, reference, model, dp)


@distributed(world_size=4)
def test_ep_2_over_4_dp_ranks_with_fully_shard_trains_like_one_process() -> None:
    worst, loss = _train_with_fully_shard("deepseek_v3", 4, 2)  # (its shared expert and dense layer over all 4)
    assert worst < 1e-10 and loss < 1e-10, (worst, loss)


@distributed(world_size=4)
def test_ep_4_with_fully_shard_over_the_dense_layers_trains_like_one_process() -> None:
    worst, loss = _train_with_fully_shard("qwen3_moe", 4, 4)
    assert worst < 1e-10 and loss < 1e-10, (worst, loss)


@distributed(world_size=2)
def test_the_replicated_form_given_each_ranks_own_tokens_raises_on_every_rank_naming_the_fix() -> None:
    module = _experts(4)
    parallelize_module(module, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), ExpertParallel())
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batch
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"tokens=\"replicated\"\) on MixtralExperts: the ranks \[0, 1\] hold "
                                         r"different tokens.*use ExpertParallel\(tokens=\"split\"\)"):
        module(x, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2, dtype=torch.float64))


def test_hf_planner_reads_the_models_expert_parallel_plan() -> None:
    torch.manual_seed(0)
    model = MOE["gpt_oss"]()
    plan = HFPlanner(plan="ep").build_plan(model).plan
    assert plan == {"model.layers.*.mlp.experts": ExpertParallel(tokens="split")}, plan
    with pytest.raises(ValueError, match=r"HFPlanner\(plan='pp'\): \"tp\" .* or \"ep\""):
        HFPlanner(plan="pp")
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM carries no expert-parallel plan \(model.ep_plan"):
        HFPlanner(plan="ep").build_plan(dense)


@distributed(world_size=4)
def test_ep_inside_the_stages_of_a_data_parallel_pipeline_trains_like_one_process() -> None:
    # mesh (dp, pp): each stage's experts are split over its dp ranks, which route their own
    # micro-batches; the pipe averages the dense gradients over dp and leaves the experts alone
    from shardwise.pipeline import DistributedPipe, hf_loss, hf_sequential

    torch.manual_seed(0)
    reference = MOE["mixtral"]().double()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    for path in _experts_paths(model):
        parallelize_module(model.get_submodule(path), mesh["dp"], ExpertParallel(tokens="split"))
    layers = hf_sequential(model)
    pipe = DistributedPipe(layers, [2, len(layers) - 2], mesh, schedule="1f1b", chunks=2, loss_fn=hf_loss(model))
    worst = pipe_three_steps(reference, model, pipe, mesh, lambda m, ids: m(input_ids=ids, labels=ids).loss)
    assert worst < 1e-10, worst


def pipe_three_steps(reference: Any, model: Any, pipe: Any, mesh: Any,
                     loss: Callable[[Any, torch.Tensor], torch.Tensor]) -> float:
    """3 AdamW steps of a (dp 2, pp 2) pipe of `model`, each dp rank on its 4 rows of 8, beside one
    process on all 8 (`loss(reference, ids)`): the worst difference of the pipe's parameters."""
    opts = [torch.optim.AdamW(reference.parameters(), lr=1e-2), torch.optim.AdamW(pipe.parameters(), lr=1e-2)]
    g = torch.Generator().manual_seed(1)
    dp_rank = mesh.get_local_rank("dp")
    for _ in range(3):
        ids = torch.randint(0, 64, (8, 8), generator=g)
        loss(reference, ids).backward()
        pipe.step(ids[4 * dp_rank:4 * dp_rank + 4], ids[4 * dp_rank:4 * dp_rank + 4])
        for opt in opts:
            opt.step()
            opt.zero_grad()
    mine = {id(p) for p in pipe.parameters()}
    diffs = [((q.full_tensor() if isinstance(q, sw.DTensor) else q).detach() - p.detach()).abs().max().item()
             for p, q in zip(reference.parameters(), model.parameters()) if id(q) in mine]
    pipe.close()
    assert diffs, "the pipe holds none of the model's parameters"
    return max(diffs)


@pytest.mark.parametrize("which", ["mixtral", "qwen3_moe"])
@distributed(world_size=4)
def test_ep_spanning_the_tp_ranks_of_a_dp_x_tp_mesh_trains_like_one_process(which: str) -> None:
    # (dp 2, tp 2): attention split over tp by a torch-style plan, the dense parameters averaged
    # over dp; the experts split over all 4 ranks, each tp rank dispatching half of its rows
    from .test_hf_models import torch_style_plan

    torch.manual_seed(0)
    reference = MOE[which]().double()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {k: v for k, v in torch_style_plan(model).items() if not k.endswith("experts")}
    parallelize_module(model, mesh["tp"], plan)
    for path in _experts_paths(model):
        parallelize_module(model.get_submodule(path), mesh, ExpertParallel(tokens=("split", "replicated")))
    data_parallel(model, mesh, dp_dim="dp")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    dp_rank = mesh.get_local_rank("dp")
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 7), generator=g)  # 2 rows of 7 tokens per dp rank: 7 split 4 / 3 over tp
        _reference_backward(reference, which, ids, 2)
        _loss(model, ids[2 * dp_rank:2 * dp_rank + 2]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    worst = _worst(reference, model)
    assert worst < 1e-10, (which, worst)


@pytest.mark.parametrize("seq", [32, 30], ids=["32", "30-uneven"])
@distributed(world_size=4)
def test_ep_over_the_cp_ranks_of_a_context_parallel_model_equals_one_process(seq: int) -> None:
    # ContextParallel: the whole sequence on every rank, each computing its piece; the MoE layers
    # see each rank's own tokens, dispatched over the cp ranks; gradients are shares of one loss
    from shardwise.experimental import set_load_balance, set_rotate_method
    from shardwise.parallel import ContextParallel

    set_rotate_method("allgather")
    set_load_balance(True)
    torch.manual_seed(0)
    reference = MOE["mixtral"]().double()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    reference(input_ids=ids, labels=ids).loss.backward()  # (the model's own loss: the style splits its labels)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    for path in _experts_paths(model):
        parallelize_module(model.get_submodule(path), mesh, ExpertParallel(tokens="sequence"))
    parallelize_module(model, mesh, ContextParallel())
    model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, sw.DTensor) else p.grad
        assert (grad - r.grad).abs().max().item() < 1e-10, name


@distributed(world_size=4)
def test_deepseek_aux_loss_free_bias_equals_one_process_after_every_step() -> None:
    # the bias moves by the load of the global batch: counts summed over the ep ranks, once a step
    from shardwise.parallel import ExpertLoadBalancer

    torch.manual_seed(0)
    reference = MOE["deepseek_v3"]().double()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    parallelize_module(model, mesh, {path: ExpertParallel(tokens="split") for path in _experts_paths(model)})
    data_parallel(model, mesh, dp_dim="ep")
    balancers = [ExpertLoadBalancer(reference, coeff=0.05), ExpertLoadBalancer(model, coeff=0.05, mesh=mesh)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    biases = lambda m: [b for n, b in m.named_buffers() if n.endswith("e_score_correction_bias")]  # noqa: E731
    moved = False
    for _ in range(5):
        ids = torch.randint(0, 64, (8, 8), generator=g)
        _reference_backward(reference, "deepseek_v3", ids, 4)
        _loss(model, ids[2 * rank:2 * rank + 2]).backward()
        loads = [b.step() for b in balancers]
        assert all(torch.equal(a, b) for a, b in zip(*loads)), loads
        assert [int(x.sum()) for x in loads[0]] == [8 * 8 * 2]  # every token's 2 routes, in the one MoE layer
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for want, got in zip(biases(reference), biases(model)):
            assert torch.equal(want, got), (want, got)
            moved = moved or bool(want.abs().sum() > 0)
    assert moved
    worst = _worst(reference, model)
    assert worst < 1e-10, worst


def test_the_load_balancer_refuses_models_without_a_router_bias_and_bad_coefficients() -> None:
    from shardwise.parallel import ExpertLoadBalancer

    with pytest.raises(ValueError, match=r"MixtralForCausalLM has no MoE block whose router keeps an "
                                         r"e_score_correction_bias"):
        ExpertLoadBalancer(MOE["mixtral"]())
    with pytest.raises(ValueError, match=r"coeff=0\): a number > 0"):
        ExpertLoadBalancer(MOE["deepseek_v3"](), coeff=0)


@pytest.mark.parametrize("which", ["mixtral", "qwen3_moe"])
@distributed(world_size=4)
def test_the_auxiliary_load_balancing_loss_is_the_global_batchs(which: str) -> None:
    # output_router_logits: each model adds coef * E * sum_e f_e P_e to its loss; f (route shares)
    # summed over the ep ranks, P each rank's own, so the ranks' average is one process's loss
    from shardwise.parallel import global_router_loss

    torch.manual_seed(0)
    reference = MOE[which]().double()
    reference.config.output_router_logits, reference.config.router_aux_loss_coef = True, 0.5
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    parallelize_module(model, mesh, {path: ExpertParallel(tokens="split") for path in _experts_paths(model)})
    data_parallel(model, mesh, dp_dim="ep")
    global_router_loss(model, mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    for _ in range(3):
        ids = torch.randint(0, 64, (8, 8), generator=g)
        want = reference(input_ids=ids, labels=ids)
        want.loss.backward()
        got = model(input_ids=ids[2 * rank:2 * rank + 2], labels=ids[2 * rank:2 * rank + 2])
        got.loss.backward()
        aux = got.aux_loss.detach().clone()
        dist.all_reduce(aux)
        assert abs(aux.item() / 4 - want.aux_loss.item()) < 1e-6 * abs(want.aux_loss.item()), (aux, want.aux_loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    worst = _worst(reference, model)
    assert worst < 1e-10, (which, worst)


def test_the_global_router_loss_refuses_models_without_one_and_meshes_of_several_dims() -> None:
    from shardwise.debug import dry_mesh
    from shardwise.parallel import global_router_loss

    with pytest.raises(ValueError, match=r"LlamaForCausalLM's module .* has no load_balancing_loss_func"):
        global_router_loss(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), dry_mesh((4,)))
    with pytest.raises(ValueError, match=r"the 1-D mesh of the ranks whose tokens differ"):
        global_router_loss(MOE["mixtral"](), dry_mesh((2, 2), mesh_dim_names=("dp", "tp")))
