"""Hugging Face models, their code and `transformers` defaults untouched, under torch-style plans.

A plan a torch user ports (colwise q/k/v/gate/up, rowwise o/down, local outputs, everything
else left alone) gives the same model behaviour as under `torch.distributed.tensor.parallel`:
only the listed linears hold DTensors; between them the model runs on plain local tensors
(its position ids, masks, rotary tables and norms included), so it needs no
`implicit_replication()`. Each model trains 5 AdamW steps against the same model in one
process: parameters to 1e-10 in float64 and 1e-5 in float32. The losses are compared to
1e-6 in float64 (HF computes the causal-LM loss in float32) and 1e-5 in float32.

transformers computes in float32 inside a float64 model: RMSNorm's variance (Qwen3's per-head
q/k norms too), the router's softmax (Mixtral), the causal-LM loss. The first two are per token,
so a batch split over data-parallel ranks or micro-batches rounds them exactly as one process
does, and parameters still match to ~1e-15; the loss is a float32 mean whose summation order
follows the split, so its value differs by float32 rounding, up to one ulp (4.8e-7 at ~4.2):
hence 1e-6 for float64 losses. One process run on the two halves of each batch by hand
disagrees with itself by those same amounts
(`test_one_process_disagrees_with_itself_only_in_the_float32_loss_when_the_batch_is_split`).
"""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.parallel import (ColwiseParallel, ExpertParallel, FusedColwiseParallel, MegatronPlanner, RowwiseParallel,
                                SequenceParallel, data_parallel, global_mean, parallelize_module, shard_module)
from shardwise.testing import distributed

transformers = pytest.importorskip("transformers")  # a test dependency (pyproject's [test] extra)

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
MODELS: dict[str, Callable[[], Any]] = {
    "llama (sdpa, GQA)": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen3 (q/k norms)": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=8)),
    "mistral (sliding window 4)": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**SMALL, sliding_window=4)),
}
# a fused q/k/v projection is split by columns, so a torch-style plan (local outputs) would
# split each rank's piece as if it were the whole: GPT-2 runs under the planner only
ALL_MODELS = {
    **MODELS,
    "gpt2 (fused qkv, Conv1D)": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)),
    # q|k|v and gate|up each one fused Linear, cut into parts by slicing / chunk (pad id 0: the
    # default 32000 is outside this vocab, in one process too)
    "phi3 (fused qkv, gate_up)": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**SMALL, "num_key_value_heads": 4}, pad_token_id=0)),
    "bert (masked LM)": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32)),
    "t5 (encoder-decoder)": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
    "vit (image classification)": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_labels=5)),
    # experts run as one _grouped_mm, which has no float64 CPU kernel even in one process
    "mixtral (MoE)": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2)),
    # the same with transformers' "eager" experts (the model's own loop of linears), which runs in float64
    "mixtral (MoE, eager experts)": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager")),
}


def _loss(model: Any, which: str, ids: torch.Tensor) -> Any:
    if which.startswith("vit"):  # 3x8x8 images and labels made from each row of ids
        dtype = next(model.parameters()).dtype
        pixels = torch.sin(ids.to(dtype).repeat(1, 24) * torch.arange(1, 193, dtype=dtype)).view(-1, 3, 8, 8)
        return model(pixel_values=pixels, labels=ids[:, 0] % 5).loss
    if which.startswith("t5"):
        return model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    return model(input_ids=ids, labels=ids).loss


