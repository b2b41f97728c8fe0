"""loss_parallel(): cross entropy on logits split along the class (vocab) dim, against the
single-device reference (loss and gradient), with what crosses the ranks pinned.

Few multi-rank tests, many checks each (the machine is small): every reduction, class
weights and ignore_index over even, uneven and emptier-than-ranks vocabularies on (4,)
and (2, 2); log_softmax + nll_loss, 3-D logits and label smoothing; the bytes moved; and
the mode's edges (outside the block, nesting, the plan cache, bad targets).
"""

from __future__ import annotations

import doctest
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise._ops import _loss_parallel, active_modes, strategy_calls
from shardwise.parallel import loss_parallel
from shardwise.testing import distributed

from ..dist_helpers import seeded

R = Replicate()
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _labels(shape: Sequence[int], n_classes: int, ignore_index: int, seed: int) -> torch.Tensor:
    target = torch.randint(0, n_classes, tuple(shape), generator=torch.Generator().manual_seed(seed))
    target.view(-1)[1] = ignore_index  # one ignored sample
    return target


def _check(what: str, loss: DTensor, want: torch.Tensor, logits: DTensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(loss.full_tensor(), want.detach(), **TOL, msg=what)
    assert isinstance(logits.grad, DTensor) and ref.grad is not None, what
    torch.testing.assert_close(logits.grad.full_tensor(), ref.grad, **TOL, msg=f"{what}: grad")
    assert logits.grad.placements == logits.placements, f"{what}: grad {logits.grad.placements}"


def _moved(log: Sequence[sw.CommRecord]) -> tuple[set[str], int]:
    return {c.op for c in log}, sum(c.bytes_received for c in log)


# The (2, 2) layouts: samples on mesh dim 0, classes on mesh dim 1.
MESHES = {
    (4,): {"logits": [Shard(1)], "target": [[R]], "weight": [[Shard(0)], [R]]},
    (2, 2): {"logits": [Shard(0), Shard(1)], "target": [[R, R], [Shard(0), R]], "weight": [[R, Shard(0)], [R, R]]},
}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_cross_entropy_on_vocab_split_logits_matches_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    layouts = MESHES[mesh_shape]
    n = 6
    # even, uneven (10 over 4: 3, 3, 3, 1), fewer classes than ranks (3 over 4: one empty piece)
    for n_classes in (12, 10, 3):
        logits_full = seeded(n, n_classes, seed=n_classes)
        class_weight = torch.rand(n_classes, generator=torch.Generator().manual_seed(1)) + 0.5
        for ignore_index in (-100, 1):
            target_full = _labels((n,), n_classes, ignore_index, seed=2)
            for reduction in ("mean", "sum", "none"):
                for k, weight_layout in enumerate([None] + layouts["weight"]):
                    target_layout = layouts["target"][k % len(layouts["target"])]
                    weight = None if weight_layout is None else class_weight
                    what = (f"C={n_classes} ignore={ignore_index} {reduction} weight={weight_layout} "
                            f"target={target_layout}")
                    ref = logits_full.clone().requires_grad_(True)
                    want = F.cross_entropy(ref, target_full, weight=weight, reduction=reduction,
                                           ignore_index=ignore_index)
                    coef = torch.arange(1.0, n + 1)  # weighs each sample's loss differently
                    (want * coef if reduction == "none" else want * 1.5).sum().backward()

                    logits = sw.distribute_tensor(logits_full.clone().requires_grad_(True), mesh, layouts["logits"])
                    target = sw.distribute_tensor(target_full, mesh, target_layout)
                    w = None if weight_layout is None else sw.distribute_tensor(class_weight, mesh, weight_layout)
                    scale = sw.distribute_tensor(coef, mesh, [R] * mesh.ndim)
                    with loss_parallel(), sw.comm_log() as log:
                        loss = F.cross_entropy(logits, target, weight=w, reduction=reduction,
                                               ignore_index=ignore_index)
                        (loss * scale if reduction == "none" else loss * 1.5).sum().backward()
                    _check(what, loss, want, logits, ref)
                    # the per-sample terms are partial sums over the vocab ranks
                    assert loss.placements[-1] == Partial("sum"), f"{what}: {loss.placements}"
                    # no gathered logits: all_reduces of at most a number per row (the row max, sum
                    # of exp and gradient sum; the total weight, over each mesh dim), whatever the vocabulary
                    assert len(log) <= 3 + mesh.ndim, f"{what}: {log}"
                    assert all(c.op == "all_reduce" and c.bytes_received <= 2 * n * 4 for c in log), f"{what}: {log}"


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_log_softmax_nll_loss_3d_logits_and_label_smoothing_match_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    batch, seq, vocab = 2, 3, 10
    three_d: list[Placement] = [Shard(0), Shard(2)] if mesh.ndim == 2 else [Shard(2)]
    class_1: list[Placement] = [Shard(0), Shard(1)] if mesh.ndim == 2 else [Shard(1)]
    two_d = MESHES[mesh_shape]["logits"]
    weight_full = torch.rand(vocab, generator=torch.Generator().manual_seed(3)) + 0.5
    weight_layout = MESHES[mesh_shape]["weight"][0]
    # name -> (logits shape, logits layout, target shape, loss fn, backward may re-lay the gradient)
    cases: dict[str, tuple[tuple[int, ...], list[Placement], tuple[int, ...], Callable[..., Any], bool]] = {
        "nll_loss(log_softmax(x, -1))": ((6, vocab), two_d, (6,),
                                         lambda x, t, w: F.nll_loss(F.log_softmax(x, -1), t), False),
        "nll_loss(x.log_softmax(1), weight)": ((6, vocab), two_d, (6,),
                                               lambda x, t, w: F.nll_loss(x.log_softmax(1), t, weight=w), False),
        "3-D flattened": ((batch, seq, vocab), three_d, (batch, seq),
                          lambda x, t, w: F.cross_entropy(x.flatten(0, 1), t.flatten(0, 1)), False),
        "3-D log_softmax(x, -1) flattened": ((batch, seq, vocab), three_d, (batch, seq),
                                             lambda x, t, w: F.nll_loss(F.log_softmax(x, -1).flatten(0, 1),
                                                                        t.flatten(0, 1), weight=w), False),
        # (batch, vocab, seq): cross_entropy's class dim 1, run as nll_loss2d
        "3-D class dim 1": ((batch, vocab, seq), class_1, (batch, seq),
                            lambda x, t, w: F.cross_entropy(x, t, weight=w), False),
        "3-D class dim 1, none": ((batch, vocab, seq), class_1, (batch, seq),
                                  lambda x, t, w: F.cross_entropy(x, t, reduction="none").sum(), False),
        # label smoothing adds -sum(log p) over the classes: a P(sum) per row, through ordinary ops
        "label smoothing": ((6, vocab), two_d, (6,),
                            lambda x, t, w: F.cross_entropy(x, t, label_smoothing=0.2), True),
        "label smoothing, weight": ((6, vocab), two_d, (6,),
                                    lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.1), True),
    }
    for what, (shape, layout, t_shape, fn, relayout) in cases.items():
        logits_full = seeded(*shape, seed=4)
        target_full = _labels(t_shape, vocab, -100, seed=5)
        ref = logits_full.clone().requires_grad_(True)
        want = fn(ref, target_full, weight_full)
        want.backward()
        logits = sw.distribute_tensor(logits_full.clone().requires_grad_(True), mesh, layout)
        target = sw.distribute_tensor(target_full, mesh, [R] * mesh.ndim)
        w = sw.distribute_tensor(weight_full, mesh, weight_layout)
        with loss_parallel():
            with sw.comm_log() as forward:
                loss = fn(logits, target, w)
            with sw.comm_log() as backward:
                loss.backward()
        what = f"{what} on {layout}"
        _check(what, loss, want, logits, ref)
        small = logits_full.numel() * 4 // 4  # a quarter of the logits' bytes
        # forward: row statistics, scalars and (label smoothing with weights) the C class weights
        assert all(c.bytes_received < small for c in forward), f"{what}: {forward}"
        # backward: the row sums of the gradient; label smoothing's gradient takes another
        # layout on the way (the propagator's choice for its masked_fill), never a gather
        if relayout:
            assert all(c.op != "all_gather" or c.bytes_received < small for c in backward), f"{what}: {backward}"
        else:
            assert all(c.op == "all_reduce" and c.bytes_received < small for c in backward), f"{what}: {backward}"


