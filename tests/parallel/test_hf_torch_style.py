"""Torch-style plans a user ports to models beyond Llama: BERT, T5, Phi-3, Qwen3, Mixtral.

A torch-style plan names the attention and MLP projections (column-split q/k/v/up, row-split
o/down, local outputs) and leaves everything else plain, as `torch.distributed.tensor.parallel`
does. Each cell trains 4 AdamW steps against the same unchanged Hugging Face model in one
process (float64: every parameter to 1e-10), or, where the plan cannot be right, is refused
when the plan is applied or at the first backward, naming the layer and the style that fixes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise._placement import _StridedShard
from shardwise.parallel import (ColwiseParallel, FusedColwiseParallel, HFPlanner, ReplicateParallel, RowwiseParallel,
                                SequenceParallel, data_parallel, parallelize_module)
from shardwise.testing import distributed

from .test_hf_models import ALL_MODELS, _full, _loss, torch_style_plan

pytest.importorskip("transformers")


def bert_plan(model: Any) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(len(model.bert.encoder.layer)):
        p = f"bert.encoder.layer.{i}."
        plan.update({p + n: ColwiseParallel() for n in ("attention.self.query", "attention.self.key",
                                                         "attention.self.value", "intermediate.dense")})
        plan.update({p + n: RowwiseParallel() for n in ("attention.output.dense", "output.dense")})
    return plan


def t5_plan(model: Any) -> dict[str, Any]:
    """Self-attention and the MLP split; the relative position bias split by heads with them (an
    Embedding split by columns: each rank looks up its heads' biases). Cross-attention stays whole:
    T5 builds its zero position bias there with the model's head count, under torch as here."""
    plan: dict[str, Any] = {}
    for stack in ("encoder", "decoder"):
        for i in range(len(getattr(model, stack).block)):
            p = f"{stack}.block.{i}.layer."
            plan.update({f"{p}0.SelfAttention.{n}": ColwiseParallel() for n in "qkv"})
            plan[f"{p}0.SelfAttention.o"] = RowwiseParallel()
            if i == 0:
                plan[f"{p}0.SelfAttention.relative_attention_bias"] = ColwiseParallel()
            mlp = f"{p}{1 if stack == 'encoder' else 2}.DenseReluDense."
            plan[mlp + "wi"], plan[mlp + "wo"] = ColwiseParallel(), RowwiseParallel()
    return plan


def phi3_plan(fused: bool) -> Callable[[Any], dict[str, Any]]:
    """Phi-3's fused qkv_proj / gate_up_proj split by columns: as a whole with local outputs (what
    a torch user writes first, refused), or part by part (`FusedColwiseParallel`)."""
    def plan(model: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in range(len(model.model.layers)):
            p = f"model.layers.{i}."
            for name, parts in (("self_attn.qkv_proj", 3), ("mlp.gate_up_proj", 2)):
                out[p + name] = FusedColwiseParallel(parts=parts, use_local_output=False) if fused else ColwiseParallel()
            out[p + "self_attn.o_proj"], out[p + "mlp.down_proj"] = RowwiseParallel(), RowwiseParallel()
        return out
    return plan


def qwen3_plan(norms: str) -> Callable[[Any], dict[str, Any]]:
    """Qwen3's torch-style plan with its per-head q/k norms left plain, ReplicateParallel, or
    SequenceParallel over the head dim (torchtitan's choice)."""
    def plan(model: Any) -> dict[str, Any]:
        out = {k: v for k, v in torch_style_plan(model).items() if not k.endswith("_norm")}
        if norms != "plain":
            style = ReplicateParallel() if norms == "replicate" else SequenceParallel(sequence_dim=2, use_local_output=True)
            out.update({f"model.layers.{i}.self_attn.{n}": style for i in range(2) for n in ("q_norm", "k_norm")})
        return out
    return plan


MODELS = {"bert": "bert (masked LM)", "t5": "t5 (encoder-decoder)", "phi3": "phi3 (fused qkv, gate_up)", "llama": "llama (sdpa, GQA)",
          "qwen3": "qwen3 (q/k norms)", "mixtral": "mixtral (MoE)", "mixtral64": "mixtral (MoE, eager experts)"}
OPTIMIZERS: dict[str, dict[str, Any]] = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False},
                                         "default": {}}  # torch's choice: the for-loop on CPU


def _optimizer(params: Any, optimizer: str) -> torch.optim.Optimizer:
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, **OPTIMIZERS[optimizer])


