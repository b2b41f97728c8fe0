"""Context parallelism: attention over a sequence split between ranks, against one process.

`scaled_dot_product_attention` on q, k, v split along the sequence by `context_parallel`
(every rotation, load balance on and off, causal and full, grouped-query heads, even and
uneven lengths) gives the output and the q/k/v gradients of SDPA on the whole sequence in
one process, to 1e-12 in float64. An unchanged HF Llama (sdpa, GQA, causal) at cp=4 gives
the logits, the loss and every parameter gradient of one process for sequence lengths 64,
60 (uneven pieces) and 8 x cp, and restores its buffers on exit. Bad input (a 2-D mesh,
buffers of different lengths, an explicit mask, heads Ulysses cannot split) is a
ValueError naming the values, raised before any collective.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.experimental import context_parallel, context_parallel_unshard, set_load_balance, set_rotate_method
from shardwise.parallel import parallelize_module
from shardwise.testing import run_distributed

ROTATIONS = ["allgather", "ring", "alltoall", "ulysses"]


def _cp_mesh() -> Any:
    return sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))


DOCUMENTS = (10, 15, 12)  # three documents packed in one 37-token sample


def _masks(seq: int) -> dict[str, Any]:
    """For each kind: (the one-process SDPA's attn_mask and is_causal, the whole mask to split by rows)."""
    g = torch.Generator().manual_seed(7)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).unsqueeze(0) if seq == sum(DOCUMENTS) else None
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    chosen = (torch.rand(seq, seq, generator=g) < 0.6) | torch.eye(seq, dtype=torch.bool)  # no empty row
    additive = torch.randn(seq, seq, generator=g, dtype=torch.float64).masked_fill(~chosen, float("-inf"))
    kinds: dict[str, Any] = {"causal": (None, True, None), "full": (None, False, None),
                             "bool-mask": (chosen, False, chosen), "additive-mask": (additive, False, additive)}
    if positions is not None:
        docs = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS))
        same = docs.unsqueeze(0) == docs.unsqueeze(1)
        kinds["documents"] = (same & causal, True, None)
    return {"positions": positions, **kinds}


def _attention(seq: int, rotate: str, balanced: bool, kind: str, kv_heads: int) -> None:
    set_rotate_method(rotate)
    set_load_balance(balanced)
    g = torch.Generator().manual_seed(seq)
    q, out_grad = (torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=g) for _ in range(2))
    masks = _masks(seq)
    reference_mask, causal, rows = masks[kind]
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, attn_mask=reference_mask, is_causal=causal and reference_mask is None,
                                          enable_gqa=kv_heads != 4)
    want.backward(out_grad)
    mesh = _cp_mesh()
    buffers = [q.clone(), k.clone(), v.clone(), out_grad.clone()] + ([rows.clone()] if rows is not None else [])
    positions = masks["positions"] if kind == "documents" else None
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2, 0][:len(buffers)],
                          position_ids=positions):
        local = [b.clone().requires_grad_() for b in buffers[:3]]
        got = F.scaled_dot_product_attention(*local, attn_mask=buffers[4] if rows is not None else None,
                                             is_causal=causal, enable_gqa=kv_heads != 4)
        got.backward(buffers[3])
        gathered = context_parallel_unshard(mesh, [got.detach()] + [t.grad for t in local], [2, 2, 2, 2])
    assert buffers[0].shape == q.shape and torch.equal(buffers[0], q)  # restored on exit
    for name, value, reference in zip(("out", "q.grad", "k.grad", "v.grad"), gathered,
                                      [want] + [t.grad for t in whole]):
        torch.testing.assert_close(value, reference, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["causal", "full", "documents", "bool-mask", "additive-mask"])
@pytest.mark.parametrize("balanced", [True, False], ids=["head-tail", "contiguous"])
@pytest.mark.parametrize("rotate", ROTATIONS)
def test_attention_on_a_split_sequence_equals_one_process(rotate: str, balanced: bool, kind: str) -> None:
    run_distributed(_attention, 4, 37, rotate, balanced, kind, 2, timeout=120)  # 37: uneven pieces, GQA


@pytest.mark.parametrize("rotate", ROTATIONS)
def test_attention_with_as_many_kv_heads_as_query_heads_and_an_even_sequence(rotate: str) -> None:
    run_distributed(_attention, 4, 32, rotate, True, "causal", 4, timeout=120)


LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _llama(seq: int, rotate: str, packed: bool = False) -> None:
    transformers = pytest.importorskip("transformers")
    set_rotate_method(rotate)
    set_load_balance(True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).expand(2, seq).clone()
    if packed:  # documents of 20, 25 and 15 tokens in each sample: the model masks each document apart
        positions = torch.cat([torch.arange(20), torch.arange(25), torch.arange(15)]).expand(2, seq).clone()
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # next-token labels, shifted once
    # without a cache the model reads documents from the position ids (and builds its own mask)
    extra = {"use_cache": False} if packed else {}
    whole = reference(input_ids=ids, position_ids=positions, **extra)
    want = F.cross_entropy(whole.logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    want.backward()
    counted = int((shift != -100).sum())
    saved = [t.clone() for t in (ids, positions, shift)]

    mesh = _cp_mesh()
    with context_parallel(mesh, buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1],
                          position_ids=positions if packed else None):
        out = model(input_ids=ids, position_ids=positions, **extra)
        # this rank's tokens' share of the mean over all tokens
        loss = F.cross_entropy(out.logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum") / counted
        loss.backward()
        hf_loss = model(input_ids=ids, position_ids=positions, labels=shift, shift_labels=shift, **extra).loss
        mine = int((shift != -100).sum())
        logits = context_parallel_unshard(mesh, [out.logits.detach()], [1])[0]
    for got, before in zip((ids, positions, shift), saved):
        assert torch.equal(got, before)  # the buffers are whole again
    torch.testing.assert_close(logits, whole.logits, rtol=0, atol=1e-10)
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() - want.item()) <= 1e-12
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # the cp ranks' gradients of their own tokens, summed
        torch.testing.assert_close(grad, r.grad, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")
    # the model's own loss upcasts the logits to float32: it equals the mean over this rank's
    # tokens of one process's float32 loss, computed by hand, to float32 rounding
    mean = hf_loss.detach() * mine / counted
    dist.all_reduce(mean)
    assert abs(mean.item() - want.item()) <= 1e-6


@pytest.mark.parametrize("seq", [64, 60, 32], ids=["64", "60-uneven", "8xcp"])
@pytest.mark.parametrize("rotate", ROTATIONS)
def test_an_unchanged_hf_llama_at_cp4_equals_one_process(rotate: str, seq: int) -> None:
    run_distributed(_llama, 4, seq, rotate, timeout=300)


@pytest.mark.parametrize("rotate", ROTATIONS)
def test_an_hf_llama_with_documents_packed_in_a_sample_keeps_them_apart_at_cp4(rotate: str) -> None:
    run_distributed(_llama, 4, 60, rotate, True, timeout=300)


def _bad_input() -> None:
    set_rotate_method("allgather")  # (the workers live on between tests: every test sets what it uses)
    set_load_balance(True)
    mesh = _cp_mesh()
    two_d = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"1-D cp mesh.*mesh\['cp'\]"):
        with context_parallel(two_d, buffers=[ids], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match=r"buffers\[0\] 16, buffers\[1\] 12"):
        with context_parallel(mesh, buffers=[ids, torch.zeros(2, 12)], buffer_seq_dims=[1, 1]):
            pass
    with pytest.raises(ValueError, match=r"buffer_seq_dims\[0\]=2 is out of range"):
        with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[2]):
            pass
    assert ids.shape == (2, 16)  # nothing was cut
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"lengths \[16, 17, 18, 19\]"):  # every rank, no collective left hanging
        with context_parallel(mesh, buffers=[torch.zeros(2, 16 + rank)], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match=r"cp rank\(s\) \[0\] was refused|out of range"):  # rank 0's bad dim
        with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[2 if rank == 0 else 1]):
            pass
    assert ids.shape == (2, 16)
    q = torch.zeros(1, 2, 16, 4)
    with pytest.raises(ValueError, match=r"over this rank's tokens only .*context_parallel\(\.\.\., position_ids="):
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"an attn_mask of shape \(16, 16\).*shape \(\.\.\., 4, 16\)"):
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    positions = torch.arange(16).expand(1, 16)
    with pytest.raises(ValueError, match="not what the position ids imply"):  # a padding mask, say
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2], position_ids=positions):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"position ids of shape \(batch, 16\).*torch.float32"):
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2], position_ids=positions.float()):
            pass
    set_rotate_method("ulysses")
    q6 = torch.zeros(1, 6, 16, 4)
    with pytest.raises(ValueError, match="query has 6 heads: use a cp size dividing 6"):
        with context_parallel(mesh, buffers=[q6], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(q6, q6, q6, is_causal=True)
    set_rotate_method("allgather")
    with pytest.raises(ValueError, match=r"set_rotate_method\('zigzag'\)"):
        set_rotate_method("zigzag")


def test_bad_input_is_a_value_error_naming_the_values() -> None:
    run_distributed(_bad_input, 4, timeout=120)


def _llama_composed(kind: str) -> None:
    """cp x tp (a torch-style TP plan over tp, CP over cp) or dp x cp (`fully_shard` over all
    4 ranks, each dp half of the batch split over cp) on (2, 2), against one process."""
    transformers = pytest.importorskip("transformers")
    from shardwise.fsdp import fully_shard

    from .test_hf_models import torch_style_plan

    set_rotate_method("allgather")
    set_load_balance(True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).double()
    reference = copy.deepcopy(model)
    seq = 30  # 4 chunks of 7 or 8 per cp=2 sequence: uneven
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    whole = reference(input_ids=ids, position_ids=torch.arange(seq).expand(2, seq))
    want = F.cross_entropy(whole.logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    want.backward()
    counted = int((shift != -100).sum())

    names = ("cp", "tp") if kind == "cp-x-tp" else ("dp", "cp")
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    if kind == "cp-x-tp":
        parallelize_module(model, mesh["tp"], torch_style_plan(model))
        scale = 1.0
    else:
        world = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("dp_cp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=world)
        fully_shard(model, mesh=world)
        row = mesh.get_local_rank("dp")
        ids, shift = ids[row:row + 1].clone(), shift[row:row + 1].clone()  # this dp rank's sample
        scale = 4.0  # fully_shard averages the 4 ranks' gradients; each rank's loss is its tokens' share of the sum
    positions = torch.arange(seq).expand(ids.size(0), seq).clone()
    with context_parallel(mesh["cp"], buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1]):
        out = model(input_ids=ids, position_ids=positions)
        loss = F.cross_entropy(out.logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum")
        (loss * scale / counted).backward()
    total = loss.detach() / counted
    dist.all_reduce(total)
    if kind == "cp-x-tp":
        total /= 2  # each tp rank holds its cp piece's loss
    assert abs(total.item() - want.item()) <= 1e-12, (total.item(), want.item())
    cp_group = mesh.get_group("cp")
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad
        if kind == "cp-x-tp":  # the cp ranks' gradients of their own tokens, summed by hand here
            local = grad.to_local() if isinstance(grad, sw.DTensor) else grad
            dist.all_reduce(local, group=cp_group)
        full = grad.full_tensor() if isinstance(grad, sw.DTensor) else grad
        torch.testing.assert_close(full, r.grad, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["cp-x-tp", "dp-x-cp-fully_shard"])
def test_context_parallel_composes_with_tp_and_fully_shard_on_a_2x2_mesh(kind: str) -> None:
    run_distributed(_llama_composed, 4, kind, timeout=300)


def _bytes(rotate: str) -> None:
    from shardwise.debug import comm_log

    set_rotate_method(rotate)
    set_load_balance(True)
    b, heads, kv_heads, seq, d, cp = 2, 8, 4, 64, 16, 4
    q = torch.randn(b, heads, seq, d)
    k, v = torch.randn(b, kv_heads, seq, d), torch.randn(b, kv_heads, seq, d)
    with context_parallel(_cp_mesh(), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        with comm_log() as log:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = [(r.op, r.bytes_received) for r in log]
    whole = {name: t.numel() * t.element_size() for name, t in (("q", q), ("k", k), ("v", v))}  # restored on exit
    if rotate == "allgather":  # K and V: (cp-1)/cp of each
        assert got == [("all_gather", whole["k"] * (cp - 1) // cp), ("all_gather", whole["v"] * (cp - 1) // cp)], got
    elif rotate in ("ring", "alltoall"):  # cp-1 hops of one rank's K|V block
        hop = (whole["k"] + whole["v"]) // cp
        want = [("recv", hop), ("send", 0)] if rotate == "ring" else [("all_to_all", hop)]
        assert got == want * (cp - 1), got
    else:  # q, k, v to heads and the output (q's size) back: (cp-1)/cp of each rank's piece
        assert got == [("all_to_all", whole[n] // cp * (cp - 1) // cp) for n in "qkvq"], got


def _moves(rotate: str) -> None:
    from collections import Counter

    from shardwise.debug import comm_log

    set_rotate_method(rotate)
    set_load_balance(True)
    cp = 4
    q = torch.randn(2, 8, 64, 16)
    k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)
    with context_parallel(_cp_mesh(), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]) as attention:
        for t in (q, k, v):
            t.requires_grad_()
        with comm_log() as forward:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with comm_log() as backward:
            out.sum().backward()
    want = {"allgather": ({"all_gather": 2}, {"reduce_scatter": 2}),
            "ring": ({"recv": cp - 1, "send": cp - 1}, {"recv": cp, "send": cp}),
            "alltoall": ({"all_to_all": cp - 1}, {"all_to_all": cp}),
            "ulysses": ({"all_to_all": 4}, {"all_to_all": 4})}[rotate]
    assert (Counter(r.op for r in forward), Counter(r.op for r in backward)) == want
    said = attention.explain()  # names the moves comm_log saw, with their counts
    forward_text, backward_text = said.split("Moves per attention call: ")[1].split("; backward: ")
    for text, counts in zip((forward_text, backward_text), want):
        for op, n in counts.items():
            name = {"recv": "point-to-point", "send": "point-to-point"}.get(op, op)
            assert name in text and str(n) in text, (rotate, op, n, text)
    assert q.shape == (2, 8, 64, 16) and q.grad is not None  # leaves made to require grad are restored whole


@pytest.mark.parametrize("rotate", ROTATIONS)
def test_explain_names_the_moves_each_rotation_issues(rotate: str) -> None:
    run_distributed(_moves, 4, rotate, timeout=120)


@pytest.mark.parametrize("rotate", ROTATIONS)
def test_kv_bytes_per_rank_in_comm_log_equal_the_bound(rotate: str) -> None:
    run_distributed(_bytes, 4, rotate, timeout=120)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Any) -> None:
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _real_log(rotate: str) -> list[tuple[str, int]]:
    set_rotate_method(rotate)
    set_load_balance(True)
    q, k, v = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    with sw.comm_log() as log:
        _attend(q, k, v, _cp_mesh())
    return [(r.op, r.bytes_received) for r in log]


@pytest.mark.parametrize("rotate", ROTATIONS)
def test_a_dry_run_reports_the_collectives_context_parallel_issues(rotate: str) -> None:
    from shardwise._mesh import as_device_mesh
    from shardwise.debug import dry_run

    real = run_distributed(_real_log, 4, rotate)
    mesh = sw.AbstractMesh((4,), ("cp",))
    set_rotate_method(rotate)
    set_load_balance(True)
    with torch.device("meta"):
        q, k, v = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    report = dry_run(_attend, q, k, v, as_device_mesh(mesh), mesh=mesh, ranks=range(4))
    set_rotate_method("allgather")
    for rank, log in enumerate(real):
        assert [(c.kind, c.bytes) for c in report.rank(rank).collectives] == log, rank


def _checkpointed(reentrant: bool) -> None:
    """transformers' gradient checkpointing inside the block: the layers recompute in backward,
    where autograd runs without the block's torch function mode; the recomputation is
    context-parallel as the first run was (a local one would give wrong gradients)."""
    transformers = pytest.importorskip("transformers")
    set_rotate_method("allgather")
    set_load_balance(True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).double()
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    seq = 60
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).expand(2, seq).clone()
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    whole = reference(input_ids=ids, position_ids=positions)
    F.cross_entropy(whole.logits.flatten(0, 1), shift.flatten(), ignore_index=-100).backward()
    counted = int((shift != -100).sum())
    # (checkpointing turns the model's cache off, so it builds its mask from the position ids: given here)
    with context_parallel(_cp_mesh(), buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1],
                          position_ids=positions):
        out = model(input_ids=ids, position_ids=positions)
        loss = F.cross_entropy(out.logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum") / counted
        loss.backward()
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # torch's own again
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, r.grad, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_inside_the_block_recomputes_context_parallel(reentrant: bool) -> None:
    run_distributed(_checkpointed, 4, reentrant, timeout=300)
