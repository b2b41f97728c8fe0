"""`FSDPModule.unshard()` / `reshard()` against torch's FSDP2, side by side in the same processes.

After an explicit `unshard()` torch's FSDP2 registers each parameter's unsharded tensor on
its module (a plain `nn.Parameter` of the whole weight; the tp DTensor under TP + FSDP), so
a program can read or copy full weights between steps; `reshard()` (or the module's own
reshard after forward / backward, or `state_dict()` / `load_state_dict()`) registers the
sharded DTensor parameters again, the very objects the optimizer holds. The tests run the
same program through torch's `fully_shard` and shardwise's, each on its own copy of the model
(tensor parallelism + FSDP against one process only), and training steps afterwards must equal
one process on the whole batch (float64, 1e-10). `head` is a Linear(24, 30): its 30 rows split
8, 8, 8, 6 over 4 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.fsdp import MixedPrecisionPolicy, fully_shard
from shardwise.testing import distributed

ROWS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 24)
        self.head = nn.Linear(24, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4 * ROWS, 6, generator=g, dtype=torch.float64) for _ in range(steps)]


def _names(mesh_shape: tuple[int, ...]) -> tuple[str, ...]:
    return ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)


def _side_by_side(mesh_shape: tuple[int, ...], dtype: torch.dtype = torch.float64,
                  param_dtype: torch.dtype | None = None) -> tuple[Net, Net]:
    """(shardwise's, torch's) fully_shard of the same model: `head`, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours, theirs = _model().to(dtype), _model().to(dtype)
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=_names(mesh_shape))
    fully_shard(ours.head, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype))
    fully_shard(ours, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype))
    torch_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=_names(mesh_shape))
    torch_fully_shard(theirs.head, mesh=torch_mesh, mp_policy=TorchPolicy(param_dtype))
    torch_fully_shard(theirs, mesh=torch_mesh, mp_policy=TorchPolicy(param_dtype))
    return ours, theirs


