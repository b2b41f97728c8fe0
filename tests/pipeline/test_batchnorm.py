"""DeferredBatchNorm: running statistics of the whole mini-batch, under Pipe and on its own."""

from __future__ import annotations

import copy
import doctest
from typing import Optional

import pytest
import torch
from torch import nn

from shardwise.pipeline import DeferredBatchNorm, Pipe
from shardwise.pipeline import _batchnorm

MODES = ["always", "except_last", "never"]


def test_module_doctest_passes() -> None:
    result = doctest.testmod(_batchnorm)
    assert result.attempted > 0 and result.failed == 0


def _models(momentum: Optional[float]) -> tuple[nn.Sequential, nn.Sequential]:
    """A model whose batch norm sees the same input whether or not the batch is split."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Conv2d(4, 2, 1))
    return model, copy.deepcopy(model)


def _bn_state(model: nn.Module) -> list[torch.Tensor]:
    return [t for name, t in model.state_dict().items() if "running" in name or "num_batches" in name]


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum=0.1", "momentum=None"])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_running_stats_equal_batch_norm_over_the_full_batch(chunks: int, checkpoint: str,
                                                             momentum: Optional[float]) -> None:
    model, reference = _models(momentum)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint,
                deferred_batch_norm=True)
    assert isinstance(pipe[1], DeferredBatchNorm)
    for step in range(3):
        x = torch.randn(7, 3, 4, 4) * (step + 1) + step  # 7 rows: uneven micro-batches
        pipe(x).sum().backward()
        reference(x).sum().backward()
        for got, want in zip(_bn_state(pipe), _bn_state(reference), strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert int(pipe[1].num_batches_tracked) == 3


@pytest.mark.parametrize("checkpoint", MODES)
def test_each_batch_norm_gets_the_statistics_of_every_input_it_saw(checkpoint: str) -> None:
    """A batch norm after another one sees micro-batch-normalised activations; its running
    statistics are those of plain batch norm over all of them at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))
    fresh = [copy.deepcopy(model[1]), copy.deepcopy(model[4])]
    pipe = Pipe(model, [2, 3], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint, deferred_batch_norm=True)
    seen: dict[int, list[torch.Tensor]] = {1: [], 4: []}
    for k in seen:
        pipe[k].register_forward_pre_hook(lambda m, args, k=k: seen[k].append(args[0].detach().clone()))
    pipe(torch.randn(7, 3, 4, 4)).sum().backward()
    for bn, k in zip(fresh, seen, strict=True):
        inputs = seen[k][:3]  # the forward runs; recomputations (with checkpointing) come after
        bn(torch.cat(inputs))
        torch.testing.assert_close(pipe[k].running_mean, bn.running_mean, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pipe[k].running_var, bn.running_var, atol=1e-6, rtol=1e-6)
        assert int(pipe[k].num_batches_tracked) == 1


@pytest.mark.parametrize("checkpoint", MODES)
def test_gradients_with_one_chunk_equal_batch_norm(checkpoint: str) -> None:
    model, reference = _models(0.1)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=1, checkpoint=checkpoint, deferred_batch_norm=True)
    x = torch.randn(6, 3, 4, 4)
    torch.testing.assert_close(pipe(x), reference(x), atol=1e-6, rtol=1e-6)
    pipe(x).square().sum().backward()
    reference(x).square().sum().backward()
    for got, want in zip(pipe.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpoint", MODES)
def test_gradients_with_several_chunks_are_those_of_per_micro_batch_normalisation(checkpoint: str) -> None:
    """Each micro-batch is normalised by its own statistics (as batch norm in training does):
    the reference is the plain model run on each micro-batch."""
    model, reference = _models(0.1)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint, deferred_batch_norm=True)
    x = torch.randn(7, 3, 4, 4)
    out = pipe(x)
    ref_out = torch.cat([reference(piece) for piece in x.chunk(3)])
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    for got, want in zip(pipe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_eval_uses_the_committed_running_stats() -> None:
    model, reference = _models(0.1)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    x = torch.randn(8, 3, 4, 4)
    pipe(x)
    reference(x)
    pipe.eval()
    reference.eval()
    y = torch.randn(5, 3, 4, 4)
    torch.testing.assert_close(pipe(y), reference(y), atol=1e-6, rtol=1e-6)


def test_a_batch_smaller_than_chunks_still_commits_once() -> None:
    model, reference = _models(0.1)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    x = torch.randn(2, 3, 4, 4)  # 2 micro-batches, not 4
    pipe(x)
    reference(x)
    for got, want in zip(_bn_state(pipe), _bn_state(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_on_its_own_it_commits_after_chunks_micro_batches() -> None:
    bn, deferred = nn.BatchNorm1d(3), DeferredBatchNorm(3, chunks=3)
    x = torch.randn(9, 3)
    for k, piece in enumerate(x.chunk(3)):
        deferred(piece)
        assert int(deferred.num_batches_tracked) == (k == 2)
    assert torch.equal(deferred.running_mean, torch.zeros(3)) is False
    bn(x)
    torch.testing.assert_close(deferred.running_mean, bn.running_mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(deferred.running_var, bn.running_var, atol=1e-6, rtol=1e-6)


def test_conversion_keeps_parameters_statistics_and_state_dict_keys() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3, affine=False)))
    model[1][0].running_mean.fill_(0.5)
    weight = model[1][0].weight
    keys = list(model.state_dict())
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    inner = converted[1][0]
    assert isinstance(inner, DeferredBatchNorm) and inner.chunks == 2 and inner.weight is weight
    assert torch.equal(inner.running_mean, torch.full((3,), 0.5))
    assert isinstance(converted[1][1], DeferredBatchNorm) and converted[1][1].weight is None
    assert list(converted.state_dict()) == keys  # the accumulators are not persistent


def test_conversion_is_idempotent_and_leaves_stat_free_batch_norms_alone() -> None:
    bn = DeferredBatchNorm(3, chunks=2)
    assert DeferredBatchNorm.convert_deferred_batch_norm(bn, chunks=2) is bn
    free = nn.BatchNorm2d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert_deferred_batch_norm(free, chunks=2) is free


def test_invalid_arguments_are_reported() -> None:
    with pytest.raises(ValueError, match="DeferredBatchNorm needs chunks >= 1 \\(micro-batches per mini-batch\\), "
                                         "got 0"):
        DeferredBatchNorm(3, chunks=0)
    with pytest.raises(ValueError, match="DeferredBatchNorm expects input of shape \\(N, C, ...\\), got 1-D input "
                                         "of shape \\(3,\\)"):
        DeferredBatchNorm(3)(torch.ones(3))
