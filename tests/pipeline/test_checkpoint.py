"""Checkpointing (Checkpoint / Recompute with RNG replay) and the phony dependencies it relies on."""

from __future__ import annotations

import doctest
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.pipeline import Pipe
from shardwise.pipeline import _checkpoint, _dependency
from shardwise.pipeline._checkpoint import checkpoint, is_checkpointing, is_recomputing
from shardwise.pipeline._dependency import fork, get_phony, join


@pytest.mark.parametrize("module", [_checkpoint, _dependency], ids=lambda m: m.__name__)
def test_module_doctests_pass(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


class Log(torch.autograd.Function):
    """Identity that logs its forward and backward runs."""

    @staticmethod
    def forward(ctx: Any, timeline: list[str], name: str, x: torch.Tensor) -> torch.Tensor:
        ctx.timeline, ctx.name = timeline, name
        timeline.append(f"{name}:forward")
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.timeline.append(f"{ctx.name}:backward")
        return None, None, grad


def test_serial_checkpoints_recompute_right_before_their_backward() -> None:
    """b depends on a only through a phony edge: b is recomputed and backpropagated first, then a."""
    timeline: list[str] = []
    a = torch.rand(1, requires_grad=True)
    b = torch.rand(1, requires_grad=True)
    a = checkpoint(partial(Log.apply, timeline, "a"), a)
    a, phony = fork(a)
    b = join(b, phony)
    b = checkpoint(partial(Log.apply, timeline, "b"), b)
    torch.cat((a, b)).sum().backward()
    assert timeline == ["a:forward", "b:forward", "b:forward", "b:backward", "a:forward", "a:backward"]


def test_phases_are_flagged_in_forward_and_in_recomputation() -> None:
    phases: list[tuple[bool, bool]] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        phases.append((is_checkpointing(), is_recomputing()))
        return x * 2

    x = torch.ones(2, requires_grad=True)
    checkpoint(probe, x).sum().backward()
    assert phases == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_parameters_get_gradients_when_the_input_needs_none() -> None:
    layer = nn.Linear(2, 2)
    out = checkpoint(layer, torch.ones(1, 2))
    assert out.requires_grad
    out.sum().backward()
    assert layer.weight.grad is not None and torch.equal(layer.weight.grad, torch.ones(2, 2))


def test_recomputation_replays_dropout_and_leaves_the_generator_alone() -> None:
    torch.manual_seed(0)
    x = (torch.rand(1000) + 0.5).requires_grad_()
    out = checkpoint(nn.Dropout(0.5), x)
    state_after_forward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), state_after_forward)  # the replay did not advance the RNG
    assert torch.equal(out != 0, x.grad != 0)  # the recomputed mask is the forward's


def test_dropout_under_checkpointing_grad_mask_equals_output_mask() -> None:
    """Regression (torchgpipe test_bugs): recomputation with a different mask gives wrong gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Dropout(0.2) for _ in range(8)])
    pipe = Pipe(model, [2, 2, 2, 2], devices=["cpu"] * 4, chunks=10, checkpoint="always")
    x = (torch.rand(20, 16) + 0.5).requires_grad_()
    out = pipe(x)
    out.sum().backward()
    assert torch.equal(out != 0, x.grad != 0)
    torch.testing.assert_close(x.grad * x, out, atol=1e-6, rtol=1e-6)


def test_tuple_batches_with_non_tensor_values_are_checkpointed() -> None:
    layer = nn.Linear(2, 2)

    def run(values: tuple[Any, ...]) -> tuple[Any, ...]:
        x, scale, idx = values
        return layer(x) * scale, idx + 1, scale

    x = torch.ones(3, 2, requires_grad=True)
    out = checkpoint(run, (x, 3.0, torch.arange(3)))
    assert out[2] == 3.0 and torch.equal(out[1], torch.arange(1, 4)) and not out[1].requires_grad
    out[0].sum().backward()
    assert torch.allclose(x.grad, 3.0 * layer.weight.sum(0).expand(3, 2))


def test_phony_is_empty_cached_and_detached() -> None:
    cpu = torch.device("cpu")
    p = get_phony(cpu, requires_grad=False)
    assert p.shape == (0,) and p is get_phony(cpu, requires_grad=False) and p.grad_fn is None
    assert get_phony(cpu, requires_grad=True).requires_grad


def test_join_makes_the_phony_producer_part_of_backward() -> None:
    produced: list[str] = []

    class Producer(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return get_phony(x.device, requires_grad=False).detach()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            produced.append("ran")
            return torch.zeros(2)

    source = torch.ones(2, requires_grad=True)
    y = join(torch.ones(2, requires_grad=True) * 2, Producer.apply(source))
    y.sum().backward()
    assert produced == ["ran"]


def test_fork_and_join_without_grad_build_no_nodes() -> None:
    x = torch.ones(2)
    y, phony = fork(x)
    assert y is x and not phony.requires_grad
    assert join(x, phony) is x


@pytest.mark.parametrize("chunks", [2, 3])
def test_pipeline_adds_one_phony_edge_per_micro_batch_pair_and_partition(chunks: int) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1], devices=["cpu"] * 2, chunks=chunks,
                checkpoint="never")
    out = pipe(torch.rand(chunks, 1))
    names = []
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(f for f, _ in node.next_functions)
    assert names.count("ForkBackward") == names.count("JoinBackward") == (chunks - 1) * 2


def test_backward_runs_micro_batches_in_reverse_on_each_partition() -> None:
    order: list[tuple[int, int]] = []

    class Tag(nn.Module):
        def __init__(self, j: int) -> None:
            super().__init__()
            self.j = j

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            i = int(x[0, 0].item())  # row 0 of micro-batch i holds i
            x = x * 1
            x.register_hook(lambda grad: order.append((self.j, i)))
            return x

    pipe = Pipe(nn.Sequential(Tag(0), Tag(1)), [1, 1], devices=["cpu"] * 2, chunks=3, checkpoint="never")
    x = torch.arange(3.0).repeat_interleave(2).unsqueeze(1).requires_grad_()
    pipe(x).sum().backward()
    for j in range(2):
        assert [i for jj, i in order if jj == j] == [2, 1, 0]
