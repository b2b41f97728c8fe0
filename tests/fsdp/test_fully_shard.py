"""`shardwise.fsdp.fully_shard` against torch's `fully_shard` and one process.

The same training program (pre-norm MLP blocks, AdamW, 5 steps, each rank its own slice
of the batch) runs through `torch.distributed.fsdp` and through `shardwise.fsdp` in the
same 4 gloo processes; every parameter must end equal between them and to one process
training on the whole batch (float64: 1e-10). A width of 10 does not divide by 4: the
last rank's pieces are smaller.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from shardwise.testing import distributed

WIDTH, HIDDEN, DEPTH, ROWS = 10, 18, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(dtype: torch.dtype = torch.float64) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def _batches(world: int, dtype: torch.dtype, steps: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(world * ROWS, 6, generator=g).to(dtype) for _ in range(steps)]


def _train(model: nn.Module, batches: list[torch.Tensor], rows: slice, step: Callable[..., Any] | None = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for x in batches:
        loss = model(x[rows]).square().mean()
        loss.backward()
        if step is not None:
            step(model)
        opt.step()
        opt.zero_grad()


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _torch_fsdp(model: nn.Module, mesh_shape: tuple[int, ...], **kwargs: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, **kwargs)
    torch_fully_shard(model, mesh=mesh, **kwargs)
    return model


def _ours(model: nn.Module, mesh_shape: tuple[int, ...], **kwargs: Any) -> nn.Module:
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _check(ours: nn.Module, theirs: nn.Module, one: nn.Module, tol: float) -> None:
    for (name, p), (_, q), (_, r) in zip(ours.named_parameters(), theirs.named_parameters(), one.named_parameters()):
        torch.testing.assert_close(_full(p), _full(q), atol=tol, rtol=0, msg=lambda m: f"{name} vs torch: {m}")
        torch.testing.assert_close(_full(p), r.detach(), atol=tol, rtol=0, msg=lambda m: f"{name} vs one: {m}")


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("reshard", [None, False, True])
@distributed(world_size=4)
def test_fully_shard_trains_as_torch_fsdp2_and_one_process(mesh_shape: tuple[int, ...], reshard: bool | None) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    batches = _batches(4, torch.float64)
    one = _model()
    _train(one, batches, slice(None))
    theirs = _torch_fsdp(_model(), mesh_shape, reshard_after_forward=reshard)
    _train(theirs, batches, rows)
    ours = _ours(_model(), mesh_shape, reshard_after_forward=reshard)
    assert type(ours).__name__ == "FSDPNet" and isinstance(ours, FSDPModule) and isinstance(ours, Net)
    assert type(ours.blocks[0]).__name__ == "FSDPBlock"
    _train(ours, batches, rows)
    _check(ours, theirs, one, 1e-10)
    # stored sharded on dim 0 with torch.chunk pieces, names unchanged, as torch stores them
    for (name, p), (tname, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert name == tname
        assert p._local_tensor.shape == q._local_tensor.shape, name
        assert [str(x) for x in p.placements] == [str(x) for x in q.placements], name
    with sw.comm_log() as log:
        state = ours.state_dict()
    assert not log  # sharded, without communication
    assert set(state) == set(theirs.state_dict())
    assert all(isinstance(v, sw.DTensor) for v in state.values())


@distributed(world_size=4)
def test_gradient_accumulation_without_sync_equals_one_step_on_the_whole_batch() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    batches = _batches(4, torch.float64, steps=3)
    one = _model()
    _train(one, batches, slice(None))
    ours = _ours(_model(), (4,))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for x in batches:
        mine = x[rank * ROWS:(rank + 1) * ROWS]
        for k in range(ROWS):  # one row per micro-step, reduced once at the last
            ours.set_requires_gradient_sync(k == ROWS - 1)
            (ours(mine[k:k + 1]).square().mean() / ROWS).backward()
        opt.step()
        opt.zero_grad()
    for (name, p), (_, r) in zip(ours.named_parameters(), one.named_parameters()):
        torch.testing.assert_close(_full(p), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")


@distributed(world_size=4)
def test_one_all_gather_per_unit_per_pass_and_one_reduce_scatter_per_unit() -> None:
    ours = _ours(_model(), (4,))
    x = torch.randn(ROWS, 6, dtype=torch.float64)
    ours(x).sum().backward()  # the first step records the forward order
    with sw.comm_log() as log:
        ours(x).sum().backward()
    kinds = [r.op for r in log]
    units = DEPTH + 1
    # forward: every unit once; backward: the blocks again (resharded after forward), the root kept
    assert kinds.count("all_gather") == units + DEPTH, kinds
    assert kinds.count("reduce_scatter") == units, kinds
    assert set(kinds) == {"all_gather", "reduce_scatter"}, kinds


@distributed(world_size=4)
def test_bad_input_names_the_module_the_value_and_the_fix() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    model = _model()
    fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match=r"Block is already in a unit .* call fully_shard once per module"):
        fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match=r"reshard_after_forward=3\): an int must be a divisor of the shard dim's size 4"):
        fully_shard(model.blocks[1], mesh=mesh, reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"param_dtype=torch.int32\): .* must be a floating dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"deepcopy\(FSDPBlock\): a module given to fully_shard cannot be copied"):
        copy.deepcopy(model.blocks[0])
    # a weight tied across two calls would become two copies that drift apart: refused, nothing changed
    tied = _model()
    tied.head.weight = tied.blocks[1].fc2.weight  # (no forward here: only the tie matters)
    fully_shard(tied.blocks[1], mesh=mesh)
    before = [type(p) for p in tied.parameters()]
    with pytest.raises(ValueError, match=r"head.weight is the parameter Block.fc2.weight that an earlier fully_shard "
                                         r"call took \(a tied weight\)"):
        fully_shard(tied, mesh=mesh)
    assert [type(p) for p in tied.parameters()] == before  # nothing was sharded by the refused call
    with pytest.raises(ValueError, match=r"a 1-D mesh \(shard\) or a 2-D mesh"):
        fully_shard(model.blocks[1], mesh=sw.init_device_mesh("cpu", (1, 2, 2)))


@distributed(world_size=4)
def test_bf16_compute_with_fp32_reduction_equals_torch_fsdp2_under_the_same_policy() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    rank = dist.get_rank()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    batches = _batches(4, torch.float32)
    theirs = _torch_fsdp(_model(torch.float32), (4,), mp_policy=TorchPolicy(torch.bfloat16, torch.float32))
    _train(theirs, batches, rows)
    ours = _ours(_model(torch.float32), (4,), mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    seen: list[torch.dtype] = []
    ours.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    _train(ours, batches, rows)
    assert seen and set(seen) == {torch.bfloat16}  # the forward computes in bf16
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert p.dtype == torch.float32 and p.grad is None  # the optimizer steps the float32 shards
        torch.testing.assert_close(_full(p), _full(q), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@distributed(world_size=4)
def test_tensor_parallel_then_fully_shard_on_dp_trains_as_one_process() -> None:
    # torchtitan's 2-D recipe: parallelize_module on mesh["tp"], then fully_shard on mesh["dp"]
    import torch.distributed as dist

    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = dist.get_rank() // 2
    rows = slice(dp * 2 * ROWS, (dp + 1) * 2 * ROWS)
    batches = _batches(4, torch.float64)
    one = _model()
    _train(one, batches, slice(None))
    ours = _model()
    for block in ours.blocks:
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(ours, mesh=mesh["dp"])
    fc1 = ours.blocks[0].fc1.weight
    assert fc1.device_mesh == mesh and [str(p) for p in fc1.placements] == ["S(0)", "S(0)"]
    _train(ours, batches, rows)
    for (name, p), (_, r) in zip(ours.named_parameters(), one.named_parameters()):
        torch.testing.assert_close(_full(p), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")


@distributed(world_size=4)
def test_reset_iter_state_after_a_failed_step_leaves_the_next_step_exact() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    batches = _batches(4, torch.float64)
    one = _model()
    _train(one, batches, slice(None))
    ours = _ours(_model(), (4,))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=False)

    def step(x: torch.Tensor) -> None:
        ours(x[rows]).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(batches[0])  # the forward order is known: prefetch runs in the failed step

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    # backward fails halfway: block 3's reduction started, block 1 prefetched, the rest never ran
    hook = ours.blocks[1].register_forward_hook(lambda m, a, out: [out.register_hook(fail), out][1])
    with pytest.raises(RuntimeError, match="boom"):
        ours(batches[1][rows]).square().mean().backward()
    hook.remove()
    ours.reset_iter_state()
    for p in ours.parameters():
        p.grad = None  # (the failed step's finished reductions are the user's to drop, as under torch)
    for x in batches[1:]:
        step(x)
    for (name, p), (_, r) in zip(ours.named_parameters(), one.named_parameters()):
        assert p.grad is None
        torch.testing.assert_close(_full(p), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")
