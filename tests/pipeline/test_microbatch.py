"""Micro-batches: scatter along the batch dim with Tensor.chunk sizes, gather back, check inputs."""

from __future__ import annotations

import doctest

import pytest
import torch

from shardwise.pipeline import Batch, check, gather, scatter
from shardwise.pipeline import _microbatch


def test_microbatch_doctests_pass() -> None:
    result = doctest.testmod(_microbatch)
    assert result.attempted > 0 and result.failed == 0


def test_scatter_tensor_even() -> None:
    x = torch.arange(8).reshape(4, 2)
    batches = scatter(x, 2)
    assert [b.atomic for b in batches] == [True, True]
    assert [b.tensor.tolist() for b in batches] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


@pytest.mark.parametrize(("rows", "chunks", "sizes"), [
    (7, 4, [2, 2, 2, 1]),   # uneven: the last micro-batch is smaller
    (2, 4, [1, 1]),         # batch < chunks: fewer micro-batches, as torchgpipe
    (6, 4, [2, 2, 2]),      # Tensor.chunk: ceil(6/4) = 2 rows each, so only 3 micro-batches
    (5, 1, [5]),
])
def test_scatter_sizes_follow_tensor_chunk(rows: int, chunks: int, sizes: list[int]) -> None:
    x = torch.arange(rows * 3).reshape(rows, 3)
    batches = scatter(x, chunks)
    assert [b.tensor.shape[0] for b in batches] == sizes
    assert torch.equal(torch.cat([b.tensor for b in batches]), x)


def test_scatter_tuple_splits_every_tensor_together() -> None:
    x, y = torch.arange(5), torch.arange(10).reshape(5, 2)
    batches = scatter((x, y), 2)
    assert [b.atomic for b in batches] == [False, False]
    assert [b[0].tolist() for b in batches] == [[0, 1, 2], [3, 4]]
    assert [b[1].tolist() for b in batches] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]


def test_scatter_passes_non_tensor_values_to_every_microbatch() -> None:
    options = {"causal": True}
    batches = scatter((torch.arange(6), 3, None, options, "mode"), 3)
    assert len(batches) == 3
    for k, b in enumerate(batches):
        assert b[0].tolist() == [2 * k, 2 * k + 1]
        assert b[1] == 3 and b[2] is None and b[3] is options and b[4] == "mode"


def test_gather_round_trip_tensor_and_tuple() -> None:
    x = torch.randn(7, 3)
    assert torch.equal(gather(scatter(x, 3)), x)
    options = object()
    value = (torch.randn(7), options, torch.randn(7, 2, 2), 5)
    joined = gather(scatter(value, 4))
    assert isinstance(joined, tuple) and len(joined) == 4
    assert torch.equal(joined[0], value[0]) and torch.equal(joined[2], value[2])
    assert joined[1] is options and joined[3] == 5


def test_gather_returns_a_list_for_values_that_differ_per_microbatch() -> None:
    outputs = [Batch((torch.ones(1), k)) for k in range(3)]
    joined = gather(outputs)
    assert isinstance(joined, tuple)
    assert joined[1] == [0, 1, 2]


def test_scatter_and_gather_carry_gradients() -> None:
    x = torch.randn(5, 2, requires_grad=True)
    y = gather([b.call(lambda t: t * 3) for b in scatter(x, 2)])
    assert isinstance(y, torch.Tensor)
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((5, 2), 3.0))


@pytest.mark.parametrize(("bad", "message"), [
    ([torch.zeros(2)], "expected Tensor, but got [tensor([0., 0.])] (list)"),
    (3, "expected Tensor, but got 3 (int)"),
    (None, "expected Tensor, but got None (NoneType)"),
    ((1, "a"), "expected Tensor, but got (1, 'a') (tuple): at least one value must be a Tensor"),
    ((torch.zeros(2), (torch.zeros(2),)), "input[1] is a tuple holding tensors"),
    ((torch.zeros(2), [torch.zeros(2)]), "input[1] is a list holding tensors"),
])
def test_check_rejects_inputs_it_cannot_split(bad: object, message: str) -> None:
    with pytest.raises(TypeError) as info:
        check(bad)
    assert message in str(info.value)


def test_check_accepts_tensor_and_tuples_with_plain_values() -> None:
    check(torch.zeros(2))
    check((torch.zeros(2),))
    check((torch.zeros(2), None, 3, "x", (1, 2)))


def test_check_collects_every_problem_once() -> None:
    with pytest.raises(TypeError) as info:
        check(([torch.zeros(1)], {"k": torch.zeros(1)}))
    text = str(info.value)
    assert "3 problems" in text
    assert "input[0] is a list" in text and "input[1] is a dict" in text and "at least one value must be a Tensor" in text


def test_scatter_rejects_bad_chunks_and_batch_dims() -> None:
    with pytest.raises(ValueError, match=r"number of chunks must be positive integer, got 0"):
        scatter(torch.zeros(4), 0)
    with pytest.raises(ValueError) as info:
        scatter((torch.zeros(4), torch.tensor(1.0), torch.zeros(3)), 2)
    text = str(info.value)
    assert "input[1] is a 0-d tensor" in text
    assert "same batch size (tensor dim 0), got input[0]: 4, input[2]: 3" in text


def test_batch_access_and_edits() -> None:
    t = torch.zeros(2)
    atomic = Batch(t)
    assert atomic.atomic and atomic.tensor is t and atomic.values == (t,) and len(atomic) == 1
    assert atomic[0] is t and atomic.find_tensor_idx() == 0 and atomic.get_device() == torch.device("cpu")
    with pytest.raises(IndexError, match="atomic batch has index 0 only, got 1"):
        atomic[1]
    u = torch.ones(2)
    atomic[0] = u
    assert atomic.tensor is u
    atomic[:] = (t,)
    assert atomic.tensor is t
    with pytest.raises(IndexError, match="replaced by one tensor"):
        atomic[:] = (t, t)

    pair = Batch((None, t))
    assert not pair.atomic and pair.tensors == (t,) and pair.find_tensor_idx() == 1
    with pytest.raises(AttributeError, match="tuple batch has no .tensor"):
        pair.tensor
    pair[1] = u
    assert pair.values == (None, u)
    pair[:] = (u, 1, 2)
    assert pair.values == (u, 1, 2) and list(pair) == [u, 1, 2]
    with pytest.raises(NotImplementedError, match=r"only batch\[:\]"):
        pair[1:] = (3,)
    assert pair.call(lambda v: v[0] * 2).atomic

    with pytest.raises(TypeError, match="batch holds no tensor: \\(int\\)"):
        Batch((1,)).find_tensor_idx()


def test_gather_rejects_mixed_structures() -> None:
    with pytest.raises(ValueError, match="at least one micro-batch"):
        gather([])
    with pytest.raises(ValueError, match="different structures"):
        gather([Batch(torch.zeros(1)), Batch((torch.zeros(1), 1))])
    with pytest.raises(ValueError, match="value 1 is a tensor in some micro-batches only"):
        gather([Batch((torch.zeros(1), 1)), Batch((torch.zeros(1), torch.zeros(1)))])
