"""`ContextParallel()`: an unchanged Hugging Face Llama trained context-parallel by a plan style.

The program is one process's, with one line added (`parallelize_module(model, cp_mesh,
ContextParallel())`): `model(input_ids=ids, labels=ids).loss.backward()` with the whole
sequence on every cp rank. Against one process, in float64: every parameter gradient to
1e-10, on cp=4 (every rotation; lengths 64 and 60, uneven pieces), cp x tp and dp x cp
under `fully_shard` on (2, 2), and dp x cp x tp on (2, 2, 2). The loss is the model's own,
which transformers computes in float32 (it upcasts the logits): the loss every rank
reports equals one process's to float32 rounding of the sum (the bound one process reaches
against itself summing the same shares by hand); the gradient of each token's loss is
computed elementwise, so the gradients meet float64's bound. The caller's tensors are not
changed. Bad input (a padded attention mask, a 2-D mesh) is a ValueError on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.experimental import context_parallel_unshard, set_load_balance, set_rotate_method
from shardwise.parallel import ContextParallel, parallelize_module
from shardwise.testing import run_distributed

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _models(seed: int = 0) -> tuple[Any, Any]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).double()
    return model, copy.deepcopy(model)


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))


def _loss_bound(want: torch.Tensor) -> float:
    """float32 rounding of the model's loss (a float32 sum of the cp ranks' float32 shares)."""
    return 8 * torch.finfo(torch.float32).eps * max(1.0, abs(want.item()))


def _check_grads(model: Any, reference: Any, atol: float = 1e-10, times: int = 1) -> None:
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, sw.DTensor) else p.grad
        torch.testing.assert_close(grad, r.grad * times, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def _one_step_at_cp4(model: Any, reference: Any, ids: torch.Tensor) -> None:
    """One process's step on `reference`, the same step on `model` under ContextParallel at cp=4:
    the loss to float32 rounding, every gradient to 1e-10."""
    want = reference(input_ids=ids, labels=ids)
    want.loss.backward()
    parallelize_module(model, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)), ContextParallel())
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) <= _loss_bound(want.loss)
    _check_grads(model, reference)


def _cp4(seq: int, rotate: str) -> None:
    set_rotate_method(rotate)
    set_load_balance(True)
    model, reference = _models()
    ids = _ids(2, seq)
    want = reference(input_ids=ids, labels=ids)
    want.loss.backward()

    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    parallelize_module(model, mesh, ContextParallel())
    before = ids.clone()
    for _ in range(2):  # gradient accumulation: each pass's share summed over cp once, added to the last
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert torch.equal(ids, before)  # the caller's tensors are whole and unchanged
    assert abs(out.loss.item() - want.loss.item()) <= _loss_bound(want.loss), (out.loss.item(), want.loss.item())
    _check_grads(model, reference, times=2)
    logits = context_parallel_unshard(mesh, [out.logits.detach()], [1])[0]
    torch.testing.assert_close(logits, want.logits, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seq", [64, 60], ids=["64", "60-uneven"])
@pytest.mark.parametrize("rotate", ["allgather", "ring", "alltoall", "ulysses"])
def test_an_unchanged_hf_llama_under_the_context_parallel_style_equals_one_process(rotate: str, seq: int) -> None:
    run_distributed(_cp4, 4, seq, rotate, timeout=300)


def _packed() -> None:
    set_rotate_method("ring")
    set_load_balance(True)
    model, reference = _models()
    ids = _ids(1, 60)
    positions = torch.cat([torch.arange(20), torch.arange(25), torch.arange(15)]).unsqueeze(0)
    want = reference(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    want.loss.backward()
    parallelize_module(model, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)), ContextParallel())
    out = model(input_ids=ids, position_ids=positions, labels=ids)
    out.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) <= _loss_bound(want.loss)
    _check_grads(model, reference)


def test_documents_packed_in_a_sample_stay_apart_under_the_style() -> None:
    run_distributed(_packed, 4, timeout=300)


def _composed(kind: str) -> None:
    """cp x tp (torch-style TP plan over tp), dp x cp (`fully_shard` over the 4 ranks), or
    dp x cp x tp (`fully_shard` over dp x cp, TP over tp) on 8 ranks."""
    from shardwise.fsdp import fully_shard

    from .test_hf_models import torch_style_plan

    set_rotate_method("allgather")
    set_load_balance(True)
    model, reference = _models()
    seq = 30  # 4 chunks of 7 or 8 per cp=2 sequence: uneven
    ids = _ids(2, seq)
    want = reference(input_ids=ids, labels=ids)  # both samples hold 29 counted tokens: the mean of theirs
    want.loss.backward()
    shape, names = {"cp-x-tp": ((2, 2), ("cp", "tp")), "dp-x-cp-fully_shard": ((2, 2), ("dp", "cp")),
                    "dp-x-cp-x-tp": ((2, 2, 2), ("dp", "cp", "tp"))}[kind]
    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], torch_style_plan(model))
    parallelize_module(model, mesh["cp"], ContextParallel())
    if "dp" in names:
        dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_cp)
        fully_shard(model, mesh=dp_cp)
        row = mesh.get_local_rank("dp")
        ids = ids[row:row + 1].clone()  # this dp rank's sample
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    loss = out.loss.detach().clone()
    if "dp" in names:
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        loss /= 2
    assert abs(loss.item() - want.loss.item()) <= _loss_bound(want.loss), (loss.item(), want.loss.item())
    _check_grads(model, reference)


@pytest.mark.parametrize("kind", ["cp-x-tp", "dp-x-cp-fully_shard"])
def test_the_context_parallel_style_composes_with_tp_and_fully_shard_on_a_2x2_mesh(kind: str) -> None:
    run_distributed(_composed, 4, kind, timeout=300)


def test_dp_x_cp_x_tp_on_a_3d_mesh_equals_one_process() -> None:
    run_distributed(_composed, 8, "dp-x-cp-x-tp", timeout=400)


def _bad_input() -> None:
    set_rotate_method("allgather")
    set_load_balance(True)
    model, _ = _models()
    two_d = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    with pytest.raises(ValueError, match="1-D mesh"):
        parallelize_module(model, two_d, ContextParallel())  # (parallelize_module itself refuses)
    with pytest.raises(TypeError, match="seq_dim"):
        ContextParallel(seq_dim="1")  # type: ignore[arg-type]
    parallelize_module(model, sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)), ContextParallel())
    ids = _ids(1, 16)
    mask = torch.ones_like(ids)
    if dist.get_rank() == 2:
        mask[0, -3:] = 0  # one rank's padding: every rank stops
    with pytest.raises(ValueError, match="padded positions" if dist.get_rank() == 2 else r"cp rank\(s\) \[2\]"):
        model(input_ids=ids, attention_mask=mask, labels=ids)
    with pytest.raises(ValueError, match="mask of ones"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 16, 16), labels=ids)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)  # the ranks are still in step
    assert out.logits.size(1) == 4
    # labels on some ranks only: those would all_reduce the loss after the call, the others not
    # (regression: it waited for the collective timeout); now every rank stops at the entry
    with pytest.raises(ValueError, match=r"differ in whether labels were passed.*\[1, 0, 1, 0\]"):
        model(input_ids=ids, labels=ids if dist.get_rank() % 2 == 0 else None)
    assert model(input_ids=ids, labels=ids).logits.size(1) == 4  # still in step


def test_bad_input_to_the_style_is_a_value_error_on_every_rank() -> None:
    run_distributed(_bad_input, 4, timeout=120)


def _loss_parallel() -> None:
    """cp x tp with the logits left split over the vocabulary (tp) and the loss computed by
    `loss_parallel` on sequence-split labels: the model's own loss call, unchanged."""
    from shardwise.parallel import ColwiseParallel, loss_parallel

    from .test_hf_models import torch_style_plan

    set_rotate_method("allgather")
    set_load_balance(True)
    model, reference = _models()
    ids = _ids(2, 30)
    want = reference(input_ids=ids, labels=ids)
    want.loss.backward()
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    plan = torch_style_plan(model)
    plan["lm_head"] = ColwiseParallel(output_layouts=sw.Shard(-1), use_local_output=False)
    parallelize_module(model, mesh["tp"], plan)
    parallelize_module(model, mesh["cp"], ContextParallel())
    with loss_parallel():
        out = model(input_ids=ids, labels=ids)
        assert isinstance(out.logits, sw.DTensor) and out.logits.placements == (sw.Shard(2),)
        out.loss.backward()
    assert isinstance(out.loss, sw.DTensor)
    loss = out.loss.full_tensor()
    assert abs(loss.item() - want.loss.item()) <= _loss_bound(want.loss), (loss.item(), want.loss.item())
    # the model upcasts the logits to float32 before its loss: loss_parallel's float32 softmax over
    # vocabulary pieces rounds differently from one process's (TP alone, no CP, differs by 8e-9 here)
    _check_grads(model, reference, atol=5e-8)


