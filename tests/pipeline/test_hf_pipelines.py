"""Hugging Face models, their code and `transformers` defaults untouched, as pipelines.

`hf_sequential(model)` gives the model's own modules as layers that each rebuild the
position ids, masks (sliding windows, padding) and rotary tables their block needs, and
`hf_loss(model)` the model's own loss; `DistributedPipe` cuts them into stages. Each model
trains 5 AdamW steps against the same model in one process: parameters to 1e-10 in
float64 and 1e-5 in float32, losses to 1e-6 in float64 (HF computes the causal-LM loss in
float32) and 1e-5 in float32. GPT-2 and T5 tie their embeddings to the LM head across
stages, so their parameters match only when the stages sum that shared gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.pipeline import DistributedPipe, hf_loss, hf_sequential
from shardwise.testing import distributed

transformers = pytest.importorskip("transformers")  # a test dependency (pyproject's [test] extra)
from ..parallel.test_hf_models import ALL_MODELS, SMALL  # noqa: E402  (the same tiny configs)

MODELS: dict[str, Callable[[], Any]] = {
    "llama (sdpa, GQA)": ALL_MODELS["llama (sdpa, GQA)"],
    "qwen3 (q/k norms)": ALL_MODELS["qwen3 (q/k norms)"],
    "qwen2 (full, then sliding layers)": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    "mistral (sliding window 4)": ALL_MODELS["mistral (sliding window 4)"],
    "gpt2 (tied embeddings)": ALL_MODELS["gpt2 (fused qkv, Conv1D)"],
    "t5 (encoder-decoder, tied)": ALL_MODELS["t5 (encoder-decoder)"],
    # experts run as one _grouped_mm, which has no float64 CPU kernel even in one process
    "mixtral (MoE)": ALL_MODELS["mixtral (MoE)"],
}
TOL = {torch.float64: (1e-6, 1e-10), torch.float32: (1e-5, 1e-5)}
SEQ = 9  # longer than the sliding windows


def _batches(padding: bool) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(5):
        ids = torch.randint(1, 64, (4, SEQ), generator=g)
        mask = None
        if padding:  # left padding in two rows
            mask = torch.ones(4, SEQ, dtype=torch.long)
            mask[0, :3] = 0
            mask[3, :1] = 0
        out.append((ids, mask))
    return out


def _reference_loss(model: Any, which: str, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if which.startswith("t5"):
        return model(input_ids=ids, decoder_input_ids=torch.roll(ids, 1, 1), attention_mask=mask, labels=ids).loss
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _pipe_input(which: str, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> Any:
    if which.startswith("t5"):
        return (ids, torch.roll(ids, 1, 1)) if mask is None else (ids, torch.roll(ids, 1, 1), mask)
    return ids if mask is None else (ids, mask)


def _train(which: str, dtype: torch.dtype, mesh: sw.DeviceMesh, *, schedule: str = "1f1b",
           balance: Optional[list[int]] = None, padding: bool = False) -> tuple[float, float]:
    """(worst loss difference on the last stage's rank, worst difference of this rank's parameters)."""
    torch.manual_seed(0)
    reference = MODELS[which]().to(dtype)
    reference.eval()  # dropout off (GPT-2's and T5's default 0.1): one process and the stages draw differently
    model = copy.deepcopy(reference)
    layers = hf_sequential(model)
    if balance is None:
        half = len(layers) // 2
        balance = [half, len(layers) - half]
    pipe = DistributedPipe(layers, balance, mesh, schedule=schedule, chunks=2, loss_fn=hf_loss(model))
    dp = mesh.size("dp") if "dp" in (mesh.mesh_dim_names or ()) else 1
    dp_rank = mesh.get_local_rank("dp") if dp > 1 else 0
    opts = [torch.optim.AdamW(reference.parameters(), lr=1e-3), torch.optim.AdamW(pipe.parameters(), lr=1e-3)]
    worst_loss = 0.0
    for ids, mask in _batches(padding):
        want = _reference_loss(reference, which, ids, mask)
        rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)  # this replica's samples
        got = pipe.step(_pipe_input(which, ids[rows], None if mask is None else mask[rows]), ids[rows])
        want.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if got is not None and dp == 1:
            worst_loss = max(worst_loss, abs(got.item() - want.item()))
    mine = {id(p) for p in pipe.parameters()}
    diffs = [(q.detach() - p.detach()).abs().max().item()
             for p, q in zip(reference.parameters(), model.parameters()) if id(q) in mine]
    assert diffs, "this rank trains none of the model's parameters"
    pipe.close()
    return worst_loss, max(diffs)


@pytest.mark.parametrize("which", [w for w in MODELS if not w.startswith("mixtral")])
@distributed(world_size=2)
def test_an_unchanged_hf_model_trains_as_a_pipeline_like_one_process(which: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    for dtype in (torch.float64, torch.float32):
        loss, param = _train(which, dtype, mesh)
        loss_tol, param_tol = TOL[dtype]
        assert loss <= loss_tol and param <= param_tol, (which, dtype, loss, param)


@distributed(world_size=2)
def test_mixtral_trains_as_a_pipeline_in_float32() -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    loss, param = _train("mixtral (MoE)", torch.float32, mesh)
    assert loss <= 1e-5 and param <= 1e-5, (loss, param)


@pytest.mark.parametrize("which", ["mistral (sliding window 4)", "t5 (encoder-decoder, tied)"])
@distributed(world_size=2)
def test_padding_masks_travel_with_the_hidden_state(which: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    loss, param = _train(which, torch.float64, mesh, padding=True)
    assert loss <= 1e-6 and param <= 1e-10, (which, loss, param)


@distributed(world_size=2)
def test_interleaved_stages_sum_gpt2s_tied_embeddings() -> None:
    # 4 stages on 2 ranks: embeddings on stage 0 (rank 0), head on stage 3 (rank 1)
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    loss, param = _train("gpt2 (tied embeddings)", torch.float64, mesh, schedule="interleaved", balance=[1, 1, 1, 1])
    assert loss <= 1e-6 and param <= 1e-10, (loss, param)


@pytest.mark.parametrize("which", ["llama (sdpa, GQA)", "gpt2 (tied embeddings)"])
@distributed(world_size=2)
def test_an_unchanged_hf_model_trains_under_the_zero_bubble_schedules(which: str) -> None:
    # backwards split into I and W: ZB-H1 on 2 stages, and ZBV's V (GPT-2's tied embedding and head
    # both on rank 0: stages 0 and 3)
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    for schedule, balance in (("zero_bubble", None), ("zbv", [1, 1, 1, 1])):
        loss, param = _train(which, torch.float64, mesh, schedule=schedule, balance=balance)
        assert loss <= 1e-6 and param <= 1e-10, (which, schedule, loss, param)


@distributed(world_size=4)
def test_data_parallel_pipelines_of_an_hf_model_train_like_one_process() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    # Qwen3's float32 q/k norms are per token: split over replicas and micro-batches, still 1e-15
    for which in ("llama (sdpa, GQA)", "gpt2 (tied embeddings)", "qwen3 (q/k norms)"):
        _, param = _train(which, torch.float64, mesh)
        assert param <= 1e-10, (which, param)


def test_layers_give_the_models_logits_in_one_process() -> None:
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (3, SEQ))
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, :4] = 0
    for which, build in MODELS.items():
        model = build().eval()
        layers = hf_sequential(model)
        for padding in (None, mask):
            if which.startswith("t5"):
                want = model(input_ids=ids, decoder_input_ids=torch.roll(ids, 1, 1), attention_mask=padding,
                             use_cache=False).logits
            else:
                want = model(input_ids=ids, attention_mask=padding).logits
            assert torch.equal(layers(_pipe_input(which, ids, padding)), want), which


def test_other_architectures_are_refused_by_name() -> None:
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    with pytest.raises(TypeError, match=r"got BertForMaskedLM \(model_type 'bert'\).*Write the layers yourself"):
        hf_sequential(bert)
    with pytest.raises(TypeError, match="BertForMaskedLM"):
        hf_loss(bert)
    with pytest.raises(TypeError, match="got Linear"):
        hf_sequential(nn.Linear(2, 2))


@pytest.mark.parametrize("local_outputs", [False, True])
@distributed(world_size=4)
def test_an_unchanged_hf_llama_trains_as_a_pipeline_of_tensor_parallel_stages(local_outputs: bool) -> None:
    # (pp, tp) = (2, 2): each stage's attention and MLP projections cut Megatron-style over tp,
    # the hidden state crossing stages as a replicated DTensor piece, or, under torch's default
    # styles (local outputs), as a plain tensor; gradients as one process. Regression: with
    # local outputs the stage's rotary buffer was made a replicated DTensor and met the local
    # q and k (a ValueError: users had to pass use_local_output=False)
    _llama_over_tensor_parallel_stages(sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")), local_outputs)


@distributed(world_size=3)
def test_an_unchanged_hf_llama_trains_over_stages_of_different_tp_widths() -> None:
    # stage 0 cut over 2 ranks, stage 1 over 1: the hidden state crosses by the cross-mesh planner
    _llama_over_tensor_parallel_stages([sw.DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",)),
                                        sw.DeviceMesh("cpu", [2], mesh_dim_names=("tp",))])


def _llama_over_tensor_parallel_stages(mesh: Any, local_outputs: bool = False) -> None:
    from shardwise import DTensor
    from shardwise.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    reference = MODELS["llama (sdpa, GQA)"]().double()
    reference.eval()
    model = copy.deepcopy(reference)
    layers = hf_sequential(model)
    if local_outputs:  # torch's defaults: plain local outputs, the rest of the stage plain
        col, row = ColwiseParallel(), RowwiseParallel()
    else:
        col, row = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    plan = {"layer*.layer.self_attn.[qkv]_proj": col, "layer*.layer.self_attn.o_proj": row,
            "layer*.layer.mlp.[gu]*_proj": col, "layer*.layer.mlp.down_proj": row}
    half = len(layers) // 2
    pipe = DistributedPipe(layers, [half, len(layers) - half], mesh, tp_plan=plan, schedule="1f1b", chunks=2,
                           loss_fn=hf_loss(model))
    ids = torch.randint(1, 64, (4, SEQ), generator=torch.Generator().manual_seed(3))
    got = pipe.step(ids, ids)
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    if got is not None:
        assert abs(got.item() - want.item()) <= 1e-10
    want_grads = dict(reference.named_parameters())
    mine = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    one_wide = all(isinstance(p, DTensor) and p.device_mesh.size() == 1 for _, p in mine)  # a 1-rank tp stage
    assert mine and (one_wide or any(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for _, p in mine))
    for name, p in mine:
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, want_grads[name].grad, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")
    pipe.close()


@pytest.mark.parametrize("rotate", ["allgather", "ring"])
@distributed(world_size=4)
def test_an_unchanged_hf_model_trains_as_a_context_parallel_pipeline(rotate: str) -> None:
    """(pp, cp) = (2, 2): every cp rank passes the whole sequences; each runs both stages' layers
    on its piece (9 tokens: pieces of 4 and 5) with attention over the whole sequence (sliding
    windows by global position), and the loss and the parameters after 5 AdamW steps are one
    process's."""
    from shardwise.experimental import set_load_balance, set_rotate_method

    set_rotate_method(rotate)
    set_load_balance(True)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    for which in ("llama (sdpa, GQA)", "gpt2 (tied embeddings)", "mistral (sliding window 4)",
                  "qwen2 (full, then sliding layers)"):
        loss, param = _train(which, torch.float64, mesh)
        assert loss <= 1e-6 and param <= 1e-10, (which, loss, param)
