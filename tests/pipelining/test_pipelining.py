"""`shardwise.pipelining` against `torch.distributed.pipelining`: the same program, side by side.

Each test runs one program (`_program.py`) on real processes (gloo), first with its imports
from torch.distributed.pipelining, then from shardwise.pipelining, on the same seeds, and
compares what each rank got: the `losses` list, the last stage's output and the gradient of
every parameter, in float64 within 1e-10. Every schedule torch has runs on CPU/gloo, so each
is compared with torch itself: the single-stage ones with one stage per rank, the multi-stage
ones with two stages per rank (interleaved placement, or a V for ZBV and DualPipeV), one of
them on 4 processes, and two pipelines side by side over groups of their own. Also: an
uneven batch (10 rows in 4 micro-batches: tensor_split's 3, 3, 2, 2; against the one-process
step, since torch's schedules refuse it), `eval()`, keyword arguments cut per micro-batch and passed to every stage,
`pipeline(...)` cut by `split_spec` and by `pipe_split()`, and the errors for a wrong number
of stages, a V with three stages per rank, too few micro-batches and a bad split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise.pipelining as swp
from shardwise.pipeline import PipelineError
from shardwise.testing import distributed

from ._program import (CASES, Chain, batch, layers, pipelines_side_by_side, reference, run, side_by_side,
                       split_side_by_side)

TOL = 1e-10


def assert_same(theirs: dict[str, Any], ours: dict[str, Any]) -> None:
    assert len(ours["losses"]) == len(theirs["losses"])
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=TOL, rel=0)
    assert (ours["output"] is None) == (theirs["output"] is None)
    if theirs["output"] is not None:
        torch.testing.assert_close(ours["output"], theirs["output"], atol=TOL, rtol=0)
    assert sorted(ours["grads"]) == sorted(theirs["grads"])
    for name, grad in theirs["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, atol=TOL, rtol=0, msg=lambda m: f"{name}: {m}")




@pytest.mark.parametrize("schedule, num_stages, n_microbatches", CASES)
@distributed(world_size=2)
def test_a_step_equals_torchs(schedule: str, num_stages: int, n_microbatches: int) -> None:
    theirs, ours = side_by_side(schedule, num_stages, n_microbatches)
    assert_same(theirs, ours)
    holds_last = dist.get_rank() == (0 if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else 1)
    assert len(ours["losses"]) == (n_microbatches if holds_last else 0)
    assert (ours["output"] is not None) == holds_last


# (point-to-point messages differ in number from rank to rank on 4 ranks: the harness says so, for torch's on
# the world group and for ours on the pipe's group, and starts a new pool)
@pytest.mark.filterwarnings("ignore:.*issued different numbers of collectives")
@distributed(world_size=4)
def test_interleaved_1f1b_on_4_ranks_equals_torchs() -> None:
    assert_same(*side_by_side("ScheduleInterleaved1F1B", 8, 8))


@pytest.mark.filterwarnings("ignore:.*issued different numbers of collectives")
@distributed(world_size=4)
def test_two_pipelines_side_by_side_each_over_its_group_equal_torchs() -> None:
    # stages built with group= one of two pipelines' groups, {0, 1} and {2, 3} (as beside data parallelism)
    assert_same(*pipelines_side_by_side("ScheduleZBVZeroBubble", 4, 4))


@pytest.mark.parametrize("schedule, num_stages", [("ScheduleGPipe", 2), ("ScheduleZBVZeroBubble", 4)])
@distributed(world_size=2)
def test_uneven_micro_batches_are_cut_and_scaled_as_torch_means_them(schedule: str, num_stages: int) -> None:
    # 10 rows in 4 micro-batches: 3, 3, 2, 2 (tensor_split's, not chunk's 3, 3, 3, 1), gradients of the mean of
    # the 4 losses. torch's own schedules refuse this on CPU/gloo ("The size of tensor a (3) must match the size
    # of tensor b (2)": each stage's shapes are taken from the first micro-batch), so the reference here is the
    # one-process step
    ours = run("shardwise", schedule, num_stages, 4, rows=10)
    whole = reference(num_stages, 4, rows=10)
    holds_last = dist.get_rank() == (0 if schedule == "ScheduleZBVZeroBubble" else 1)
    expected = {"losses": whole["losses"] if holds_last else [], "output": whole["output"] if holds_last else None,
                "grads": {name: g for name, g in whole["grads"].items() if name in ours["grads"]}}
    assert len(ours["grads"]) == len(whole["grads"]) // 2  # this rank's half of the stages
    assert_same(expected, ours)


@pytest.mark.parametrize("schedule, num_stages", [("Schedule1F1B", 2), ("ScheduleInterleaved1F1B", 4)])
@distributed(world_size=2)
def test_eval_is_a_forward_only_step_as_torchs(schedule: str, num_stages: int) -> None:
    theirs, ours = side_by_side(schedule, num_stages, 4, mode="eval")
    assert not ours["grads"]
    assert_same(theirs, ours)


@distributed(world_size=2)
def test_keyword_arguments_are_cut_and_reach_every_stage_as_torchs() -> None:
    assert_same(*side_by_side("ScheduleInterleaved1F1B", 4, 4, mode="kwargs"))


@pytest.mark.parametrize("marks", [False, True], ids=["split_spec", "pipe_split"])
@distributed(world_size=2)
def test_pipeline_split_equals_torchs(marks: bool) -> None:
    theirs, ours = split_side_by_side(marks)
    assert ours["num_stages"] == theirs["num_stages"] == 2
    assert_same(theirs, ours)


# -- bad input ----------------------------------------------------------------------------

def _stages(indices: list[int], num_stages: int) -> list[swp.PipelineStage]:
    blocks = layers(num_stages)
    return [swp.PipelineStage(blocks[j], j, num_stages, torch.device("cpu")) for j in indices]


@distributed(world_size=2)
def test_wrong_stages_and_too_few_micro_batches_name_the_value_and_the_fix() -> None:
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"ScheduleGPipe runs one stage per rank, but num_stages=4 on a group of 2 "
                                         r"ranks: use 2 stages, or a multi-stage schedule"):
        swp.ScheduleGPipe(_stages([rank], 4)[0], 4)
    with pytest.raises(ValueError, match=r"ScheduleZBVZeroBubble holds exactly 2 stages per rank in a V, got 3 stages "
                                         r"here and num_stages=6 on 2 ranks: use num_stages=4"):
        swp.ScheduleZBVZeroBubble(_stages([rank, rank + 2, rank + 4], 6), 4)
    with pytest.raises(ValueError, match=r"ScheduleInterleaved1F1B puts stages \[%d, %d\] of 4 on rank %d of 2, but "
                                         r"this rank built stages \[%d, %d\]" % (rank, rank + 2, rank, 2 * rank, 2 * rank + 1)):
        swp.ScheduleInterleaved1F1B(_stages([2 * rank, 2 * rank + 1], 4), 4)
    with pytest.raises(ValueError, match=r"Schedule1F1B\(n_microbatches=1\) with 2 stages: .*use n_microbatches >= 2"):
        swp.Schedule1F1B(_stages([rank], 2)[0], 1, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"ScheduleDualPipeV\(n_microbatches=3\) with 4 stages: .*n_microbatches >= 4"):
        swp.ScheduleDualPipeV(_stages([rank, 3 - rank], 4), 3)
    with pytest.raises(ValueError, match=r"ScheduleInterleaved1F1B\(n_microbatches=3\) on 2 ranks: .*multiple of 2 "
                                         r"\(e.g. 4\)"):
        swp.ScheduleInterleaved1F1B(_stages([rank, rank + 2], 4), 3)
    with pytest.raises(TypeError, match=r"ScheduleGPipe runs one PipelineStage per rank, got a list"):
        swp.ScheduleGPipe(_stages([rank], 2), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stage_index=2, num_stages=2"):
        swp.PipelineStage(nn.Linear(2, 2), 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"dw_builder=\.\.\.\) is not supported"):
        swp.PipelineStage(nn.Linear(2, 2), rank, 2, "cpu", dw_builder=lambda: lambda: None)


@pytest.mark.filterwarnings("ignore:.*issued different numbers of collectives")  # (a failed step)
@distributed(world_size=2)
def test_a_batch_too_small_for_the_micro_batches_stops_every_rank() -> None:
    # the first stage's rank cannot cut 2 rows 4 ways; the last one, waiting for its input, is told
    rank = dist.get_rank()
    sched = swp.ScheduleGPipe(_stages([rank], 2)[0], 4, loss_fn=nn.functional.mse_loss)
    x, y = batch(rows=2)
    if rank == 0:
        with pytest.raises(ValueError, match=r"has 2 rows along dim 0 .* fewer than the n_microbatches=4"):
            sched.step(x)
    else:
        with pytest.raises(PipelineError, match=r"stage 0 on rank 0 raised ValueError"):
            sched.step(target=y)


def test_pipeline_refuses_what_it_cannot_cut_and_says_why() -> None:
    x = torch.zeros(2, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"split_spec names 'layers\.2\.0', which is not one of the module's blocks "
                                         r"\['embed', 'layers\.0', 'layers\.1', 'layers\.2', 'layers\.3', 'head'\]"):
        swp.pipeline(Chain(), (x,), split_spec={"layers.2.0": swp.SplitPoint.BEGINNING})

    class Between(Chain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x) * 2
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with pytest.raises(ValueError, match=r"block 'layers\.0' was not called on exactly the output of 'embed'"):
        swp.pipeline(Between(), (x,), split_spec={"layers.2": swp.SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match=r"split_policy=\.\.\.\) is not supported"):
        swp.pipeline(Chain(), (x,), split_policy=lambda gm: gm)


def test_pipeline_cuts_at_split_points_and_keeps_the_names() -> None:
    model = Chain()
    pipe = swp.pipeline(model, (torch.zeros(2, 6, dtype=torch.float64),),
                        split_spec={"layers.1": swp.SplitPoint.END, "layers.3": swp.SplitPoint.BEGINNING})
    assert pipe.num_stages == 3
    names = [[n for n, _ in pipe.get_stage_module(i).named_parameters()] for i in range(3)]
    assert names == [["embed.weight", "embed.bias", "layers.0.0.weight", "layers.0.0.bias", "layers.1.0.weight",
                      "layers.1.0.bias"], ["layers.2.0.weight", "layers.2.0.bias"],
                     ["layers.3.0.weight", "layers.3.0.bias", "head.weight", "head.bias"]]
    assert pipe.get_stage_module(1).get_parameter("layers.2.0.weight") is model.layers[2][0].weight  # shared
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), model(x), atol=0, rtol=0)


def test_signatures_are_torchs() -> None:
    import inspect

    import torch.distributed.pipelining as theirs

    for name in swp.__all__:
        if name in ("Pipe", "SplitPoint"):
            continue
        ours, torchs = getattr(swp, name), getattr(theirs, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(torchs).parameters), name
        for method in ("step", "eval"):
            if hasattr(torchs, method):
                assert list(inspect.signature(getattr(ours, method)).parameters) == \
                    list(inspect.signature(getattr(torchs, method)).parameters), f"{name}.{method}"
    assert [p.name for p in swp.SplitPoint] == [p.name for p in theirs.SplitPoint]
