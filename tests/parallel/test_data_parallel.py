"""Data parallel (replicated and ZeRO-3 sharded) trains like one process on the whole batch.

Every rank trains the single-device reference on the whole batch itself (the models are
tiny) and, side by side, a `data_parallel` copy that sees only its dp rank's slice of the
batch. The dp-averaged loss of every step, the gradients of the first step and the final
parameters must match within 1e-5 (AdamW, foreach by default). Also checked: replicated
gradients are averaged with one all_reduce per bucket, not per parameter; sharding cuts
a rank's parameter + gradient + optimizer bytes to about 1/dp; parameters unused on some
ranks neither hang nor get wrong gradients; `no_sync` defers the reduction.

The CNN runs with batch norm in eval mode: in training mode each dp rank normalises its
own slice of the batch (as under DDP), which is a different function of the data than one
process normalising the whole batch, so no exact parity exists to check.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.parallel import data_parallel, memory_report, no_sync
from shardwise.testing import distributed

from ..models import CNN, GPT, GPTConfig, cnn_batch, distribute_params, gpt_batch

STEPS = 4
TOL = 1e-5
CFG = GPTConfig(vocab=61, seq=6)  # 61 vocab rows and 6 positions: uneven pieces on 2 and 4 ranks, an empty one on 4


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dp_mean(value: torch.Tensor, mesh: sw.DeviceMesh) -> torch.Tensor:
    """The average over dp of each dp rank's value."""
    dp_mesh = mesh["dp"] if mesh.ndim > 1 else mesh
    return DTensor.from_local(_full(value).detach().reshape(1), dp_mesh, [Partial("avg")]).full_tensor()[0]


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _expected_buckets(model: nn.Module, cap_mb: float) -> int:
    """Buckets of the naive greedy packing: parameters last-first, a new bucket when the cap would be passed."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    count, fill = 0, None
    for size in reversed(sizes):
        if fill is None or fill + size > cap_mb * 2**20:
            count, fill = count + 1, 0
        fill += size
    return count


def _train(
    make: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    mesh: sw.DeviceMesh,
    *,
    shard: bool,
    tp_plan: Optional[Callable[[str, torch.Tensor], Any]] = None,
    bucket_cap_mb: float = 25.0,
    eval_mode: bool = False,
) -> dict[str, Any]:
    """Train the reference on the whole batch and the dp copy on its slice; compare; return what was seen."""
    torch.manual_seed(0)
    ref = make()
    model = distribute_params(ref, mesh["tp"], tp_plan) if tp_plan is not None else copy.deepcopy(ref)
    data_parallel(model, mesh, shard_parameters=shard, bucket_cap_mb=bucket_cap_mb)
    if eval_mode:
        ref.eval(), model.eval()
    ref_opt, opt = _adamw(ref.parameters()), _adamw(model.parameters())
    dp = mesh.mesh_dim_index("dp") if mesh.ndim > 1 else 0
    n, me = mesh.size(dp), mesh.get_local_rank(dp)
    seen: dict[str, Any] = {"all_reduces": [], "memory": None}
    for step in range(STEPS):
        x, y = batch(step)
        ref_loss = ref(x, y)
        ref_loss.backward()
        with sw.implicit_replication():
            loss = model(x.chunk(n)[me], y.chunk(n)[me])
            with sw.comm_log() as log:
                loss.backward()
        seen["all_reduces"].append(sum(r.op == "all_reduce" for r in log))
        _close(f"step {step} loss", _dp_mean(loss, mesh), ref_loss.detach())
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert isinstance(p, DTensor) and p.grad is not None, f"step {step}: {name} has no gradient"
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, (name, p.grad, p.placements)
            if step == 0:
                _close(f"step 0 grad {name}", p.grad.full_tensor(), q.grad)
        ref_opt.step()
        opt.step()
        if step == STEPS - 1:
            seen["memory"] = memory_report(model, opt)
            seen["ref_memory"] = memory_report(ref, ref_opt)
        ref_opt.zero_grad()
        opt.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        _close(f"final {name}", p.full_tensor(), q.detach())
    seen["model"] = model
    return seen


def _gpt() -> nn.Module:
    return GPT(CFG)


def _gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(step, batch=8, cfg=CFG)


@distributed(world_size=4)
def test_gpt_replicated_reduces_once_per_bucket_like_single_device() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    cap = 0.01  # ~10 KB: several buckets for the tiny GPT's ~24 parameters
    seen = _train(_gpt, _gpt_batch, mesh, shard=False, bucket_cap_mb=cap)
    model = seen["model"]
    buckets = _expected_buckets(model, cap)
    assert 1 < buckets < len(list(model.parameters()))
    assert seen["all_reduces"] == [buckets] * STEPS, (seen["all_reduces"], buckets)
    for p in model.parameters():
        assert p.placements == (Replicate(),)
    mem = seen["memory"]
    assert mem["total"] == mem["unsharded_total"] == seen["ref_memory"]["total"], mem
    one = _train(_gpt, _gpt_batch, mesh, shard=False)  # default 25 MB: the whole model is one bucket
    assert one["all_reduces"] == [1] * STEPS


@distributed(world_size=4)
def test_gpt_sharded_parameters_train_like_single_device_in_a_quarter_of_the_memory() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    seen = _train(_gpt, _gpt_batch, mesh, shard=True)
    model = seen["model"]
    assert model.head.weight is model.tok.weight  # tied parameters stay one
    assert model.pos.weight.placements == (Shard(0),) and model.pos.weight._local_tensor.shape[0] == (2, 2, 2, 0)[mesh.get_local_rank()]
    assert seen["all_reduces"] == [0] * STEPS  # gradients are reduce-scattered, not all-reduced
    mem, ref_mem = seen["memory"], seen["ref_memory"]
    assert mem["unsharded_total"] == ref_mem["total"], (mem, ref_mem)
    assert mem["gradients"] > 0 and mem["optimizer_state"] > 0
    assert mem["total"] <= 0.3 * mem["unsharded_total"], mem


def _gpt_tp(name: str, p: torch.Tensor) -> Any:
    """Hand-placed tensor parallel on mesh["tp"]: MLP up split on its outputs, down on its inputs, positions by row."""
    if name.endswith(("up.weight", "up.bias")) or name == "pos.weight":
        return [Shard(0)]
    if name.endswith("down.weight"):
        return [Shard(1)]
    if name.endswith(("ln1.weight", "ln2.weight")):
        return None  # plain tensors: replicated on tp, kept as plain compute views
    return [Replicate()]


@pytest.mark.parametrize("shard", [False, True])
@distributed(world_size=4)
def test_gpt_data_parallel_times_tensor_parallel_trains_like_single_device(shard: bool) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    seen = _train(_gpt, _gpt_batch, mesh, shard=shard, tp_plan=_gpt_tp)
    model = seen["model"]
    up, down = model.blocks[0].up, model.blocks[0].down
    if not shard:
        assert up.weight.placements == (Replicate(), Shard(0)) and down.weight.placements == (Replicate(), Shard(1))
        assert model.blocks[0].ln1.weight.placements == (Replicate(), Replicate())
    else:  # dp shards the first tensor dim that tp leaves whole; a bias split by tp stays replicated on dp
        assert up.weight.placements == (Shard(1), Shard(0)) and down.weight.placements == (Shard(0), Shard(1))
        assert model.blocks[0].ln1.weight.placements == (Shard(0), Replicate())
        assert up.bias.placements == (Replicate(), Shard(0))
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        assert model.tok.weight._local_tensor.shape[0] == (31, 30)[coordinate[0]]  # 61 rows on 2 dp ranks


@distributed(world_size=4)
def test_cnn_data_parallel_trains_like_single_device() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    for shard in (False, True):  # fc is 10 x 16: uneven on 4 ranks when sharded
        _train(CNN, lambda step: cnn_batch(step, batch=8), mesh, shard=shard, eval_mode=True)


class _Branchy(nn.Module):
    """`extra` runs only where asked (one dp rank), `never` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.extra, self.never = nn.Linear(6, 6), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + self.extra(h)
        return self.b(h).pow(2).mean()