def _rows() -> slice:
    import torch.distributed as dist

    rank = dist.get_rank()
    return slice(rank * ROWS, (rank + 1) * ROWS)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _sharded(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor as TorchDTensor

    return isinstance(p, (sw.DTensor, TorchDTensor))


def _registered(model: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, 'sharded' or 'whole', global shape) of every registered parameter."""
    out = []
    for name, p in model.named_parameters():
        whole = type(p) is nn.Parameter and not _sharded(p)
        assert whole or _sharded(p), f"{name}: {type(p).__name__}"
        out.append((name, "whole" if whole else "sharded", tuple(p.shape)))
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if _sharded(p) else p.detach()


def _check_whole(model: nn.Module, one: nn.Module, who: str) -> None:
    """Every registered parameter a plain leaf nn.Parameter equal to the one-process weight."""
    for (name, p), (_, r) in zip(model.named_parameters(), one.named_parameters()):
        assert type(p) is nn.Parameter and not _sharded(p), f"{who} {name}: {type(p).__name__}"
        assert p.is_leaf and p.requires_grad and p.grad is None, f"{who} {name}"
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{who} {name}: {m}")


def _check_exact(models: dict[str, nn.Module], one: nn.Module) -> None:
    for who, model in models.items():
        for (name, p), (_, r) in zip(model.named_parameters(), one.named_parameters()):
            torch.testing.assert_close(_full(p), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{who} {name}: {m}")


def _unshard_all(model: Any) -> None:
    model.head.unshard()
    model.unshard()


def _reshard_all(model: Any) -> None:
    model.head.reshard()
    model.reshard()


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_unshard_left_the_sharded_dtensors_registered_instead_of_the_whole_weights(
        mesh_shape: tuple[int, ...]) -> None:
    # the bug: after model.unshard(), model.head.weight was still the (30, 24) sharded DTensor
    rows, batches = _rows(), _batches(3)
    one = _model()
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-2, foreach=False)
    ours, theirs = _side_by_side(mesh_shape)
    models = {"ours": ours, "torch": theirs}
    opts = {who: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for who, m in models.items()}
    stored = {who: list(m.parameters()) for who, m in models.items()}
    _step(one, one_opt, batches[0])
    for who, m in models.items():
        _step(m, opts[who], batches[0][rows])
    whole: dict[str, list[nn.Parameter]] = {}
    for who, m in models.items():
        _unshard_all(m)
        assert type(m.head.weight) is nn.Parameter and m.head.weight.shape == (30, 24), who
        _check_whole(m, one, who)
        whole[who] = list(m.parameters())
    assert _registered(ours) == _registered(theirs)
    for who, m in models.items():
        _reshard_all(m)
        # the sharded parameters are back: the same objects the optimizer steps
        now = list(m.parameters())
        assert all(p is q for p, q in zip(now, stored[who])) and len(now) == len(stored[who]), who
        assert all(p is q for p, q in zip(now, opts[who].param_groups[0]["params"])), who
    assert _registered(ours) == _registered(theirs) == [(n, "sharded", s) for n, _, s in _registered(ours)]
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert p.to_local().shape == q.to_local().shape  # type: ignore[operator]
    for x in batches[1:]:
        _step(one, one_opt, x)
        for who, m in models.items():
            _step(m, opts[who], x[rows])
    _check_exact(models, one)
    # the next unshard gathers the stepped weights into the same unsharded parameters, as torch's
    for who, m in models.items():
        _unshard_all(m)
        _check_whole(m, one, who)
        assert all(p is q for p, q in zip(m.parameters(), whole[who])), who
        _reshard_all(m)


@distributed(world_size=4)
def test_forward_and_backward_while_unsharded_register_and_train_as_torch() -> None:
    # a forward while explicitly unsharded reshards what reshard_after_forward reshards (head; the
    # root keeps its parameters whole until the end of backward), and the step stays exact
    rows, batches = _rows(), _batches(3)
    one = _model()
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-2, foreach=False)
    ours, theirs = _side_by_side((4,))
    models = {"ours": ours, "torch": theirs}
    opts = {who: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for who, m in models.items()}
    seen: dict[str, list[tuple[int, ...]]] = {"ours": [], "torch": []}
    for who, m in models.items():
        m.head.register_forward_pre_hook(lambda mod, args, who=who: seen[who].append(tuple(mod.weight.shape)))
    for x in batches:
        one(x).square().mean().backward()
        after: dict[str, Any] = {}
        for who, m in models.items():
            _unshard_all(m)
            loss = m(x[rows]).square().mean()
            after[who] = _registered(m)
            loss.backward()
            after[who + " backward"] = _registered(m)
        assert after["ours"] == after["torch"]
        assert ("head.weight", "sharded", (30, 24)) in after["ours"] and ("body.weight", "whole", (24, 6)) in after["ours"]
        assert after["ours backward"] == after["torch backward"]
        assert {kind for _, kind, _ in after["ours backward"]} == {"sharded"}
        one_opt.step()
        one_opt.zero_grad()
        for who, m in models.items():
            opts[who].step()
            opts[who].zero_grad()
    assert seen["ours"] == seen["torch"] == [(30, 24)] * len(batches)  # the forward sees the whole weight
    _check_exact(models, one)
    # evaluation while unsharded (no grad): the same registrations as torch afterwards, then a step
    x = batches[0]
    for who, m in models.items():
        _unshard_all(m)
        with torch.no_grad():
            torch.testing.assert_close(m(x[rows]), one(x[rows]), atol=1e-10, rtol=0)
    assert _registered(ours) == _registered(theirs)
    for who, m in models.items():
        _reshard_all(m)
        _step(m, opts[who], x[rows])
    _step(one, one_opt, x)
    _check_exact(models, one)


@distributed(world_size=4)
def test_async_unshard_registered_nothing_after_wait() -> None:
    rows, batches = _rows(), _batches(2)
    one = _model()
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-2, foreach=False)
    ours, theirs = _side_by_side((4,))
    models = {"ours": ours, "torch": theirs}
    opts = {who: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for who, m in models.items()}
    for who, m in models.items():
        handles = [m.head.unshard(async_op=True), m.unshard(async_op=True)]
        assert _sharded(m.head.weight), who  # registered at wait(), not before
        for handle in handles:
            assert handle is not None
            handle.wait()
        _check_whole(m, one, who)
    for who, m in models.items():
        _reshard_all(m)
        _step(m, opts[who], batches[0][rows])
    _step(one, one_opt, batches[0])
    _check_exact(models, one)
    # a handle nobody waited for: the forward finishes the gather; a wait after it is a no-op
    x = batches[1]
    for who, m in models.items():
        handle = m.head.unshard(async_op=True)
        loss = m(x[rows]).square().mean()
        assert handle is not None
        with sw.comm_log() as log:
            handle.wait()
        assert not log, [r.op for r in log]
        assert _sharded(m.head.weight), who  # the forward resharded it
        loss.backward()
        opts[who].step()
        opts[who].zero_grad()
    _step(one, one_opt, x)
    _check_exact(models, one)
    assert _registered(ours) == _registered(theirs)


@distributed(world_size=4)
def test_state_dict_while_unsharded_reshards_first_as_torch() -> None:
    rows, batches = _rows(), _batches(2)
    one = _model()
    ours, theirs = _side_by_side((4,))
    models = {"ours": ours, "torch": theirs}
    opts = {who: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for who, m in models.items()}
    start = {who: {k: v.detach().clone() for k, v in m.state_dict().items()} for who, m in models.items()}
    for who, m in models.items():
        _unshard_all(m)
        state = m.state_dict()
        assert all(_sharded(v) for v in state.values()), who  # the sharded parameters, as saved
        assert {kind for _, kind, _ in _registered(m)} == {"sharded"}, who  # and registered again
    for who, m in models.items():
        _step(m, opts[who], batches[0][rows])
        _unshard_all(m)
        m.load_state_dict(start[who])  # loads into the sharded parameters: the next unshard sees it
        assert {kind for _, kind, _ in _registered(m)} == {"sharded"}, who
        _unshard_all(m)
        _check_whole(m, one, who)
        _reshard_all(m)


@distributed(world_size=4)
def test_unshard_under_tensor_parallel_registers_the_tp_dtensor() -> None:
    import torch.distributed as dist

    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = dist.get_rank() // 2
    batches = _batches(2)
    one = _model()
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-2, foreach=False)
    ours = _model()
    parallelize_module(ours, mesh["tp"], {"body": ColwiseParallel(), "head": RowwiseParallel()})
    fully_shard(ours.head, mesh=mesh["dp"])
    fully_shard(ours, mesh=mesh["dp"])
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=False)
    stored = list(ours.parameters())
    rows = slice(dp * 2 * ROWS, (dp + 1) * 2 * ROWS)
    _step(ours, opt, batches[0][rows])
    _step(one, one_opt, batches[0])
    _unshard_all(ours)
    w = ours.head.weight
    assert isinstance(w, nn.Parameter) and isinstance(w, sw.DTensor) and w.device_mesh == mesh["tp"]
    assert [str(p) for p in w.placements] == ["S(1)"] and w.to_local().shape == (30, 12)
    for (name, p), (_, r) in zip(ours.named_parameters(), one.named_parameters()):
        assert isinstance(p, sw.DTensor) and p.device_mesh == mesh["tp"], name
        torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")
    _reshard_all(ours)
    assert all(p is q for p, q in zip(ours.parameters(), stored))
    _step(ours, opt, batches[1][rows])
    _step(one, one_opt, batches[1])
    _check_exact({"ours": ours}, one)
    _unshard_all(ours)  # gathered again into the same tp DTensors: the stepped weights
    assert ours.head.weight is w
    for (name, p), (_, r) in zip(ours.named_parameters(), one.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")
    _reshard_all(ours)


@distributed(world_size=4)
def test_unshard_registers_the_param_dtype_as_torch() -> None:
    ours, theirs = _side_by_side((4,), torch.float32, param_dtype=torch.bfloat16)
    expected = {name: _full(p).to(torch.bfloat16) for name, p in ours.named_parameters()}
    for who, m in {"ours": ours, "torch": theirs}.items():
        _unshard_all(m)
        for name, p in m.named_parameters():
            assert type(p) is nn.Parameter and p.dtype == torch.bfloat16, f"{who} {name}"
            assert torch.equal(p.detach(), expected[name]), f"{who} {name}"
        _reshard_all(m)
        assert {p.dtype for p in m.parameters()} == {torch.float32}, who