@distributed(world_size=4)
def test_no_collective_moves_the_logits_inside_the_block_and_outside_they_are_gathered() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    n, vocab = 8, 256
    logits_full = seeded(n, vocab, seed=6)
    target = sw.distribute_tensor(_labels((n,), vocab, -100, seed=7), mesh, [R])
    logits_bytes = n * vocab * 4

    def run(inside: bool) -> tuple[set[str], int, DTensor]:
        logits = sw.distribute_tensor(logits_full.clone().requires_grad_(True), mesh, [Shard(1)])
        with sw.comm_log() as log:
            if inside:
                with loss_parallel():
                    loss = F.cross_entropy(logits, target)
                    loss.backward()
            else:
                loss = F.cross_entropy(logits, target)
                loss.backward()
        ops, moved = _moved(log)
        return ops, moved, loss

    ops, moved, loss = run(inside=True)
    # forward: the row max and row sum of exp (n floats each); backward: the row sum of the
    # gradient; all O(n), never O(n * vocab)
    assert ops == {"all_reduce"}, ops
    assert moved <= 3 * 2 * n * 4, moved
    # the same call without the block gathers (or re-splits) the logits: the measurement can tell
    ops, moved_outside, _ = run(inside=False)
    assert moved_outside >= logits_bytes * 3 // 4 // 4, (ops, moved_outside)  # 3/4 of a piece at least
    assert moved * 8 < moved_outside


