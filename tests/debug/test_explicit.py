"""Explicit mode: `shardwise.explicit()` turns every implicit redistribution into an error.

A two-layer MLP written with DTensor weights directly (no ParallelStyles): both weights split
by columns, so the second matmul needs its input gathered, an all_to_all the op would run
by itself. Under `explicit()` the forward raises `ImplicitRedistributionError` naming the op,
the input, the collective with its bytes, and the redistribute to write; with that
redistribute written (the second weight moved to rows, which makes the product a Partial
that needs no move), forward and backward run under `explicit()` and equal one process, on
meshes (4,) and (2, 2) (the weights split over every mesh dim), even and uneven. The demo
GPT under its Megatron plan passes as it is: its styles redistribute explicitly.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise._explicit import EXPLICIT, _from_environment
from shardwise._ops import ACTIVE_MODES
from shardwise.testing import distributed


def _weights(d: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(5, d, generator=g, dtype=torch.float64), torch.randn(d, h, generator=g, dtype=torch.float64),
            torch.randn(h, d, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@pytest.mark.parametrize("hidden", [8, 6], ids=["even", "uneven"])
@distributed(world_size=4)
def test_implicit_moves_raise_and_explicit_ones_run(shape: tuple[int, ...], hidden: int) -> None:
    mesh = sw.init_device_mesh("cpu", shape)
    x0, w10, w20 = _weights(6, hidden)
    cols, rows = [Shard(1)] * len(shape), [Shard(0)] * len(shape)
    x = sw.distribute_tensor(x0, mesh, [Replicate()] * len(shape))
    w1 = sw.distribute_tensor(w10, mesh, cols).requires_grad_(True)
    w2 = sw.distribute_tensor(w20, mesh, cols).requires_grad_(True)
    with sw.explicit():
        h = torch.relu(x @ w1)  # R @ S(1): no move
        with pytest.raises(sw.ImplicitRedistributionError) as caught:
            h @ w2  # S(1) @ S(1): one of them must move
        message = str(caught.value)
        assert message.startswith("aten.mm.default would redistribute"), message
        assert "x = x.redistribute(x.device_mesh, [" in message and " B)" in message, message
        assert isinstance(caught.value, ValueError)
        out = h @ w2.redistribute(mesh, rows)  # written down: S(1) @ S(0) is a Partial, no move
        loss = out.sum()
        loss.backward()
    w1r, w2r = w10.clone().requires_grad_(True), w20.clone().requires_grad_(True)
    want = (torch.relu(x0 @ w1r) @ w2r).sum()
    want.backward()
    assert abs(loss.full_tensor().item() - want.item()) < 1e-10
    assert w1.grad is not None and w2.grad is not None
    torch.testing.assert_close(w1.grad.full_tensor(), w1r.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(w2.grad.full_tensor(), w2r.grad, rtol=0, atol=1e-10)
    # outside the block the same op runs, moving the input by itself
    torch.testing.assert_close((h @ w2).full_tensor(), torch.relu(x0 @ w10) @ w20, rtol=0, atol=1e-10)


@distributed(world_size=4)
def test_the_demo_gpt_under_its_megatron_plan_has_no_hidden_communication() -> None:
    from shardwise._demo.model import CharGPT, CharGPTConfig, loss_fn
    from shardwise._demo.train import manual_plan
    from shardwise.parallel import loss_parallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = CharGPT(CharGPTConfig(vocab=16, d_model=32, seq=8))
    parallelize_module(model, mesh, manual_plan(), replicate_rest=True)
    x, y = torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8))
    with sw.explicit(), loss_parallel():
        loss = loss_fn(model(x), y)
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_environment_variable_turns_explicit_mode_on(monkeypatch: pytest.MonkeyPatch) -> None:
    before = ACTIVE_MODES[0]
    try:
        monkeypatch.setenv("SHARDWISE_EXPLICIT", "1")
        _from_environment()
        assert EXPLICIT in ACTIVE_MODES[0]
    finally:
        ACTIVE_MODES[0] = before
    monkeypatch.setenv("SHARDWISE_EXPLICIT", "0")
    _from_environment()
    assert EXPLICIT not in ACTIVE_MODES[0]