def torch_style_plan(model: Any) -> dict[str, Any]:
    """Megatron's cuts as a torch user writes them: local outputs, embeddings and norms untouched.

    Qwen3 normalizes q and k per head with weights shared by the heads: each rank sees only
    its heads, so those weights' gradients are sums over ranks, and (as in torchtitan's
    plan) they get `SequenceParallel` over the head dim, which replicates them and reduces
    their gradients; left plain, each rank would step them with its own partial sum."""
    plan: dict[str, Any] = {}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            if _has(layer, name):
                plan[p + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            if _has(layer, name):
                plan[p + name] = RowwiseParallel()
        if _has(layer, "mlp.experts"):  # a mixture of experts: whole experts per rank
            plan[p + "mlp.experts"] = ExpertParallel()
        for name in ("q_norm", "k_norm"):
            if hasattr(layer.self_attn, name):  # (batch, seq, heads, head_dim): the heads are split
                plan[p + "self_attn." + name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _tensor_parallel(model: Any, mesh: Any, planner: str) -> None:
    if planner == "torch-style":
        parallelize_module(model, mesh, torch_style_plan(model))
    else:  # every layer on DTensors; what the plan does not name is replicated
        shard_module(model, MegatronPlanner(), mesh)


def _train(which: str, dtype: torch.dtype, mesh_shape: tuple[int, ...], shard: bool = False,
           planner: str = "torch-style") -> tuple[float, float]:
    """(worst loss difference, worst final parameter difference) against one process, this rank."""
    torch.manual_seed(0)
    reference = ALL_MODELS[which]().to(dtype)
    reference.eval()  # dropout off (GPT-2's default 0.1): one process and the mesh draw different numbers
    model = copy.deepcopy(reference)
    if len(mesh_shape) == 1:
        mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
        _tensor_parallel(model, mesh, planner)
        rows, dp = slice(None), 1
    else:
        mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh["tp"], planner)
        data_parallel(model, mesh, dp_dim="dp", shard_parameters=shard)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        dp = mesh_shape[0]
        rows = slice(coordinate[0] * 4 // dp, (coordinate[0] + 1) * 4 // dp)  # this dp rank's samples
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    worst_loss = 0.0
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        want = _loss(reference, which, ids)
        got = _loss(model, which, ids[rows])  # torch-style: plain, the model ran on plain tensors
        for loss, opt in ((want, opts[0]), (got, opts[1])):
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert isinstance(got, sw.DTensor) == (planner == "megatron")
        # each dp rank's loss is the mean over its samples: the global batch's loss is their mean
        mean = global_mean(got, mesh) if dp > 1 else _full(got).detach()
        worst_loss = max(worst_loss, abs(mean.item() - want.item()))
    worst_param = max((_full(q).detach() - p.detach()).abs().max().item()
                      for (name, p), q in zip(reference.named_parameters(), model.parameters())
                      if not (dtype == torch.float32 and name.endswith(NOISE_ONLY)))
    return worst_loss, worst_param


# A key projection's bias adds the same q.b_k to every score of a query, which softmax ignores:
# its gradient is exactly 0, so what reaches it is rounding noise. In float32 that noise (~1e-9)
# is of the order of AdamW's eps, so one process and the mesh step it by different noise.
NOISE_ONLY = ("attention.k_proj.bias",)


TOL = {torch.float64: (1e-6, 1e-10), torch.float32: (1e-5, 1e-5)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("which", list(MODELS))
@distributed(world_size=2)
def test_a_torch_style_plan_trains_an_unchanged_hf_model_like_one_process(which: str, dtype: torch.dtype) -> None:
    loss, param = _train(which, dtype, (2,))
    loss_tol, param_tol = TOL[dtype]
    assert loss <= loss_tol and param <= param_tol, (which, loss, param)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("which", [m for m in ALL_MODELS if not m.startswith("mixtral")])
@distributed(world_size=2)
def test_megatron_planner_trains_an_unchanged_hf_model_like_one_process(which: str, dtype: torch.dtype) -> None:
    # regressions: plain position ids and masks met replicated buffers (no implicit_replication()
    # now); sdpa's output pieces were laid out unlike the global tensor, so the view after
    # `.contiguous()` failed; float64 gradients were rounded to float32 term by term
    loss, param = _train(which, dtype, (2,), planner="megatron")
    loss_tol, param_tol = TOL[dtype]
    if which.startswith("gpt2") and dtype == torch.float32:
        # one element of layer 0's v projection has a gradient near AdamW's eps (1e-8): the
        # float32 rounding of a different summation order moves its step by ~1.4e-5
        param_tol = 3e-5
    if which.startswith("t5") and dtype == torch.float32:
        # one element of the decoder's second key projection has a gradient of 2.5e-8 (AdamW's eps is
        # 1e-8), below float32's rounding of its neighbours' sums: its five steps differ by ~1.5e-5
        # (float64: 1e-14)
        param_tol = 3e-5
    assert loss <= loss_tol and param <= param_tol, (which, loss, param)


@pytest.mark.parametrize("which, planner, shard", [
    ("llama (sdpa, GQA)", "torch-style", False), ("llama (sdpa, GQA)", "torch-style", True),
    ("phi3 (fused qkv, gate_up)", "megatron", True),  # parts split over tp, ZeRO-3 over dp on the other dim
    ("qwen3 (q/k norms)", "torch-style", True),  # float32 q/k norms on each rank's heads and samples
], ids=["llama-replicated", "llama-zero3", "phi3-megatron-zero3", "qwen3-zero3"])
@distributed(world_size=4)
def test_dp_x_tp_trains_an_unchanged_hf_model_like_one_process(which: str, planner: str, shard: bool) -> None:
    loss, param = _train(which, torch.float64, (2, 2), shard=shard, planner=planner)
    assert loss <= 1e-6 and param <= 1e-10, (loss, param)


@pytest.mark.parametrize("which", ["gpt2 (fused qkv, Conv1D)", "phi3 (fused qkv, gate_up)"])
@distributed(world_size=2)
def test_a_fused_projection_is_split_part_by_part_so_cutting_it_into_q_k_v_moves_nothing(which: str) -> None:
    # regression: c_attn / qkv_proj / gate_up_proj were split by columns as a whole, so the
    # model's split of their output into q|k|v (gate|up) needed an all_to_all per layer, each way
    torch.manual_seed(0)
    model = ALL_MODELS[which]().double()
    model.eval()
    plan = MegatronPlanner().build_plan(model)
    fused = sorted(k.rsplit(".", 1)[-1] for k, v in plan.plan.items() if isinstance(v, FusedColwiseParallel))
    assert fused == (["c_attn"] * 2 if which.startswith("gpt2") else ["gate_up_proj"] * 2 + ["qkv_proj"] * 2), fused
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    shard_module(model, plan, mesh)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    # the first step also checks, once per site, the plain tensors that meet DTensors (small
    # all_gathers): counted from the second step, as it passed only after other tests in the process
    _loss(model, which, ids).backward()
    with sw.comm_log() as forward:
        loss = _loss(model, which, ids)
    with sw.comm_log() as backward:
        loss.backward()
    # forward: the embedding's and each row-parallel layer's all_reduce, and the vocab-parallel
    # loss's one all_to_all; nothing where the fused outputs are cut
    assert collections.Counter(r.op for r in forward) == {"all_reduce": 5, "all_to_all": 1}, forward
    ops = collections.Counter(r.op for r in backward)
    assert not ops["all_gather"] and ops["all_to_all"] <= 1, backward


@distributed(world_size=2)
def test_parallelize_module_leaves_what_the_plan_does_not_mention_plain_as_torch_does() -> None:
    # regression: every parameter and buffer the plan did not mention became a replicated
    # DTensor (the rotary inv_freq included), so the plain tensors the model makes collided with them
    torch.manual_seed(0)
    model = MODELS["llama (sdpa, GQA)"]()
    mesh = sw.init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, torch_style_plan(model))
    planned = {f"model.layers.{i}.{n}.weight" for i in range(2) for n in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    for name, p in model.named_parameters():
        assert isinstance(p, sw.DTensor) == (name in planned), name
    for name, b in model.named_buffers():
        assert not isinstance(b, sw.DTensor), name
    # the option that makes them replicated DTensors (shard_module's default) is still there
    other = parallelize_module(MODELS["llama (sdpa, GQA)"](), mesh, torch_style_plan(model), replicate_rest=True)
    assert all(isinstance(p, sw.DTensor) for p in other.parameters())


@distributed(world_size=2)
def test_megatron_planner_trains_an_unchanged_mixtral_like_one_process_in_float32() -> None:
    # regression: the experts stayed replicated on every rank (with a warning); now each rank
    # holds whole experts (ExpertParallel) and nothing large is left replicated
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = MegatronPlanner().build_plan(ALL_MODELS["mixtral (MoE)"]())
    for i in range(2):
        assert isinstance(plan.plan[f"model.layers.{i}.mlp.experts"], ExpertParallel)
        assert f"model.layers.{i}.mlp.experts.gate_up_proj" in plan.coverage.sharded
    for planner in ("megatron", "torch-style"):  # DTensor and plain tokens
        loss, param = _train("mixtral (MoE)", torch.float32, (2,), planner=planner)
        assert loss <= 1e-5 and param <= 1e-5, (planner, loss, param)


@pytest.mark.parametrize("planner", ["megatron", "torch-style"])
@distributed(world_size=2)
def test_mixtral_trains_like_one_process_in_float64(planner: str) -> None:
    # regression: under the Megatron plan the routing weights' gradient left the experts as a
    # pending sum of per-rank terms, and transformers runs the router's backward in float32
    # (softmax, top-k, renormalisation): each rank's term was rounded to float32 before the sum,
    # 9e-10 from one process after 5 steps (7.5e-9 on 4 ranks); now summed as it leaves the
    # experts (exact: each route is taken on one rank)
    loss, param = _train("mixtral (MoE, eager experts)", torch.float64, (2,), planner=planner)
    assert loss <= 1e-6 and param <= 1e-10, (planner, loss, param)


@pytest.mark.parametrize("which", ["qwen3 (q/k norms)", "mixtral (MoE, eager experts)"])
def test_one_process_disagrees_with_itself_only_in_the_float32_loss_when_the_batch_is_split(which: str) -> None:
    # What the mesh cells' tolerances rest on, in one process: the full batch against its two
    # halves with the gradients averaged by hand (as data parallel and micro-batches split it),
    # 5 AdamW steps in float64. transformers' float32 norms and router softmax are per token, so
    # the parameters agree to ~1e-15 (DP x TP (2, 2) ends 1.2e-15 from one process for Qwen3, the
    # same bits as this split); its float32 loss mean is rounded otherwise: 2.4e-7 off here, half
    # an ulp (the mesh, averaging the halves' float32 losses in float32, shows 4.8e-7).
    torch.manual_seed(0)
    whole = ALL_MODELS[which]().double()
    whole.eval()
    halves = copy.deepcopy(whole)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (whole, halves)]
    g = torch.Generator().manual_seed(1)
    worst_loss = 0.0
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        want = _loss(whole, which, ids)
        want.backward()
        got = sum(_loss(halves, which, half).double() / 2 for half in ids.chunk(2))  # averaged exactly
        got.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        worst_loss = max(worst_loss, abs(got.item() - want.item()))
    assert want.dtype == torch.float32  # a float64 model's loss, as transformers computes it
    worst_param = max((p - q).abs().max().item() for p, q in zip(whole.parameters(), halves.parameters()))
    assert 0 < worst_loss <= 1e-6 and worst_param <= 1e-13, (worst_loss, worst_param)


def test_megatron_planner_reports_coverage_and_warns_on_large_replicated_parameters() -> None:
    # regression: BERT got only its word embeddings and nothing said so
    torch.manual_seed(0)
    bert = ALL_MODELS["bert (masked LM)"]()
    plan = MegatronPlanner().build_plan(bert)
    assert plan.coverage is not None
    for i in range(2):
        layer = f"bert.encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
            assert isinstance(plan.plan[layer + name], ColwiseParallel), name
        for name in ("attention.output.dense", "output.dense"):
            assert isinstance(plan.plan[layer + name], RowwiseParallel), name
        assert layer + "attention.self.query.weight" in plan.coverage.sharded
    assert "bert.embeddings.position_embeddings.weight" in plan.coverage.replicated
    table = str(plan.coverage)
    assert "replicated (not in the plan)" in table and "parameters sharded" in table
    assert plan.coverage.sharded_bytes + plan.coverage.replicated_bytes == sum(
        p.numel() * p.element_size() for p in bert.parameters())
    class Unusual(torch.nn.Module):  # a matrix in no layer the planner knows
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(64, 64))
            self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))

    with pytest.warns(UserWarning, match=r"left 1 large parameter\(s\) of Unusual replicated.*table \[64, 64\]"):
        MegatronPlanner().build_plan(Unusual())