def train(which: str, plan: Callable[[Any], Any], mesh_shape: tuple[int, ...], optimizer: str = "foreach",
          dtype: torch.dtype = torch.float64, shard: bool = False, steps: int = 4) -> float:
    """The worst final parameter difference against one process, this rank."""
    torch.manual_seed(0)
    reference = ALL_MODELS[MODELS[which]]().to(dtype)
    reference.eval()
    model = copy.deepcopy(reference)
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    parallelize_module(model, mesh["tp"] if len(mesh_shape) > 1 else mesh, plan(model))
    rows = slice(None)
    if len(mesh_shape) > 1:
        data_parallel(model, mesh, dp_dim="dp", shard_parameters=shard)
        dp, coordinate = mesh_shape[0], mesh.get_coordinate()
        assert coordinate is not None
        rows = slice(coordinate[0] * 4 // dp, (coordinate[0] + 1) * 4 // dp)
    opts = [_optimizer(m.parameters(), optimizer) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        for m, opt, r in ((reference, opts[0], slice(None)), (model, opts[1], rows)):
            _loss(m, MODELS[which], ids[r]).backward()
            # a plain parameter counts as replicated: its gradient reaches the optimizer plain and whole
            odd = [(n, type(p.grad).__name__, getattr(p.grad, "placements", None)) for n, p in m.named_parameters()
                   if not isinstance(p, sw.DTensor) and p.grad is not None and type(p.grad) is not torch.Tensor]
            assert not odd, odd
            opt.step()
            opt.zero_grad()
    return max((_full(q).detach() - p.detach()).abs().max().item() for p, q in zip(reference.parameters(), model.parameters()))


# regressions: foreach / fused optimizer steps over plain and DTensor parameters together sent the
# plain ones to DTensor dispatch ("a plain tensor reached DTensor dispatch"), and checked fused SGD's
# unset momentum buffers as rank-local; T5's key gradient came back from local code in another
# memory order than the global tensor's, so the linear's backward could not view it

@pytest.mark.parametrize("which, optimizer", [("bert", "foreach"), ("t5", "fused")])
@distributed(world_size=2)
def test_bert_and_t5_under_torch_style_plans_train_like_one_process_on_2_ranks(which: str, optimizer: str) -> None:
    assert train(which, bert_plan if which == "bert" else t5_plan, (2,), optimizer) <= 1e-10


@pytest.mark.parametrize("which, mesh_shape, optimizer", [
    ("bert", (4,), "fused"), ("bert", (2, 2), "for-loop"), ("t5", (4,), "for-loop"), ("t5", (2, 2), "foreach"),
], ids=lambda v: str(v).replace(" ", ""))
@distributed(world_size=4)
def test_bert_and_t5_under_torch_style_plans_train_like_one_process_on_4_ranks(which: str, mesh_shape: tuple[int, ...],
                                                                               optimizer: str) -> None:
    assert train(which, bert_plan if which == "bert" else t5_plan, mesh_shape, optimizer) <= 1e-10


def vocab_split_embedding(plan: Callable[[Any], dict[str, Any]], path: str) -> Callable[[Any], dict[str, Any]]:
    """`plan` with the word embedding (tied to the LM head) split by vocab rows, its output a
    replicated DTensor: what runs after it computes on DTensors, beside plain parameters."""
    def with_embedding(model: Any) -> dict[str, Any]:
        return {**plan(model), path: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(),
                                                     use_local_output=False)}
    return with_embedding


# regression (issue 45): with the embedding split, BERT's plain MLM bias (beside the decoder tied to
# the split embedding) got a DTensor gradient, and torch's default for-loop AdamW failed in its
# in-place update of the plain state ("'Tensor' object has no attribute '_local_tensor'")
@pytest.mark.parametrize("optimizer", ["default", "foreach", "fused", "sgd"])
@pytest.mark.parametrize("which", ["bert", "t5"])
@distributed(world_size=4)
def test_bert_and_t5_with_a_vocab_split_embedding_train_like_one_process_with_every_optimizer(which: str,
                                                                                             optimizer: str) -> None:
    plan = vocab_split_embedding(bert_plan, "bert.embeddings.word_embeddings") if which == "bert" else \
        vocab_split_embedding(t5_plan, "shared")
    assert train(which, plan, (4,), optimizer) <= 1e-10


@pytest.mark.parametrize("optimizer", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("kind", ["foreach", "fused", "for-loop"])
@distributed(world_size=2)
def test_optimizers_step_plain_and_dtensor_parameters_together(optimizer: str, kind: str) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)).double()
    model = copy.deepcopy(reference)
    parallelize_module(model, sw.init_device_mesh("cpu", (2,)), {"1": ColwiseParallel(), "3": RowwiseParallel()})
    extra = {"momentum": 0.9} if optimizer == "SGD" else {}
    opts = [getattr(torch.optim, optimizer)(m.parameters(), lr=1e-2, **extra, **OPTIMIZERS[kind]) for m in (reference, model)]
    for step in range(3):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((reference, model), opts):
            m(x).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=kind == "foreach")  # a DTensor norm scales plain grads
            opt.step()
            opt.zero_grad()
    assert any(not isinstance(p, sw.DTensor) for p in model.parameters())
    for p, q in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(_full(q).detach(), p.detach(), atol=1e-12, rtol=0)


