"""Random ops and `*_like` factories on DTensors, on real ranks: placement-invariant values,
each rank generating only its piece, and dropout forward and backward against the
single-device formula with the same mask."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import expected_piece, make_dtensor, seeded

MESHES = [(4,), (2, 2)]


def _layouts(n: int) -> list[list[Any]]:
    if n == 1:
        return [[Replicate()], [Shard(0)], [Shard(1)]]
    return [[Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Shard(1)]]


RANDOM: dict[str, Callable[[torch.Tensor], Any]] = {
    "rand_like": lambda t: torch.rand_like(t),
    "randn_like": lambda t: torch.randn_like(t),
    "randint_like": lambda t: torch.randint_like(t, 3, 11),
    "uniform_": lambda t: t.clone().uniform_(-1.0, 2.0),
    "normal_": lambda t: t.clone().normal_(0.5, 3.0),
    "exponential_": lambda t: t.clone().exponential_(2.0),
    "random_": lambda t: t.clone().random_(0, 100),
    "bernoulli_": lambda t: t.clone().bernoulli_(0.3),
    "bernoulli": lambda t: torch.bernoulli(t),  # t holds probabilities
    "bernoulli_p": lambda t: torch.bernoulli(t, 0.6),
    "dropout": lambda t: F.dropout(t, 0.4, training=True),
    "native_dropout": lambda t: torch.ops.aten.native_dropout.default(t, 0.4, True),
}


def _full(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(_full(o) for o in out)
    assert isinstance(out, DTensor)
    return out.full_tensor()


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_random_ops_give_the_same_global_tensor_under_every_layout(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    probs = torch.rand(9, 6, generator=torch.Generator().manual_seed(2))  # uneven over 4 ranks
    torch.manual_seed(0)
    torch.rand_like(sw.distribute_tensor(probs, mesh))  # the first draw of a process checks that the seeds agree
    for name, fn in RANDOM.items():
        reference = None
        for placements in _layouts(len(mesh_shape)):
            x = sw.distribute_tensor(probs, mesh, placements)
            torch.manual_seed(99)
            with sw.comm_log() as log:
                out = fn(x)
            assert len(log) == 0, f"{name} under {placements} communicated: {[c.op for c in log]}"
            first = out[0] if isinstance(out, tuple) else out
            if name != "native_dropout":  # _nn.py registers a rival strategy that may shard a replicated input
                assert first.placements == tuple(placements), (name, placements, first.placements)
            want = expected_piece(probs, mesh.shape, first.placements, mesh.get_coordinate())
            assert first.to_local().shape == want.shape  # each rank made only its piece
            full = _full(out)
            if reference is None:
                reference = full
            for got, ref in zip(full if isinstance(full, tuple) else (full,), reference if isinstance(reference, tuple) else (reference,)):
                assert torch.equal(got, ref), (name, placements)
        torch.manual_seed(100)
        again = _full(fn(sw.distribute_tensor(probs, mesh, _layouts(len(mesh_shape))[1])))
        differs = [not torch.equal(a, b) for a, b in zip(again if isinstance(again, tuple) else (again,),
                                                          reference if isinstance(reference, tuple) else (reference,))]
        assert differs[0], f"{name}: a new seed gave the same values"


@pytest.mark.parametrize("mesh_shape", MESHES)
@distributed(world_size=4)
def test_random_statistics_partial_inputs_and_dropout_gradients(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    n = len(mesh_shape)
    placements = _layouts(n)[-1]
    torch.manual_seed(5)
    big = sw.zeros(300, 200, device_mesh=mesh, placements=placements)
    u = big.clone().uniform_().full_tensor()
    z = torch.randn_like(big).full_tensor()
    b = big.clone().bernoulli_(0.25).full_tensor()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    assert abs(b.mean() - 0.25) < 0.01
    # a Partial input: *_like outputs are replicated values, empty_like stays partial, an in-place fill
    # of a Partial writes the value once (not once per term)
    full = seeded(7, 5, seed=3)
    p = make_dtensor(full, mesh, [Partial()] * n)
    torch.manual_seed(6)
    r = torch.rand_like(p)
    assert r.placements == (Replicate(),) * n
    torch.manual_seed(6)
    assert torch.equal(r.full_tensor(), torch.rand_like(sw.distribute_tensor(full, mesh, [Replicate()] * n)).full_tensor())
    # zeros_like replicates (as torch), empty_like keeps the Partial (nothing written)
    assert torch.zeros_like(p).placements == (Replicate(),) * n and torch.equal(torch.zeros_like(p).full_tensor(), torch.zeros(7, 5))
    assert torch.empty_like(p).placements == (Partial(),) * n
    torch.testing.assert_close(torch.ones_like(p).full_tensor(), torch.ones(7, 5))
    torch.testing.assert_close(torch.full_like(p, 3.0).full_tensor(), torch.full((7, 5), 3.0))
    filled = p.clone().fill_(2.0)
    assert filled.placements == p.placements
    torch.testing.assert_close(filled.full_tensor(), torch.full((7, 5), 2.0))
    torch.manual_seed(8)
    uu = p.clone().uniform_()
    assert uu.placements == p.placements and float(uu.full_tensor().max()) < 1.0
    torch.testing.assert_close(p.new_zeros((7, 5)).full_tensor(), torch.zeros(7, 5))
    torch.testing.assert_close(p.new_full((2, 3), 4.0).full_tensor(), torch.full((2, 3), 4.0))
    # dropout: forward and backward against the single-device formula with the same mask;
    # on a Partial input the output stays Partial
    for lay in _layouts(n) + [[Partial()] * n]:
        x = make_dtensor(full, mesh, lay).detach().requires_grad_()
        w = sw.distribute_tensor(seeded(7, 5, seed=4), mesh, [Replicate()] * n)
        torch.manual_seed(11)
        y = F.dropout(x, 0.3, training=True)
        (y * w).sum().backward()
        yf = y.full_tensor()
        mask = (yf != 0).to(full.dtype)
        assert 0.4 < mask.mean() < 0.95
        torch.testing.assert_close(yf, full * mask / 0.7)
        assert x.grad is not None
        torch.testing.assert_close(x.grad.full_tensor(), mask / 0.7 * seeded(7, 5, seed=4))
        if lay == [Partial()] * n:
            assert y.placements == tuple(lay)
        torch.manual_seed(11)
        again = F.dropout(sw.distribute_tensor(full, mesh, [Replicate()] * n), 0.3, training=True)
        assert torch.equal(again.full_tensor() != 0, yf != 0)  # the same mask under every layout


@distributed(world_size=4)
def test_cauchy_log_normal_geometric_are_placement_invariant_with_sane_values() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    fills = {
        "cauchy_": lambda t: t.cauchy_(1.0, 0.5),
        "log_normal_": lambda t: t.log_normal_(0.0, 0.25),
        "geometric_": lambda t: t.geometric_(0.3),
    }
    for name, fill in fills.items():
        results = []
        for placements in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(1), Shard(0)]):
            torch.manual_seed(11)
            t = sw.distribute_tensor(torch.zeros(64, 48), mesh, placements)
            results.append(fill(t).full_tensor())
        assert all(torch.equal(r, results[0]) for r in results), name
        v = results[0]
        if name == "cauchy_":
            assert abs(float(v.median()) - 1.0) < 0.1
        elif name == "log_normal_":
            assert bool((v > 0).all()) and abs(float(v.log().mean())) < 0.05
        else:
            assert bool((v >= 1).all()) and torch.equal(v, v.round()) and abs(float(v.mean()) - 1 / 0.3) < 0.2


@distributed(world_size=4)
def test_normal_with_tensor_mean_and_std_is_placement_invariant() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    mean, std = seeded(64, 48, seed=3), seeded(48, seed=4).abs() + 0.5
    results = []
    for placements in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(1), Shard(0)]):
        torch.manual_seed(5)
        m = sw.distribute_tensor(mean, mesh, placements)
        s = sw.distribute_tensor(std, mesh, [Replicate(), Replicate()])
        results.append(torch.normal(m, s).full_tensor())
    assert all(torch.equal(r, results[0]) for r in results)
    z = (results[0] - mean) / std
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
