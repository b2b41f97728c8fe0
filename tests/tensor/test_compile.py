"""`shardwise.compile`: a traced replay equals eager and runs without DTensor dispatch.

A tensor-parallel MLP (column-split then row-split weights; on (2, 2) the batch is split
by the other mesh dim) computes outputs, loss and gradients with `torch.autograd.grad`
inside the compiled function: the first call traces, later calls replay. Every call is
checked against the single-device reference; the replay must not reach the DTensor
dispatcher nor the strategy functions, and must issue the same collectives as eager. A new
shape or layout re-traces. A train step on an `nn.Module` and an SGD-with-momentum optimizer
(`backward()`, `step()`, `zero_grad()` inside) tracks an eager twin step for step. So do
Adam and AdamW train steps (single-tensor, foreach and fused, amsgrad, weight decay, maximize)
on meshes (2,) and (2, 2), against the twin and one device, with an lr that changes every
call: they replay one program although torch's Adam reads its step count with `.item()`, and
the group flags compile sets for the trace (its fused path, the lr as a tensor) are back as
they were afterwards, also when the trace raises. A function that reads a
tensor value (`.item()`) or draws random numbers runs eagerly with a warning; one that reads
a tensor from its closure replays it by identity, with a warning.
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

from ..dist_helpers import seeded

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


# SGD configurations: for-loop, foreach and fused; momentum, Nesterov, weight decay, maximize, none
_SGDS: list[tuple[str, dict[str, Any]]] = [
    ("momentum for-loop", dict(momentum=0.9, foreach=False)),
    ("nesterov weight_decay foreach", dict(momentum=0.9, nesterov=True, weight_decay=0.1, foreach=True)),
    ("momentum dampening fused", dict(momentum=0.9, dampening=0.1, fused=True)),
    ("plain maximize foreach", dict(maximize=True, foreach=True)),
]


@distributed(world_size=2)
def test_train_step_with_module_and_optimizer_tracks_eager() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    for label, kw in _SGDS:
        models = [_mlp(mesh), _mlp(mesh)]  # compiled, eager twin
        opts = [torch.optim.SGD(m.parameters(), lr=0.01, **kw) for m in models]
        step = sw_compile(_train)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for call in range(5):
                what = f"{label} call {call}"
                x = sw.distribute_tensor(seeded(4, 8, seed=20 + call), mesh, [Replicate()])
                for o in opts:  # a schedule's new lr every call: an input of the one program, not a constant
                    for group in o.param_groups:
                        group["lr"] = 0.01 / (1 + call)
                with _DispatchCounter() as counter:
                    got = step(models[0], opts[0], x)
                want = _train(models[1], opts[1], x)
                if call >= 2:  # call 0 creates the momentum buffers (eager), call 1 traces, then replays
                    assert counter.count == 0, f"{what}: {counter.count} DTensor dispatches"
                torch.testing.assert_close(_value(got), _value(want), **TOL)
                for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
                    torch.testing.assert_close(_value(p), _value(q), **TOL, msg=lambda m: f"{what} {name}\n{m}")
                    assert p.grad is None, f"{what}: {name}.grad survived zero_grad"
                    if kw.get("momentum"):
                        buf, want_buf = opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"]
                        torch.testing.assert_close(_value(buf), _value(want_buf), **TOL,
                                                   msg=lambda m: f"{what} {name}\n{m}")
                group = opts[0].param_groups[0]  # the trace's fused path and lr tensor are undone after it
                flags = (group["lr"], group["fused"], group["foreach"])
                assert flags == (0.01 / (1 + call), kw.get("fused"), kw.get("foreach")), f"{what}: {flags}"
        assert step.programs() == 1, f"{label}: {step.programs()} programs"
        assert not [str(w.message) for w in caught if "shardwise.compile" in str(w.message)], f"{label}: a warning"


def _placed_mlp(mesh: sw.DeviceMesh) -> torch.nn.Module:
    """The seeded MLP with Megatron-placed parameters on the last mesh dim, replicated over the others."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8))
    rest = [Replicate()] * (mesh.ndim - 1)
    tp = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for name, p in list(model.named_parameters()):
        path, _, attr = name.rpartition(".")
        placed = sw.distribute_tensor(p.detach(), mesh, rest + [tp[name]])
        setattr(model.get_submodule(path), attr, torch.nn.Parameter(placed))
    return model


def _plain_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8))


def _adam_train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss: torch.Tensor = model(x).pow(2).sum()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return loss


# Adam and AdamW configurations: the single-tensor and foreach paths, amsgrad, weight decay
# (coupled for Adam, decoupled for AdamW) and maximize.
_ADAMS: list[tuple[str, Any]] = [
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    ("Adam amsgrad weight_decay", lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW foreach amsgrad maximize",
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, maximize=True, foreach=True)),
    ("Adam foreach weight_decay", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
    ("AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)),
]
# The replay steps on Adam's fused kernel, eager on the user's path: the update's formula
# differs in its order of operations only, a few float32 ulps
ADAM_TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-6}


