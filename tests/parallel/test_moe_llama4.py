"""Llama 4 under expert parallelism by token dispatch, against one process.

Llama 4's MoE block calls its experts on every token repeated for every expert, each copy
scaled by the router's score (zero where the expert was not chosen). `ExpertParallel(tokens=
"split")` on those experts sends only the chosen (non-zero) rows to their experts' owners and
brings the results back. After 3 AdamW steps in float64 the loss and every parameter, the
router's included, must equal one process stepping on the whole batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.parallel import ExpertParallel, HFPlanner, data_parallel, parallelize_module, route_counts
from shardwise.testing import distributed

from .test_moe_dispatch import pipe_three_steps

transformers = pytest.importorskip("transformers")

EXPERTS = "model.layers.*.feed_forward.experts"


def _model(**sizes: Any) -> Any:
    """A tiny text-only Llama 4 in float64: transformers' defaults but for the sizes (2 MoE layers of
    4 experts, top-1, a shared expert, chunked attention with qk-norm)."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**{
        **dict(vocab_size=64, hidden_size=16, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
               num_local_experts=4), **sizes})
    return transformers.Llama4ForCausalLM(config).double()


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _worst(reference: Any, model: Any) -> float:
    return max(((q.full_tensor() if isinstance(q, sw.DTensor) else q).detach() - p.detach()).abs().max().item()
               for p, q in zip(reference.parameters(), model.parameters()))


