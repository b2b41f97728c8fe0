"""`shardwise.compile`: a traced replay equals eager and runs without DTensor dispatch.

A tensor-parallel MLP (column-split then row-split weights; on (2, 2) the batch is split
by the other mesh dim) computes outputs, loss and gradients with `torch.autograd.grad`
inside the compiled function: the first call traces, later calls replay. Every call is
checked against the single-device reference; the replay must not reach the DTensor
dispatcher nor the strategy functions, and must issue the same collectives as eager. A new
shape or layout re-traces. A train step on an `nn.Module` and an SGD-with-momentum optimizer
(`backward()`, `step()`, `zero_grad()` inside) tracks an eager twin step for step. A
function that reads a tensor value (`.item()`) or draws random numbers runs eagerly with a
warning; one that reads a tensor from its closure replays it by identity, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise._ops import strategy_calls
from shardwise import compile as sw_compile
from shardwise.testing import distributed

from .dist_helpers import seeded

TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-6}  # compiled against eager DTensor
REF_TOL: dict[str, Any] = {"atol": 1e-4, "rtol": 1e-5}  # against one device: sums split over ranks reassociate


class _DispatchCounter(TorchDispatchMode):
    """Counts the aten calls that reach DTensor dispatch: a mode sees every op first, counts
    those with a DTensor argument and hands them on to DTensor's `__torch_dispatch__`."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs))):
            self.count += 1
            return NotImplemented
        return func(*args, **kwargs)


def _step(x: DTensor, w1: DTensor, w2: DTensor) -> tuple[DTensor, DTensor, DTensor, DTensor]:
    h = torch.relu(x @ w1)  # (B, H): H split by tp
    y = h @ w2  # (B, D): partial sums over tp
    loss = (y * y).sum()
    g1, g2 = torch.autograd.grad(loss, [w1, w2])
    return y, loss, g1, g2


def _reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
    w1, w2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    y, loss, g1, g2 = _step(x, w1, w2)  # type: ignore[arg-type]
    return [y.detach(), loss.detach(), g1, g2]


def _value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _full(outs: Any) -> list[torch.Tensor]:
    return [o.full_tensor() for o in outs]


def _mlp_case(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    rest = [Replicate()] * (len(mesh_shape) - 1)
    x_lay, w1_lay, w2_lay = [Shard(0)] * (len(mesh_shape) - 1) + [Replicate()], rest + [Shard(1)], rest + [Shard(0)]
    x_relaid = rest + [Shard(1)]  # x split by features on the tp mesh dim: another program
    w1, w2 = seeded(8, 12, seed=1), seeded(12, 8, seed=2)
    w1d = sw.distribute_tensor(w1, mesh, w1_lay).requires_grad_(True)
    w2d = sw.distribute_tensor(w2, mesh, w2_lay).requires_grad_(True)
    step = sw_compile(_step)
    comms: list[list[str]] = []
    # a new batch size (5: uneven on a split batch) and then a new layout of x re-trace
    for call, (batch, lay) in enumerate([(6, x_lay), (6, x_lay), (6, x_lay), (5, x_lay), (5, x_lay), (6, x_relaid)]):
        x = seeded(batch, 8, seed=10 + call)  # new values every call: nothing may be baked in
        xd = sw.distribute_tensor(x, mesh, lay)
        calls = strategy_calls()
        with _DispatchCounter() as counter, sw.comm_log() as log:
            got = step(xd, w1d, w2d)
        comms.append([r.op for r in log])
        replay = call in (1, 2, 4)
        what = f"mesh {mesh_shape} call {call} batch {batch} ({'replay' if replay else 'trace'})"
        if replay:
            assert counter.count == 0, f"{what}: {counter.count} DTensor dispatches"
            assert strategy_calls() == calls, f"{what}: a strategy function ran"
        else:
            assert counter.count > 0, f"{what}: the trace did not go through DTensor dispatch"
        eager = _step(xd, w1d, w2d)
        assert [o.placements for o in got] == [o.placements for o in eager], what
        for k, (a, b, c) in enumerate(zip(_full(got), _full(eager), _reference(x, w1, w2))):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: output {k} against eager\n{m}")
            torch.testing.assert_close(a, c, **REF_TOL, msg=lambda m: f"{what}: output {k} against one device\n{m}")
    assert step.programs() == 3, f"mesh {mesh_shape}: {step.programs()} programs, want one per signature"
    assert comms[0] and comms[1] == comms[0] and comms[2] == comms[0], f"replay collectives {comms}"
    assert comms[4] == comms[3], f"replay collectives after the re-trace {comms}"


@distributed(world_size=2)
def test_tp_mlp_forward_backward_replays_like_eager_on_2() -> None:
    _mlp_case((2,))


@distributed(world_size=4)
def test_tp_mlp_forward_backward_replays_like_eager_on_2x2() -> None:
    _mlp_case((2, 2))


def _mlp(mesh: sw.DeviceMesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8))
    plan = {"0": sw.parallel.ColwiseParallel(), "2": sw.parallel.RowwiseParallel()}
    return sw.parallel.parallelize_module(model, mesh, plan)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: DTensor) -> DTensor:
    loss = model(x).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@distributed(world_size=2)
