"""An unchanged Hugging Face Llama (small config, sdpa, GQA) under torchtitan's 2-D recipe:
tensor parallel on mesh["tp"] (a torch-style plan), `fully_shard` per decoder layer and on the
model over mesh["dp"]; every loss and parameter after 5 AdamW steps equal to one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.parallel import global_mean, parallelize_module
from shardwise.testing import distributed

from ..parallel.test_hf_models import MODELS, TOL, torch_style_plan

pytest.importorskip("transformers")


def _two_d(model: Any) -> sw.DeviceMesh:
    """torchtitan's recipe on a (dp, tp) = (2, 2) mesh: a torch-style TP plan, then fully_shard per layer and on the model."""
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], torch_style_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh


@distributed(world_size=4)
def test_hf_llama_tp_then_fully_shard_per_layer_trains_as_one_process() -> None:
    torch.manual_seed(0)
    reference = MODELS["llama (sdpa, GQA)"]().double()
    model = copy.deepcopy(reference)
    mesh = _two_d(model)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.device_mesh == mesh and [str(p) for p in q.placements] == ["S(0)", "S(0)"]
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    rows = slice(coordinate[0] * 2, coordinate[0] * 2 + 2)  # this dp rank's 2 of 4 samples
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        want = reference(input_ids=ids, labels=ids).loss
        got = model(input_ids=ids[rows], labels=ids[rows]).loss
        for loss, opt in ((want, opts[0]), (got, opts[1])):
            loss.backward()
            opt.step()
            opt.zero_grad()
        # transformers computes the loss in float32 (one ulp between the split and whole batch's mean)
        assert abs(global_mean(got, mesh, "dp").item() - want.item()) <= TOL[torch.float64][0]
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")


@distributed(world_size=4)
def test_hf_llama_built_on_meta_materialises_only_shards_and_trains_as_one_process() -> None:
    import transformers

    from .test_meta_init import _peak_allocated

    config = MODELS["llama (sdpa, GQA)"]().config
    config.num_hidden_layers = 8  # deep enough that two layers are a quarter of the model
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = _two_d(model)

    def materialise() -> None:
        model.to_empty(device="cpu")
        torch.manual_seed(3)  # (governs shardwise's draws too)
        model.init_weights()  # transformers' own init (and the rotary buffers)

    peak = _peak_allocated(materialise)
    model.double()
    shards = sum(p._local_tensor.numel() * 4 for p in model.parameters())
    whole = sum(p.numel() * 4 for p in model.parameters())
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert peak <= shards + 2 * layer, (peak, shards, layer, whole)  # never the whole model
    assert peak < whole * 0.6, (peak, shards, layer, whole)
    reference = transformers.LlamaForCausalLM(config).double()
    with torch.no_grad():
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            p.copy_(q.full_tensor())
    assert reference.model.layers[1].mlp.up_proj.weight.std() > 0.01  # drawn, not left empty
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    rows = slice(coordinate[0] * 2, coordinate[0] * 2 + 2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        for loss, opt in ((reference(input_ids=ids, labels=ids).loss, opts[0]),
                          (model(input_ids=ids[rows], labels=ids[rows]).loss, opts[1])):
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")