def test_a_plain_column_split_of_a_fused_projection_is_refused_when_the_plan_is_applied() -> None:
    # regression: Phi-3's qkv_proj under ColwiseParallel() failed deep in the forward, at o_proj
    # ("shape '[128, 16]' is invalid for input of size 6144"), after the model had been sharded
    model = ALL_MODELS[MODELS["phi3"]]()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as caught:
        parallelize_module(model, sw.AbstractMesh((2,), ("tp",)), phi3_plan(fused=False)(model))
    message = str(caught.value)
    for i in range(2):
        assert f"model.layers.{i}.self_attn.qkv_proj: qkv_proj fuses 3 projections side by side (q|k|v)" in message
        assert f"model.layers.{i}.mlp.gate_up_proj: gate_up_proj fuses 2 projections" in message
    assert "FusedColwiseParallel(parts=3, use_local_output=False)" in message
    assert "ColwiseParallel(output_layouts=Replicate())" in message
    assert dict(model.named_parameters()) == before  # nothing was sharded


@pytest.mark.parametrize("fix", ["fused parts", "gathered output"])
@distributed(world_size=2)
def test_phi3_trains_like_one_process_under_the_plans_the_refusal_names(fix: str) -> None:
    if fix == "fused parts":
        plan = phi3_plan(fused=True)
    else:
        def plan(model: Any) -> dict[str, Any]:
            out = {}
            for i in range(2):
                p = f"model.layers.{i}."
                out[p + "self_attn.qkv_proj"] = out[p + "mlp.gate_up_proj"] = ColwiseParallel(output_layouts=Replicate())
                out[p + "self_attn.o_proj"] = out[p + "mlp.down_proj"] = RowwiseParallel(input_layouts=Replicate())
            return out
    assert train("phi3", plan, (2,)) <= 1e-10


@distributed(world_size=2)
def test_qwen3_norms_left_plain_inside_split_attention_raise_at_the_first_backward() -> None:
    # regression: silently wrong, as under torch: each rank stepped q_norm / k_norm with the gradient
    # of its own heads only, and the loss drifted (6e-4 after 4 steps)
    with pytest.raises(ValueError) as caught:
        train("qwen3", qwen3_plan("plain"), (2,), steps=1)
    message = str(caught.value)
    for i in range(2):
        for n in ("q_norm", "k_norm"):
            assert f"model.layers.{i}.self_attn.{n}.weight" in message
    assert "{'model.layers.*.self_attn.k_norm': ReplicateParallel(), 'model.layers.*.self_attn.q_norm': " \
           "ReplicateParallel()}" in message
    assert "after the first backward" in message


@pytest.mark.parametrize("norms", ["replicate", "sequence"])
@distributed(world_size=2)
def test_qwen3_norms_replicated_with_summed_gradients_train_like_one_process(norms: str) -> None:
    assert train("qwen3", qwen3_plan(norms), (2,)) <= 1e-10


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "zero3"])
@distributed(world_size=4)
def test_qwen3_norms_replicated_with_summed_gradients_train_like_one_process_under_dp_x_tp(shard: bool) -> None:
    assert train("qwen3", qwen3_plan("replicate"), (2, 2), shard=shard) <= 1e-10


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "zero3"])
@distributed(world_size=4)
def test_mixtral_under_dp_x_tp_trains_like_one_process(shard: bool) -> None:
    # regression: the experts' forward swapped in local pieces where data parallel's compute view
    # shadowed them, so the experts computed on DTensors and the routed tokens (legitimately
    # different on each rank) were refused as rank-local plain tensors
    assert train("mixtral64", torch_style_plan, (2, 2), shard=shard) <= 1e-10  # transformers' eager experts
    # the default grouped experts (one _grouped_mm: no float64 CPU kernel, even in one process)
    assert train("mixtral", torch_style_plan, (2, 2), dtype=torch.float32, shard=shard) <= 1e-5