def test_loss_parallel_with_sequence_split_labels_under_cp_x_tp() -> None:
    run_distributed(_loss_parallel, 4, timeout=300)


def _checkpointed(reentrant: bool) -> None:
    """transformers' gradient checkpointing: the layers recompute in backward, where autograd runs
    without the caller's torch function modes; the recomputation is context-parallel too."""
    set_rotate_method("ring")
    set_load_balance(True)
    model, reference = _models()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = _ids(2, 60)
    _one_step_at_cp4(model, reference, ids)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_recomputes_context_parallel(reentrant: bool) -> None:
    run_distributed(_checkpointed, 4, reentrant, timeout=300)


def test_a_dry_run_of_the_style_reports_activations_split_by_cp() -> None:
    """A dry run (meta tensors, one process) of the style's train step on an abstract cp mesh:
    each rank's activation peak falls with cp (the fused kernel's chunk pairs: no (queries x
    keys) matrix), and the collectives are the rotation's and the gradient sums'."""
    transformers = pytest.importorskip("transformers")
    from shardwise._mesh import as_device_mesh
    from shardwise.debug import dry_run

    set_rotate_method("allgather")
    set_load_balance(True)
    config = dict(LLAMA, hidden_size=64, intermediate_size=128)

    def step(model: Any, ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    peaks, kinds = {}, {}
    for cp in (1, 4):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        mesh = sw.AbstractMesh((cp,), ("cp",))
        parallelize_module(model, as_device_mesh(mesh), ContextParallel())
        report = dry_run(step, model, torch.zeros(1, 2048, dtype=torch.long), mesh=mesh, ranks=range(cp))
        peaks[cp] = max(report.rank(r).memory.peaks["activations"] for r in range(cp))
        kinds[cp] = {c.kind for c in report.rank(0).collectives}
    assert peaks[4] <= 0.35 * peaks[1], peaks
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= kinds[4], kinds


def _sliding(which: str, rotate: str) -> None:
    """Sliding-window layers (Mistral's window in its config; Qwen2's full then sliding layers,
    the window on each attention module): the window applies by global position."""
    transformers = pytest.importorskip("transformers")
    from .test_hf_models import SMALL

    set_rotate_method(rotate)
    set_load_balance(True)
    torch.manual_seed(0)
    if which == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=4)).double()
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=1)).double()
    reference = copy.deepcopy(model)
    ids = _ids(2, 30)
    _one_step_at_cp4(model, reference, ids)


@pytest.mark.parametrize("which, rotate", [("mistral", "allgather"), ("mistral", "ring"), ("mistral", "ulysses"),
                                           ("qwen2", "alltoall")])
def test_sliding_window_layers_under_the_style_equal_one_process(which: str, rotate: str) -> None:
    run_distributed(_sliding, 4, which, rotate, timeout=300)
