"""Automatic balance: the block-partition solver against brute force, balance_by_time on
sleeping layers, balance_by_size on big and small layers, the sandbox, and errors."""

from __future__ import annotations

import doctest
import itertools
import random
import time
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from shardwise.pipeline import balance_by_size, balance_by_time, balance_cost
from shardwise.pipeline import _balance


def brute_force_best_max(cost: Sequence[float], k: int) -> float:
    """The oracle: the smallest largest block over every cut into k non-empty blocks."""
    n = len(cost)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(cost[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def blocks(cost: Sequence[float], balance: list[int]) -> list[float]:
    bounds = list(itertools.accumulate([0, *balance]))
    return [sum(cost[a:b]) for a, b in zip(bounds, bounds[1:])]


# -- the solver --------------------------------------------------------------------------------

@pytest.mark.parametrize(("cost", "k", "expected"), [
    ([1, 2, 3, 4, 5, 6], 2, [4, 2]),     # torchgpipe: [[1, 2, 3, 4], [5, 6]]
    ([1, 2, 3, 4, 5, 6], 3, [3, 2, 1]),  # 6 | 9 | 6: the 6 must stand alone, then 5 needs 4 beside it
    ([0, 0, 0, 0, 0, 0], 2, [3, 3]),     # all ties: the most even layer counts
    ([1, 2, 3, 4, 5, 6], 1, [6]),
    ([5, 1, 1, 1], 4, [1, 1, 1, 1]),
    ([9, 1, 1, 1, 1, 1], 2, [1, 5]),
    ([1, 1, 1, 1, 1, 9], 2, [5, 1]),
    ([3, 3, 1, 1, 1, 1], 2, [2, 4]),
])
def test_balance_cost_examples(cost: list[float], k: int, expected: list[int]) -> None:
    got = balance_cost(cost, k)
    assert max(blocks(cost, got)) == brute_force_best_max(cost, k)
    assert got == expected


def test_balance_cost_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        cost = [rng.choice([0, 1, 2, 3, 5, 8, 13]) * rng.random() for _ in range(n)]
        got = balance_cost(cost, k)
        assert len(got) == k and sum(got) == n and min(got) >= 1
        assert max(blocks(cost, got)) == pytest.approx(brute_force_best_max(cost, k), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(("partitions", "length", "message"), [
    (0, 3, "partitions must be a positive integer, got 0"),
    (-2, 3, "partitions must be a positive integer, got -2"),
    (4, 3, "cost sequence [1.0, 1.0, 1.0] (list) is shorter than intended partitions (3 < 4): every partition "
           "needs at least one layer; use at most 3 partitions"),
])
def test_balance_cost_errors(partitions: int, length: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        balance_cost([1.0] * length, partitions)
    assert message in str(info.value)


def test_balance_doctests_pass() -> None:
    result = doctest.testmod(_balance)
    assert result.attempted > 0 and result.failed == 0


# -- balance_by_time ---------------------------------------------------------------------------

class Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


@pytest.mark.parametrize(("seconds", "expected"), [
    ([0, 0, 0, 0, 0.05, 0.05], [5, 1]),
    ([0.05, 0.05, 0, 0, 0, 0], [1, 5]),
])
def test_balance_by_time_separates_the_slow_layers(seconds: list[float], expected: list[int]) -> None:
    # the one cut between the two slow layers costs 50 ms per block, every other cut 100 ms:
    # the margin is a whole slow layer, far above scheduling noise
    model = nn.Sequential(*(Sleep(s) for s in seconds))
    assert balance_by_time(2, model, torch.rand(1), timeout=0.2) == expected


class FakeClock:
    """`time` stand-in for the balancer: perf_counter advances only when a layer 'sleeps'."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_balance_by_time_sums_every_repetition_and_restarts_from_the_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(_balance, "time", clock)
    seen: list[list[float]] = []

    class Cost(nn.Module):
        def __init__(self, cost: float) -> None:
            super().__init__()
            self.cost = cost

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock.now += self.cost
            return x + 1

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.tolist())
            return x

    model = nn.Sequential(Cost(4.0), Cost(1.0), Probe(), Cost(1.0), Cost(1.0), Cost(1.0))
    # 8 fake seconds per repetition: a timeout of 10 means exactly two, totals [8, 2, 0, 2, 2, 2]
    assert balance_by_time(2, model, torch.zeros(2), timeout=10.0) == [1, 5]
    assert seen == [[2.0, 2.0], [2.0, 2.0]]  # every repetition starts again from the sample


def test_balance_by_time_runs_forward_and_backward_on_tuples() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str, torch.Tensor]:
            return x * 2, "tag", x.detach()

    class Join(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, xs: tuple[torch.Tensor, str, torch.Tensor]) -> torch.Tensor:
            assert xs[1] == "tag"
            return xs[0] * self.w + xs[2]

    model = nn.Sequential(nn.Linear(3, 3), Split(), Join())
    assert balance_by_time(3, model, torch.rand(4, 3), timeout=0.0) == [1, 1, 1]
    assert balance_by_size(2, model, torch.rand(4, 3), chunks=2) in ([1, 2], [2, 1])


# -- balance_by_size ---------------------------------------------------------------------------

def test_balance_by_size_follows_parameter_bytes() -> None:
    small, big = (lambda: nn.Linear(8, 8)), (lambda: nn.Linear(8, 2048))
    x = torch.rand(4, 8)
    assert balance_by_size(2, nn.Sequential(small(), small(), small(), big()), x) == [3, 1]
    assert balance_by_size(2, nn.Sequential(big(), nn.Linear(2048, 8), small(), small()), x) == [1, 3]


def test_balance_by_size_weighs_parameters_by_param_scale() -> None:
    # layer 0: 16.6 KB of parameters, saves its 64 KB input; layers 1-3: no parameters, each
    # saves a 64 KB output. Activations alone split 2 | 2; heavy optimizer state isolates layer 0.
    model = nn.Sequential(nn.Linear(64, 64), nn.Sigmoid(), nn.Tanh(), nn.Sigmoid())
    x = torch.rand(512, 64)
    assert balance_by_size(2, model, x, chunks=2, param_scale=0.0) == [2, 2]
    assert balance_by_size(2, model, x, chunks=2, param_scale=10.0) == [1, 3]


def test_size_profile_counts_saved_activations_of_one_microbatch() -> None:
    x = torch.randn(6, 10, requires_grad=True)
    cpu = torch.device("cpu")
    # sigmoid and tanh save their outputs: one micro-batch of 3 x 10 float32 = 120 bytes
    assert _balance._profile_sizes(nn.Sequential(nn.Sigmoid(), nn.Tanh()), x, 2, 2.0, cpu) == [120.0, 120.0]
    # relu on an input that needs no gradient keeps nothing
    assert _balance._profile_sizes(nn.Sequential(nn.ReLU()), x.detach(), 2, 2.0, cpu) == [0.0]
    # linear keeps its input (120 bytes), its weight is counted as a parameter: 55 floats * 2
    assert _balance._profile_sizes(nn.Sequential(nn.Linear(10, 5)), x, 2, 2.0, cpu) == [120.0 + 220 * 2]


# -- the sandbox -------------------------------------------------------------------------------

def test_balancing_leaves_the_model_and_rng_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2))
    model[1].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()

    balance_by_time(2, model, x, timeout=0.0)
    balance_by_size(2, model, x, chunks=2)

    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BN running stats
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


# -- errors ------------------------------------------------------------------------------------

def test_balance_by_time_refuses_parameters_with_gradients() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.rand(1, 2)).sum().backward()
    with pytest.raises(ValueError, match=r"some parameter already has gradient: .* module.zero_grad\(set_to_none=True\)"):
        balance_by_time(2, model, torch.rand(1, 2))


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda m: balance_by_time(0, m, torch.rand(1, 2)), ValueError, "partitions must be a positive integer, got 0"),
    (lambda m: balance_by_size(3, m, torch.rand(1, 2)), ValueError,
     "module is shorter than intended partitions (2 < 3)"),
    (lambda m: balance_by_time(1, m[0], torch.rand(1, 2)), TypeError, "module must be an nn.Sequential, got Linear"),
    (lambda m: balance_by_size(1, m, torch.rand(1, 2), param_scale=-1.0), ValueError, "param_scale must be a finite number >= 0"),
    (lambda m: balance_by_size(1, m, [torch.rand(1, 2)]), TypeError, "expected Tensor, but got [tensor([["),
])
def test_balance_errors(call: object, error: type[Exception], message: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(error) as info:
        call(model)  # type: ignore[operator]
    assert message in str(info.value)