def _adam_case(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x_lay = [Shard(0)] * (len(mesh_shape) - 1) + [Replicate()]  # on (2, 2) the batch is split over the first
    for label, make in _ADAMS:
        models = [_placed_mlp(mesh), _placed_mlp(mesh), _plain_mlp()]  # compiled, eager twin, one device
        opts = [make(m.parameters()) for m in models]
        step = sw_compile(_adam_train)
        steps: dict[str, torch.Tensor] = {}  # each parameter's step count tensor, from the first call on
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for call in range(5):
                what = f"mesh {mesh_shape} {label} call {call}"
                x = seeded(4, 8, seed=30 + call)
                for o in opts:  # a schedule's new lr every call: an input of the one program, not a constant
                    for group in o.param_groups:
                        group["lr"] = 1e-2 / (1 + call)
                with _DispatchCounter() as counter:
                    got = step(models[0], opts[0], sw.distribute_tensor(x, mesh, x_lay))
                if call >= 2:  # call 0 creates the state (eager), call 1 traces, then replays
                    assert counter.count == 0, f"{what}: {counter.count} DTensor dispatches"
                want = _adam_train(models[1], opts[1], sw.distribute_tensor(x, mesh, x_lay))
                ref = _adam_train(models[2], opts[2], x)
                torch.testing.assert_close(_value(got), _value(want), **ADAM_TOL, msg=lambda m: f"{what}: loss\n{m}")
                torch.testing.assert_close(_value(got), ref.detach(), **REF_TOL, msg=lambda m: f"{what}: loss\n{m}")
                named = zip(models[0].named_parameters(), models[1].parameters(), models[2].parameters())
                for (name, p), q, r in named:
                    torch.testing.assert_close(_value(p), _value(q), **ADAM_TOL, msg=lambda m: f"{what} {name}\n{m}")
                    torch.testing.assert_close(_value(p), r.detach(), **REF_TOL, msg=lambda m: f"{what} {name}\n{m}")
                    state, eager_state = opts[0].state[p], opts[1].state[q]
                    assert set(state) == set(eager_state), f"{what} {name}: state {sorted(state)}"
                    for k in sorted(state):
                        if k != "step":
                            torch.testing.assert_close(_value(state[k]), _value(eager_state[k]), **ADAM_TOL,
                                                       msg=lambda m: f"{what} {name} {k}\n{m}")
                    # from the second call on, the step count is one tensor the replay increments in
                    # place, never a new one
                    if call >= 1:
                        assert state["step"] is steps.setdefault(name, state["step"]), f"{what} {name}: step rebound"
                    assert state["step"].item() == eager_state["step"].item() == call + 1, f"{what} {name}"
        done = f"mesh {mesh_shape} {label}"
        assert step.programs() == 1, f"{done}: {step.programs()} programs"
        flags = [(g["capturable"], g["fused"], g["foreach"], type(g["lr"])) for g in opts[0].param_groups]
        assert flags == [(g["capturable"], g["fused"], g["foreach"], float) for g in opts[1].param_groups], (
            f"{done}: flags left set: {flags}")
        messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
        assert not messages, f"{done}: {messages}"


@distributed(world_size=2)
def test_adam_train_step_replays_and_tracks_eager_on_2() -> None:
    _adam_case((2,))


@distributed(world_size=4)
def test_adam_train_step_replays_and_tracks_eager_on_2x2() -> None:
    _adam_case((2, 2))


class _Boom(Exception):
    pass


def _adam_train_or_fail(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, fail: bool) -> None:
    _adam_train(model, opt, x)
    if fail:
        raise _Boom()


@distributed(world_size=2)
def test_compile_leaves_adam_flags_as_they_were() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    model = _placed_mlp(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sw_compile(_adam_train_or_fail)
    # call 0 creates the state, call 1 traces, call 2 replays; then fail=True is a new signature whose
    # trace raises, and the last call replays the first program again
    for call, fail in enumerate([False, False, False, True, False]):
        x = sw.distribute_tensor(seeded(4, 8, seed=40 + call), mesh, [Replicate()])
        if fail:
            with pytest.raises(_Boom):
                step(model, opt, x, fail)
        else:
            step(model, opt, x, fail)
        flags = [(g["capturable"], g["fused"], g["foreach"], g["lr"]) for g in opt.param_groups]
        assert flags == [(False, None, None, 1e-2)], f"call {call}: flags left set: {flags}"
    assert step.programs() == 1, "the user's flags must stay the signature the program was traced for"


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
    assert f.programs() == 0 and f.eager() == 1
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


def _attends(q: DTensor, dropout: float) -> DTensor:
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout, is_causal=True)


_ONE_TIME: set[str] = set()


def _reads_once(x: DTensor) -> DTensor:
    if "done" not in _ONE_TIME:  # one-time work that reads a value, as a cache filling does
        _ONE_TIME.add("done")
        float(x.sum())
    return x * 2


@distributed(world_size=2)
def test_attention_without_dropout_and_one_time_reads_replay() -> None:
    # regressions: sdpa with dropout_p=0 (as models call it) was refused as drawing random
    # numbers; a value read only on the first call (the ranks checking a plain tensor once)
    # made the signature eager for good
    mesh = sw.init_device_mesh("cpu", (2,))
    q = sw.distribute_tensor(seeded(2, 4, 6, 8, seed=7), mesh, [Shard(1)])  # heads split
    f = sw_compile(_attends)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(f(q, 0.0).full_tensor(), _attends(q, 0.0).full_tensor(), **TOL)
        g = sw_compile(_reads_once)
        for seed in (1, 2, 3):
            x = sw.distribute_tensor(seeded(4, 6, seed=seed), mesh, [Shard(0)])
            torch.testing.assert_close(g(x).full_tensor(), x.full_tensor() * 2, **TOL)
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert not messages and f.programs() == 1 and g.programs() == 1, (messages, f.programs(), g.programs())
    with warnings.catch_warnings(record=True) as caught:  # with dropout it draws: refused, twice, then eager
        warnings.simplefilter("always")
        for _ in range(3):
            f(q, 0.5)
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert len(messages) == 1 and "random" in messages[0], messages
    assert f.programs() == 1


@distributed(world_size=2)
def test_the_first_adam_step_is_eagers_bit_for_bit() -> None:
    # regression: the call that creates Adam's state ran on the trace's path too, and its
    # float32 bias corrections moved every parameter off eager's by ~1e-8 for good
    mesh = sw.init_device_mesh("cpu", (2,))
    models = [_placed_mlp(mesh), _placed_mlp(mesh)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    x = sw.distribute_tensor(seeded(4, 8, seed=50), mesh, [Replicate()])
    sw_compile(_adam_train)(models[0], opts[0], x)
    _adam_train(models[1], opts[1], x)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(_value(p), _value(q))


@distributed(world_size=2)
def test_a_signature_that_changes_every_call_keeps_at_most_max_signatures_programs() -> None:
    from shardwise._compile import MAX_SIGNATURES

    mesh = sw.init_device_mesh("cpu", (2,))
    d = sw.distribute_tensor(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])

    def scale(t: DTensor, factor: float) -> DTensor:
        return t * factor  # the float is part of the signature: a new program per value

    compiled = sw_compile(scale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(MAX_SIGNATURES + 8):
            torch.testing.assert_close(compiled(d, float(i)).full_tensor(), d.full_tensor() * i)
    assert compiled.programs() == MAX_SIGNATURES
    assert sum("signatures" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]


def _complex_adam_step(p: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    (p.abs() ** 2).sum().backward()  # type: ignore[no-untyped-call]
    opt.step()


@distributed(world_size=2)
def test_adam_on_complex_parameters_runs_eagerly_with_a_warning_not_on_the_fused_kernel() -> None:
    # regression: the trace stepped every CPU Adam on its fused kernel, which has no complex
    # dtype: the compiled call raised NotImplementedError ("fused_adam_kernel" for ComplexFloat)
    mesh = sw.init_device_mesh("cpu", (2,))
    full = torch.randn(4, 4, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    p = torch.nn.Parameter(sw.distribute_tensor(full.clone(), mesh, [Shard(0)]))
    q = torch.nn.Parameter(full.clone())
    opt, ref_opt = torch.optim.Adam([p], lr=1e-2), torch.optim.Adam([q], lr=1e-2)
    step = sw_compile(_complex_adam_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            step(p, opt)
            _complex_adam_step(q, ref_opt)
    torch.testing.assert_close(p.full_tensor(), q.detach(), atol=1e-12, rtol=1e-12)
    messages = [str(w.message) for w in caught if "shardwise.compile" in str(w.message)]
    assert len(messages) == 1 and "runs eagerly" in messages[0], messages


def test_integer_indexing_replays_and_a_boolean_mask_is_refused() -> None:
    # regression: aten.index.Tensor carries the dynamic-shape tag for its mask form, and every
    # `x[token]` gather (token dispatch, embedding-like lookups) was refused as data-dependent
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardwise._compile._refusal import refusal

    x, at = torch.randn(6, 4), torch.tensor([3, 0, 0, 5])
    assert refusal(make_fx(lambda x, at: x[at] * 2)(x, at)) is None
    reason = refusal(make_fx(lambda x: x[x[:, 0] > 0])(x))
    assert reason is not None and "aten.index.Tensor" in reason and "data-dependent" in reason, reason