@pytest.mark.parametrize("mesh_shape,dp_dim", [((4,), None), ((2, 2), 1)])
@distributed(world_size=4)
def test_unused_parameters_and_no_sync_give_single_device_gradients(mesh_shape: tuple[int, ...], dp_dim: Optional[int]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)  # (2, 2): unnamed, dp is mesh dim 1
    d = 0 if dp_dim is None else dp_dim
    n, me = mesh.size(d), mesh.get_local_rank(d)
    torch.manual_seed(0)
    ref = _Branchy()
    cap = 1e-4  # 100 B: a few parameters per bucket
    model = copy.deepcopy(ref)
    if me != 0:  # data_parallel starts every dp rank from the first one's values
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    data_parallel(model, mesh, dp_dim=dp_dim, bucket_cap_mb=cap)
    micro = [torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    for x in micro:  # the reference: the sum over micro-batches of the mean over dp ranks
        torch.stack([ref(x.chunk(n)[r], r == 0) for r in range(n)]).mean().backward()
    with no_sync(model), sw.comm_log() as log:
        model(micro[0].chunk(n)[me], me == 0).backward()
    assert not log, [r.op for r in log]
    with sw.comm_log() as log:
        model(micro[1].chunk(n)[me], me == 0).backward()
    assert sum(r.op == "all_reduce" for r in log) == _expected_buckets(model, cap) > 1
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name.startswith("never"):
            assert p.grad is None and q.grad is None, name
            continue
        assert p.grad is not None, name
        _close(f"grad {name}", p.grad.full_tensor(), q.grad)
    assert p.placements == (Replicate(),) * mesh.ndim


@distributed(world_size=4)
def test_bad_arguments_are_reported_together_with_the_fix() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    bad = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    bad[0].weight = nn.Parameter(sw.distribute_tensor(bad[0].weight.detach(), mesh, [Replicate(), Shard(0)]))
    bad[1].weight = nn.Parameter(DTensor.from_local(bad[1].weight.detach(), mesh["tp"], [Partial()]))
    with pytest.raises(ValueError, match=r"(?s)0\.weight is a DTensor on .*sub-mesh of the non-dp dims.*1\.weight has placements \(P\(sum\)\)"):
        data_parallel(bad, mesh)
    with pytest.raises(ValueError, match="1-D"):
        data_parallel(nn.Sequential(bad[0]), sw.init_device_mesh("cpu", (4,)))
    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        data_parallel(nn.Linear(2, 2), mesh, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="'pp' is not a dim"):
        data_parallel(nn.Linear(2, 2), mesh, dp_dim="pp")
    with pytest.raises(TypeError, match="DeviceMesh"):
        data_parallel(nn.Linear(2, 2), (2, 2))  # type: ignore[arg-type]
    good = data_parallel(nn.Linear(2, 2), mesh)
    with pytest.raises(ValueError, match="already data parallel"):
        data_parallel(good, mesh)
    with pytest.raises(ValueError, match="not data parallel"):
        with no_sync(nn.Linear(2, 2)):
            pass
    frozen = nn.Linear(2, 2).requires_grad_(False)
    data_parallel(frozen, mesh)
    frozen.weight.requires_grad_(True)  # too late: it has no bucket, its gradient would never be averaged
    with pytest.raises(ValueError, match="weight got a gradient but did not require one"):
        frozen(torch.ones(3, 2)).sum().backward()


class _Boom(Exception):
    pass


@pytest.mark.parametrize("scenario", ["exception_in_no_sync", "failed_backward", "zero_grad_after_no_sync",
                                      "zero_grad_keeping_tensors", "after_a_reduced_backward"])
@distributed(world_size=4)
def test_unreduced_gradient_terms_are_cleared_with_the_gradients(scenario: str) -> None:
    # Regression: the unreduced terms lived outside `.grad`, so zero_grad() left them and the
    # next step's gradients came out doubled on every rank, with no error
    mesh = sw.init_device_mesh("cpu", (4,))
    n, me = 4, mesh.get_local_rank(0)
    torch.manual_seed(0)
    ref = _Branchy()
    model = copy.deepcopy(ref)
    data_parallel(model, mesh)
    x = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(3))
    if scenario == "after_a_reduced_backward":  # the terms then sit beside a reduced .grad
        model(x.chunk(n)[me], me == 0).backward()
    try:
        if scenario == "failed_backward":
            h = model.a(x.chunk(n)[me])
            h.register_hook(lambda g: (_ for _ in ()).throw(_Boom()))  # raises after b's gradients arrived
            model.b(torch.tanh(h)).pow(2).mean().backward()
        else:
            with no_sync(model):
                model(x.chunk(n)[me], me == 0).backward()
                if scenario == "exception_in_no_sync":
                    raise _Boom()
    except _Boom:
        pass
    model.zero_grad(set_to_none=scenario not in ("zero_grad_keeping_tensors", "after_a_reduced_backward"))
    model(x.chunk(n)[me], me == 0).backward()
    torch.stack([ref(x.chunk(n)[r], r == 0) for r in range(n)]).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.full_tensor().any(), name
            continue
        assert p.grad is not None, name
        _close(f"grad {name}", p.grad.full_tensor(), q.grad)
