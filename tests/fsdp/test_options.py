"""Each remaining `fully_shard` option and `FSDPModule` method, side by side with torch's FSDP2
and one process (float64, 5 AdamW steps, 4 gloo ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.fsdp import MixedPrecisionPolicy, fully_shard
from shardwise.testing import distributed

from .test_fully_shard import ROWS, _batches, _check, _model, _torch_fsdp, _train


def _ours(model: nn.Module, mesh_shape: tuple[int, ...], **kwargs: Any) -> nn.Module:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _wide() -> nn.Module:
    """The test model with a hidden width of 20: fc2's weight (10, 20) splits evenly on dim 1."""
    model = _model()
    torch.manual_seed(5)
    for block in model.blocks:
        block.fc1, block.fc2 = nn.Linear(10, 20).double(), nn.Linear(20, 10).double()
    return model


def _side_by_side(mesh_shape: tuple[int, ...], options: Callable[[str, nn.Module], dict[str, Any]],
                  step: Callable[[nn.Module], None] | None = None, one_step: Callable[[nn.Module], None] | None = None,
                  before: Callable[[nn.Module], None] | None = None,
                  build: Callable[[], nn.Module] = _model) -> tuple[nn.Module, nn.Module, nn.Module]:
    import torch.distributed as dist

    rank = dist.get_rank()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    batches = _batches(4, torch.float64)
    one = build()
    _train(one, batches, slice(None), one_step)
    made = []
    for who, shard in (("torch", _torch_fsdp), ("ours", _ours)):
        model = build()
        model = shard(model, mesh_shape, **options(who, model))
        if before is not None:
            before(model)
        _train(model, batches, rows, step)
        made.append(model)
    return made[1], made[0], one


@distributed(world_size=4)
def test_shard_placement_fn_and_ignored_params() -> None:
    def options(who: str, model: nn.Module) -> dict[str, Any]:
        if who == "torch":
            from torch.distributed.tensor import Shard as TorchShard

            def placement(p: nn.Parameter) -> Any:
                return TorchShard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
        else:
            def placement(p: nn.Parameter) -> Any:
                return sw.Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
        return {"shard_placement_fn": placement, "ignored_params": {model.head.bias}}

    def sync_ignored(model: nn.Module) -> None:  # ignored: not reduced, so the program averages it itself
        import torch.distributed as dist

        grad = model.head.bias.grad
        dist.all_reduce(grad)
        grad /= 4

    ours, theirs, one = _side_by_side((4,), options, step=sync_ignored, build=_wide)
    _check(ours, theirs, one, 1e-10)
    assert [str(p) for p in ours.blocks[0].fc2.weight.placements] == ["S(1)"]
    assert ours.blocks[0].fc2.weight._local_tensor.shape == (10, 5)
    assert [str(p) for p in ours.blocks[0].fc1.weight.placements] == ["S(0)"]
    assert not isinstance(ours.head.bias, sw.DTensor)


@distributed(world_size=4)
def test_hsdp_with_all_reduce_deferred_and_a_gradient_divide_factor() -> None:
    # set_requires_all_reduce(False) on even micro-steps, then True: the same as syncing each time
    import torch.distributed as dist

    rank = dist.get_rank()
    batches = _batches(4, torch.float64)
    one = _model()
    _train(one, batches, slice(None))
    made = []
    for shard in (_torch_fsdp, _ours):
        model = shard(_model(), (2, 2))
        for m in model.modules():  # two micro-steps of 4 ranks: the mean over all 8 pieces (per module, as in torch)
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(8.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        for x in batches:
            mine = x[rank * ROWS:(rank + 1) * ROWS]
            for k in range(ROWS):  # one row per micro-step; the replicate all_reduce only at the last
                model.set_requires_all_reduce(k == ROWS - 1)
                model(mine[k:k + 1]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        made.append(model)
    theirs, ours = made
    _check(ours, theirs, one, 1e-10)


@distributed(world_size=4)
def test_output_dtype_and_cast_forward_inputs_as_torch() -> None:
    def options(who: str, model: nn.Module) -> dict[str, Any]:
        if who == "torch":
            from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

            return {"mp_policy": TorchPolicy(output_dtype=torch.float64, cast_forward_inputs=True)}
        return {"mp_policy": MixedPrecisionPolicy(output_dtype=torch.float64, cast_forward_inputs=True)}

    ours, theirs, one = _side_by_side((4,), options)
    _check(ours, theirs, one, 1e-10)
    x = torch.randn(ROWS, 6, dtype=torch.float64)
    assert ours(x).dtype == theirs(x).dtype == torch.float64


@distributed(world_size=4)
def test_explicit_unshard_reshard_and_prefetch_lists() -> None:
    def options(who: str, model: nn.Module) -> dict[str, Any]:
        return {}

    def prefetch_two(model: nn.Module) -> None:
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
        handle = model.blocks[0].unshard(async_op=True)
        assert handle is not None
        handle.wait()
        model.blocks[0].reshard()

    ours, theirs, one = _side_by_side((4,), options, before=prefetch_two)
    _check(ours, theirs, one, 1e-10)


@distributed(world_size=4)
def test_reshard_after_forward_to_a_group_of_two() -> None:
    def options(who: str, model: nn.Module) -> dict[str, Any]:
        return {"reshard_after_forward": 2}

    ours, theirs, one = _side_by_side((4,), options)
    _check(ours, theirs, one, 1e-10)
    x = torch.randn(ROWS, 6, dtype=torch.float64)
    with sw.comm_log() as log:
        loss = ours(x).sum()
    unit = ours.blocks[1]._shardwise_fsdp_state.unit
    kept = next(p for p in unit.params if p.name == "fc1.weight")  # (18, 10): 9 rows kept of 18
    assert kept.kept is not None and kept.kept.shape == (9, 10)
    with sw.comm_log() as backward:
        loss.backward()
    assert [r.group_size for r in log if r.op == "all_gather"] == [4] * 5  # the root and 4 blocks
    gathers = [r.group_size for r in backward if r.op == "all_gather"]
    assert gathers == [2] * 5, gathers  # every unit again (the int was given to the root too), over its pair only