def test_train_step_with_module_and_optimizer_tracks_eager() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    models = [_mlp(mesh), _mlp(mesh)]  # compiled, eager twin
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, foreach=False) for m in models]
    step = sw_compile(_train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(5):
            x = sw.distribute_tensor(seeded(4, 8, seed=20 + call), mesh, [Replicate()])
            with _DispatchCounter() as counter:
                got = step(models[0], opts[0], x)
            want = _train(models[1], opts[1], x)
            if call >= 2:  # call 0 creates the momentum buffers (eager), call 1 traces, then replays
                assert counter.count == 0, f"call {call}: {counter.count} DTensor dispatches"
            torch.testing.assert_close(_value(got), _value(want), **TOL)
            for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
                torch.testing.assert_close(_value(p), _value(q), **TOL, msg=lambda m: f"call {call} {name}\n{m}")
                assert p.grad is None, f"call {call}: {name}.grad survived zero_grad"
                buf, want_buf = opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"]
                torch.testing.assert_close(_value(buf), _value(want_buf), **TOL, msg=lambda m: f"call {call} {name}\n{m}")
    assert step.programs() == 1
    assert not [str(w.message) for w in caught if "shardwise.compile" in str(w.message)], "a warning on a train step"


def _reads_a_value(x: DTensor) -> DTensor:
    return x * float(x.sum())


def _draws_random_numbers(x: DTensor) -> DTensor:
    return torch.nn.functional.dropout(x, 0.5, training=True)


@distributed(world_size=2)
def test_untraceable_functions_run_eagerly_and_closure_tensors_warn() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    f = sw_compile(_reads_a_value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2, 3):
            x = seeded(4, 6, seed=seed)
            got = f(sw.distribute_tensor(x, mesh, [Shard(0)]))
            torch.testing.assert_close(got.full_tensor(), x * float(x.sum()), **TOL)
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert len(messages) == 1 and "data-dependent" in messages[0], messages
    assert f.programs() == 0
    torch.manual_seed(0)  # random DTensor ops need one seed on every rank
    g = sw_compile(_draws_random_numbers)
    xd = sw.distribute_tensor(seeded(4, 6, seed=4), mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masks = [(g(xd) != 0).full_tensor() for _ in range(3)]
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert len(messages) == 1 and "random" in messages[0], messages
    assert g.programs() == 0
    assert not torch.equal(masks[1], masks[2]), "the eager calls repeated the same dropout mask"
    # a tensor read from a closure is replayed by identity, with a warning: in-place updates show
    w = sw.distribute_tensor(seeded(6, 3, seed=5), mesh, [Replicate()])
    h = sw_compile(lambda x: x @ w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(3):
            with torch.no_grad():
                w.mul_(2.0)
            torch.testing.assert_close(h(xd).full_tensor(), (xd @ w).full_tensor(), **TOL)
    messages = [str(w.message) for w in caught if "outside its arguments" in str(w.message)]
    assert len(messages) == 1 and h.programs() == 1, messages


def test_compile_refuses_what_is_not_callable() -> None:
    with pytest.raises(TypeError, match="takes a function"):
        sw_compile(3)  # type: ignore[arg-type]