def _train_step(model: Any, opt: torch.optim.Optimizer, ids: torch.Tensor) -> Any:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("which", ["llama (sdpa, GQA)", "gpt2 (fused qkv, Conv1D)"])
@distributed(world_size=2)
def test_compile_replays_an_hf_train_step_like_eager(which: str) -> None:
    # regressions: sdpa (dropout_p=0) was refused as random, the first call's one-time plain-tensor
    # check read values, and AdamW's float32 step count put the replay 1e-8 off eager in float64
    torch.manual_seed(0)
    reference = ALL_MODELS[which]().double()
    reference.eval()
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    models = [copy.deepcopy(reference), copy.deepcopy(reference)]  # compiled, eager
    for m in models:
        shard_module(m, MegatronPlanner(), mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (*models, reference)]
    step = sw.compile(_train_step)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(5):
            ids = torch.randint(0, 64, (4, 8), generator=g)
            got = step(models[0], opts[0], ids)
            want = _train_step(models[1], opts[1], ids)
            one = _train_step(reference, opts[2], ids)
            assert abs(got.full_tensor().item() - want.full_tensor().item()) <= 1e-12, call
            assert abs(got.full_tensor().item() - one.item()) <= 1e-6, call  # HF's loss is float32
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert not messages and step.programs() == 1, (messages, step.programs())  # calls 2-4 replayed
    for p, q, r in zip(models[0].parameters(), models[1].parameters(), reference.parameters()):
        assert (p.full_tensor() - q.full_tensor()).abs().max().item() <= 1e-12
        assert (p.full_tensor() - r.detach()).abs().max().item() <= 1e-10