def _three_steps(reference: Any, model: Any, n: int, rows: int, dp_rank: Any = None) -> tuple[float, float]:
    """3 AdamW steps: one process on the global batch of `rows` rows per data-parallel rank, each
    of the `n` dp ranks (this one at `dp_rank`, default its global rank) on its own rows; (worst
    parameter difference, worst difference of the ranks' mean loss)."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    rank, worst_loss = dist.get_rank() if dp_rank is None else dp_rank, 0.0
    for _ in range(3):
        ids = torch.randint(0, 64, (rows * n, 8), generator=g)
        whole = _loss(reference, ids)
        whole.backward()
        loss = _loss(model, ids[rows * rank:rows * rank + rows])
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst_loss = max(worst_loss, abs(mean.item() / dist.get_world_size() - whole.item()))
    return _worst(reference, model), worst_loss


@distributed(world_size=4)
def test_llama4_token_dispatch_over_4_ranks_and_with_fully_shard_trains_like_one_process() -> None:
    from shardwise.fsdp import fully_shard

    # ep 4 borrowing the 4 dp ranks, by the HF plan's own style name for the experts
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    parallelize_module(model, mesh, HFPlanner({EXPERTS: "ep_dispatch_experts"}, plan="ep"))
    data_parallel(model, mesh, dp_dim="ep")
    worst, loss = _three_steps(reference, model, 4, 2)
    assert worst < 1e-10 and loss < 1e-10, ("ep 4", worst, loss)
    assert route_counts(model.model.layers[0].feed_forward.experts).routes == 2 * 8  # top-1: a row per token

    # ep 2 x efsdp 2: the experts split over ep and fully_shard over efsdp, the rest over all 4
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    moe = mesh.unflatten("dp_shard", (2, 2), ("efsdp", "ep"))
    for layer in model.model.layers:
        parallelize_module(layer.feed_forward.experts, moe["ep"], ExpertParallel(tokens="split"))
        fully_shard(layer.feed_forward.experts, mesh=moe["efsdp"])
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    worst, loss = _three_steps(reference, model, 4, 2)
    assert worst < 1e-10 and loss < 1e-10, ("ep 2 x efsdp 2", worst, loss)


@distributed(world_size=2)
def test_llama4_token_dispatch_over_2_ranks_with_two_experts_per_token_trains_like_one_process() -> None:
    reference = _model(num_experts_per_tok=2)  # (Llama 4 routes to 1: here each token's two rows are summed)
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    parallelize_module(model, mesh, {EXPERTS: ExpertParallel(tokens="split")})
    data_parallel(model, mesh, dp_dim="ep")
    worst, loss = _three_steps(reference, model, 2, 2)
    assert worst < 1e-10 and loss < 1e-10, (worst, loss)
    assert route_counts(model.model.layers[1].feed_forward.experts).routes == 2 * 8 * 2


@distributed(world_size=4)
def test_llama4_ep_spanning_tp_and_inside_a_dp_x_pp_pipeline_trains_like_one_process() -> None:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel
    from shardwise.pipeline import DistributedPipe

    # (dp 2, tp 2): attention split over tp, the experts over all 4 ranks, each tp rank dispatching
    # half of its chosen rows. Llama 4's rotary multiplies in float32 complex numbers, and the CPU
    # kernel rounds a head differently alone than beside another (2e-7 in one process): heads split
    # over tp would move q and k by that much, ep or not. So here every layer is one of Llama 4's
    # NoPE layers (full attention, no rotary), where tp is exact.
    reference = _model(num_key_value_heads=2, no_rope_layers=[0, 0])
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    attention = {f"model.layers.*.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
    parallelize_module(model, mesh["tp"], {**attention, "model.layers.*.self_attn.o_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer.feed_forward.experts, mesh, ExpertParallel(tokens=("split", "replicated")))
    data_parallel(model, mesh, dp_dim="dp")
    worst, loss = _three_steps(reference, model, 2, 2, dp_rank=mesh.get_local_rank("dp"))
    assert worst < 1e-10 and loss < 1e-10, ("dp x tp", worst, loss)

    # (dp 2, pp 2): each stage's experts split over its dp ranks, which route their own micro-batches
    reference = _model()
    model = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    for layer in model.model.layers:
        parallelize_module(layer.feed_forward.experts, mesh["dp"], ExpertParallel(tokens="split"))
    layers = torch.nn.Sequential(_Embed(model), *(_Layer(model, i) for i in range(2)), _Head(model))
    pipe = DistributedPipe(layers, [2, 2], mesh, schedule="1f1b", chunks=2, loss_fn=_next_token_loss)
    worst = pipe_three_steps(reference, model, pipe, mesh, _loss)
    assert worst < 1e-10, ("dp x pp", worst)


@distributed(world_size=2)
def test_llama4_under_transformers_own_tp_plan_trains_like_one_process() -> None:
    # regression: HFPlanner()'s "moe_tp_experts" took three inputs (tokens, expert ids, weights),
    # and Llama 4's experts take one (every token once per expert, weighted): the call failed.
    # NoPE layers, as in the dp x tp test above: tp is exact there
    reference = _model(num_key_value_heads=2, no_rope_layers=[0, 0])
    model = copy.deepcopy(reference)
    parallelize_module(model, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), HFPlanner())
    assert isinstance(model.model.layers[0].feed_forward.experts.down_proj, sw.DTensor)
    worst, loss = _three_steps(reference, model, 1, 2, dp_rank=0)
    assert worst < 1e-10 and loss < 1e-10, (worst, loss)


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class _Embed(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(ids)
        return out


class _Layer(torch.nn.Module):
    """Decoder layer `i` with what Llama4TextModel.forward gives it: its chunked causal mask, its
    positions and the rotary table."""

    def __init__(self, model: Any, i: int) -> None:
        super().__init__()
        self.layer, self.rotary, self.config = model.model.layers[i], model.model.rotary_emb, model.config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_chunked_causal_mask

        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_chunked_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                          position_ids=positions)
        out: torch.Tensor = self.layer(hidden, attention_mask=mask, position_ids=positions,
                                       position_embeddings=self.rotary(hidden, positions))
        return out


class _Head(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out


# regression: past attention_chunk_size each rank's local mask looked causal and was taken for the
# global causal rule, so chunked attention attended across chunks (loss 1.5e-3 off); NoPE layers'
# temperature tuning scaled queries by each rank's local token index (1.1e-5 off). Both were then
# refused; now the chunks are a global mask rule and the tuning reads global positions.
CP_CONFIGS = {
    "chunks longer than the sequence": {},
    "chunks of 8 and a tuned NoPE layer": dict(attention_chunk_size=8, floor_scale=4, no_rope_layers=[1, 0]),
}


@pytest.mark.parametrize("sizes", list(CP_CONFIGS.values()), ids=list(CP_CONFIGS))
@distributed(world_size=4)
def test_llama4_ep_over_the_cp_ranks_of_a_context_parallel_model_equals_one_process(sizes: dict[str, Any]) -> None:
    from shardwise.experimental import set_load_balance, set_rotate_method
    from shardwise.parallel import ContextParallel

    set_rotate_method("allgather")
    set_load_balance(True)
    reference = _model(**sizes)
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))  # 30: uneven over 8 chunks
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    parallelize_module(model, mesh, {EXPERTS: ExpertParallel(tokens="sequence")})
    parallelize_module(model, mesh, ContextParallel())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - want.item()) < 1e-6, (loss.item(), want.item())  # (transformers' loss is float32)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, sw.DTensor) else p.grad
        assert (grad - r.grad).abs().max().item() < 1e-10, name


def _block(num_experts: int, k: int) -> Any:
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = transformers.Llama4TextConfig(hidden_size=8, intermediate_size=6, num_local_experts=num_experts,
                                           num_experts_per_tok=k)
    torch.manual_seed(0)
    block = Llama4TextMoe(config).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
        if num_experts == 4 and k == 1:  # the last two experts' logits below the first's for any positive token
            block.router.weight[2:] = block.router.weight[0] - 1
    return block


BLOCK_CASES = {  # case -> (tokens per rank, experts, top_k)
    "experts no token reaches": ([5, 3], 4, 1),  # (rank 1's two: it receives no route)
    "experts uneven over the ranks": ([5, 3], 3, 2),  # 2 and 1
    "a zero token": ([5, 3], 4, 2),  # its chosen rows are zero rows: none is sent, none is missed
}


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
@distributed(world_size=2)
def test_llama4_block_routing_edge_cases_match_one_process_outputs_and_every_gradient(case: str) -> None:
    tokens, num_experts, k = BLOCK_CASES[case]
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3)
    xs = [torch.rand(t, 8, generator=g, dtype=torch.float64) + 0.1 for t in tokens]  # positive tokens
    if case == "a zero token":
        xs[1][2] = 0.0
    reference, block = _block(num_experts, k), _block(num_experts, k)
    x_all = torch.cat(xs).requires_grad_()
    y_all = reference(x_all)[0]
    dy = torch.randn(y_all.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (y_all * dy).sum().div(2).backward()  # the mean over ranks of each rank's own loss

    parallelize_module(block.experts, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)),
                       ExpertParallel(tokens="split"))
    start = sum(tokens[:rank])
    rows = slice(start, start + tokens[rank])
    x = xs[rank].clone().requires_grad_()
    y = block(x)[0]
    (y * dy[rows]).sum().backward()
    assert (y - y_all[rows]).abs().max().item() < 1e-12, case
    assert (x.grad - 2 * x_all.grad[rows]).abs().max().item() < 1e-12, case
    for (name, p), q in zip(block.named_parameters(), reference.parameters()):
        if isinstance(p, sw.DTensor):  # an expert stack: its gradient is the ranks' mean already
            got = p.grad.full_tensor()
        else:  # router, shared expert: each rank's own, averaged as data parallelism would
            got = p.grad.clone()
            dist.all_reduce(got)
            got /= 2
        assert (got - q.grad).abs().max().item() < 1e-12, (case, name)
    counts = route_counts(block.experts)
    assert counts.routes == tokens[rank] * k - (2 if case == "a zero token" and rank == 1 else 0), counts
    if case == "experts no token reaches":
        assert counts.per_expert.tolist()[2:] == [0, 0], counts


def test_llama4_capacity_form_and_a_missing_ep_plan_are_refused_naming_the_fix() -> None:
    mesh = sw.AbstractMesh((2,), ("ep",))
    with pytest.raises(ValueError, match=r"capacity_factor=1.0\) on Llama4TextExperts: a capacity counts each token's "
                                         r"top_k routes.*use dropless dispatch \(capacity_factor=None\)"):
        parallelize_module(_block(4, 1).experts, mesh, ExpertParallel(tokens="split", capacity_factor=1.0))
    with pytest.raises(ValueError, match=r"tokens=\"replicated\"\) on Llama4TextExperts: its experts take rows spread "
                                         r"over every expert \(Llama 4\), which only token dispatch runs"):
        parallelize_module(_block(4, 1).experts, mesh, ExpertParallel())
    with pytest.raises(ValueError, match=r"Llama4ForCausalLM carries no expert-parallel plan.*its experts dispatch "
                                         r"with HFPlanner\(\{'model.layers.\*.feed_forward.experts': "
                                         r"'ep_dispatch_experts'\}, plan='ep'\)"):
        HFPlanner(plan="ep").build_plan(_model())