@distributed(world_size=4)
def test_outside_the_block_the_same_call_plans_as_before_and_stays_right() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    logits_full = seeded(8, 10, seed=8)
    target_full = _labels((8,), 10, -100, seed=9)
    want = F.cross_entropy(logits_full, target_full)
    target = sw.distribute_tensor(target_full, mesh, [R])

    def loss_and_layout() -> tuple[torch.Tensor, tuple[Placement, ...]]:
        logits = sw.distribute_tensor(logits_full, mesh, [Shard(1)])
        log_probs = F.log_softmax(logits, 1)
        return F.nll_loss(log_probs, target).full_tensor(), log_probs.placements

    # outside first (plans cached), then inside, then outside again: no plan crosses over
    before, layout_before = loss_and_layout()
    with loss_parallel():
        inside, layout_inside = loss_and_layout()
        with loss_parallel():  # nested: the outer block owns the mode
            nested, _ = loss_and_layout()
        assert _loss_parallel.LOSS_PARALLEL in active_modes()
        again_inside, layout_again = loss_and_layout()
    after, layout_after = loss_and_layout()
    assert _loss_parallel.LOSS_PARALLEL not in active_modes()
    for what, got in [("before", before), ("inside", inside), ("nested", nested), ("again", again_inside),
                      ("after", after)]:
        torch.testing.assert_close(got, want, **TOL, msg=what)
    assert layout_inside == layout_again == (Shard(1),)
    assert layout_before == layout_after and Shard(1) not in layout_before, (layout_before, layout_after)
    # another round plans nothing: the mode is part of the cache keys, nothing was thrown away
    calls = strategy_calls()
    with loss_parallel():
        assert loss_and_layout()[1] == (Shard(1),)
    assert loss_and_layout()[1] == layout_before
    assert strategy_calls() == calls

    # a backward run after the block is still right (its ops plan as usual: they move the classes)
    ref = logits_full.clone().requires_grad_(True)
    F.cross_entropy(ref, target_full, reduction="sum").backward()
    logits = sw.distribute_tensor(logits_full.clone().requires_grad_(True), mesh, [Shard(1)])
    with loss_parallel():
        loss = F.cross_entropy(logits, target, reduction="sum")
    loss.backward()
    assert logits.grad is not None and ref.grad is not None
    torch.testing.assert_close(logits.grad.full_tensor(), ref.grad, **TOL)

    # a target out of range is an error naming it, as on one device
    bad = sw.distribute_tensor(torch.tensor([0, 10, 2, 3, 4, 5, 6, 7]), mesh, [R])
    with loss_parallel(), pytest.raises(ValueError, match=r"targets \[10\] out of range for 10 classes"):
        F.cross_entropy(sw.distribute_tensor(logits_full, mesh, [Shard(1)]), bad)
    assert _loss_parallel.LOSS_PARALLEL not in active_modes()


def test_loss_parallel_planning_doctests_pass() -> None:
    result = doctest.testmod(_loss_parallel)
    assert result.attempted >= 4 and result.failed == 0


def test_the_mode_is_off_by_default_and_restored_after_an_error() -> None:
    assert _loss_parallel.LOSS_PARALLEL not in active_modes()
    with pytest.raises(KeyError):
        with loss_parallel():
            assert _loss_parallel.LOSS_PARALLEL in active_modes()
            raise KeyError("boom")
    assert _loss_parallel.LOSS_PARALLEL not in active_modes()



@distributed(world_size=2)
def test_torch_loss_parallel_by_its_full_path_keeps_shardwise_logits_split() -> None:
    # a ported program that still calls torch's loss_parallel() by its full path (torchtitan does) gets
    # loss parallelism on shardwise DTensors: the forward moves no logits, only the per-row all_reduces
    # (before: a warning, and the logits gathered whole); outside it the same op gathers as before
    import warnings

    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    from shardwise.debug import CommCounter

    mesh = sw.init_device_mesh("cpu", (2,))
    rows, classes = 6, 1001
    full = torch.randn(rows, classes, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    target = torch.arange(rows) * 7 % classes
    ref = full.clone().requires_grad_()
    want = F.cross_entropy(ref, target)
    want.backward()

    logits = sw.distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch_loss_parallel():
            with CommCounter() as forward:
                loss = F.cross_entropy(logits, target)
            loss.backward()
    torch.testing.assert_close(loss.full_tensor(), want, rtol=0, atol=1e-12)
    assert logits.grad is not None and logits.grad.placements == (Shard(1),)
    torch.testing.assert_close(logits.grad.full_tensor(), ref.grad, rtol=0, atol=1e-12)
    kinds = forward.totals()
    moved = sum(nbytes for _, nbytes in kinds.values())
    assert set(kinds) <= {"all_reduce"} and moved < rows * 8 * 8, f"the forward moved {kinds}: logits travelled"
    assert loss.placements[0].is_partial() or loss.placements[0] == Replicate(), loss.placements

    with CommCounter() as outside:  # neither mode on: the logits move (each rank's rows, all their classes)
        F.cross_entropy(sw.distribute_tensor(full, mesh, [Shard(1)]), target)
    assert sum(nbytes for _, nbytes in outside.totals().values()) >= (rows // 2) * (classes // 2) * 8