# -- the model's own plan ---------------------------------------------------------------------------


def test_hf_planner_reads_the_models_own_plan_into_shardwise_styles() -> None:
    model = ALL_MODELS[MODELS["qwen3"]]()
    plan = HFPlanner().build_plan(model).plan
    assert plan["model.layers.*.self_attn.q_proj"] == ColwiseParallel()
    assert plan["model.layers.*.self_attn.o_proj"] == RowwiseParallel()
    assert plan["model.layers.*.self_attn.q_norm"] == ReplicateParallel()
    assert plan["model.embed_tokens"] == RowwiseParallel()  # vocab split, ids replicated
    assert plan["lm_head"] == ColwiseParallel(output_layouts=Replicate())
    mixtral = HFPlanner().build_plan(ALL_MODELS[MODELS["mixtral"]]()).plan
    assert mixtral["model.layers.*.mlp.experts.gate_up_proj"] == (_StridedShard(1, split_factor=2),)  # packed gate|up
    assert mixtral["model.layers.*.mlp.experts.down_proj"] == (Shard(-1),)
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.up_proj': transformers' style 'zigzag' has no shardwise"):
        HFPlanner({"model.layers.*.mlp.up_proj": "zigzag"}).build_plan(model)
    with pytest.raises(ValueError, match="Linear carries no tensor-parallel plan"):
        HFPlanner().build_plan(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("which", ["llama", "qwen3", "phi3"])
@distributed(world_size=2)
def test_hf_planner_trains_like_one_process_and_save_pretrained_loads_in_one_process(which: str, tmp_path: Any) -> None:
    import torch.distributed as dist
    import transformers

    assert train(which, lambda m: HFPlanner(), (2,)) <= 1e-10
    torch.manual_seed(0)
    model = ALL_MODELS[MODELS[which]]().double()
    reference = copy.deepcopy(model)
    parallelize_module(model, sw.init_device_mesh("cpu", (2,)), HFPlanner())
    assert isinstance(model.lm_head.weight, sw.DTensor)
    path = str(tmp_path) if dist.get_rank() == 0 else None
    path = [path]
    dist.broadcast_object_list(path, src=0)
    model.save_pretrained(path[0])  # transformers' own call, unchanged: every rank calls it
    if dist.get_rank() == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path[0])
        want = reference.state_dict()
        got = loaded.state_dict()
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == torch.float64 and torch.equal(got[k], want[k]), k


@distributed(world_size=2)
def test_hf_planner_splits_every_expert_of_mixtral_like_one_process_in_float64() -> None:
    # moe_tp_experts: each rank holds a slice of every expert, so its term of the routing weights'
    # gradient is a partial dot product, kept in float64 until summed (rounded to the router's float32
    # on each rank first, it ended 7.2e-9 off)
    assert train("mixtral64", lambda m: HFPlanner(), (2,)) <= 1e-10


@pytest.mark.parametrize("which, dtype", [("llama", torch.float64), ("mixtral64", torch.float64),
                                          ("mixtral", torch.float32)])
@distributed(world_size=4)
def test_hf_planner_under_dp_x_tp_trains_like_one_process(which: str, dtype: torch.dtype) -> None:
    assert train(which, lambda m: HFPlanner(), (2, 2), dtype=dtype) <= (1e-10 if dtype == torch.float64 else 1e-5)


@distributed(world_size=2)
def test_save_pretrained_of_a_megatron_planned_model_with_tied_embeddings_loads_in_one_process(tmp_path: Any) -> None:
    # regression: transformers' save_pretrained read the DTensors' storage ("Attempted to access the data
    # pointer on an invalid python storage"); the tied LM head must be written once, as the embedding
    import torch.distributed as dist
    import transformers

    from shardwise.parallel import MegatronPlanner, shard_module

    torch.manual_seed(0)
    model = ALL_MODELS["gpt2 (fused qkv, Conv1D)"]().double()
    reference = copy.deepcopy(model)
    shard_module(model, MegatronPlanner(), sw.init_device_mesh("cpu", (2,)))
    assert model.lm_head.weight is model.transformer.wte.weight
    path = [str(tmp_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    model.save_pretrained(path[0])
    if dist.get_rank() == 0:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(path[0])
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        for k, v in reference.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k
