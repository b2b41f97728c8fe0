"""torch.distributed.pipelining's schedules, by name and signature, run by shardwise's engine.

Each class takes this rank's stage (single-stage schedules) or stages (multi-stage ones) as
torch's does, checks their placement, and builds the engine's pipe for them (`_engine`),
running the engine's schedule of the same name (`shardwise.pipeline`'s pure-data
schedules). `step(*args, target=None, losses=None, **kwargs)`: the first stage's rank
passes the whole batch (cut into `n_microbatches` with `tensor_split`), the last stage's
rank the target and a list that receives each micro-batch's loss; every rank's keyword
arguments reach its own stages. It returns the last stage's outputs joined on that rank
and `None` elsewhere.

Placement, as torch's: stage `s` on the group's rank `s % size` (one stage per rank for
ScheduleGPipe and Schedule1F1B, several for the looped and interleaved ones), or in a V for
ScheduleZBVZeroBubble and ScheduleDualPipeV (rank `k` holds stages `k` and `2 size - 1 - k`).

Building a schedule is collective over every process, which builds its own at the same point
of the program (it makes the process group of the pipeline's messages, as torch's process
groups are made): the stages' `group` may be every process (`None`) or one of several
pipelines' groups that split them (pipelines beside data parallelism).

Loss scaling, as torch's with `scale_grads=True`: gradients are those of the mean of the
micro-batches' losses (with a mean `loss_fn` and equal micro-batches, the whole batch's mean
loss); with `scale_grads=False`, of their sum. The engine scales each micro-batch's loss
before its backward; torch divides the gradients after the step, gradients already there
from an earlier step included, so under accumulation across steps ours add up as plain
autograd would. `losses` gets the unscaled losses, detached.

Stage modules under `fully_shard` (dp x pp), as torch's: the units sum their gradients over
the step's micro-batches and each reduces once at its end (`_fsdp`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from .. import pipeline as engine
from .._describe import describe
from ._chunks import merge_microbatches, split_tensor
from ._engine import StepState, build_pipe, forward_order, run_step
from ._fsdp import one_reduction_per_step
from ._stage import PipelineStage

__all__ = ["PipelineScheduleMulti", "PipelineScheduleSingle", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble"]


class _PipelineSchedule:
    """The step every schedule shares (see the module docstring)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable[..., Tensor]],
                 scale_grads: bool, **unsupported: Any) -> None:
        name = type(self).__name__
        given = {k: v for k, v in unsupported.items() if v is not None}
        if given:
            raise ValueError(f"{name}({', '.join(f'{k}=...' for k in given)}) is not supported: micro-batches are cut "
                             "along dim 0 of every tensor and outputs joined along dim 0; leave it None")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{name}(n_microbatches={n_microbatches!r}): use a positive int")
        bad = [describe(s) for s in stages if not isinstance(s, PipelineStage)]
        if bad:
            raise TypeError(f"{name} runs shardwise.pipelining.PipelineStage stages, got {bad[0]}")
        self._stages, self._n_microbatches, self._loss_fn = stages, n_microbatches, loss_fn
        self.scale_grads = scale_grads
        self._has_backward = loss_fn is not None
        first = stages[0]
        self._num_stages, self.pp_group_size, self.rank = first.num_stages, first.group_size, first.group_rank
        self._check_stages()
        schedule = self._engine_schedule(first.group_size, first.num_stages, n_microbatches)
        mine = sorted(s.stage_index for s in stages)
        wanted = schedule.rank_stages(first.group_rank)
        if mine != wanted:
            raise ValueError(f"{name} puts stages {wanted} of {first.num_stages} on rank {first.group_rank} of "
                             f"{first.group_size}, but this rank built stages {mine}: build PipelineStage "
                             f"{', '.join(map(str, wanted))} here")
        self._state = StepState(forward_order(schedule, first.group_rank))
        self._target: Any = None
        self._targets: Optional[list[Any]] = None
        self._losses: dict[int, Tensor] = {}
        self._loss_kwargs: dict[str, Any] = {}
        self._pipe = build_pipe(stages, schedule, self._state, self._loss if loss_fn is not None else None)

    def _check_stages(self) -> None:
        name, stages = type(self).__name__, self._stages
        problems = []
        for what in ("num_stages", "group_size", "group_rank", "device"):
            values = {str(getattr(s, what)) for s in stages}
            if len(values) > 1:
                problems.append(f"the stages have different {what} ({', '.join(sorted(values))})")
        if len({s.stage_index for s in stages}) != len(stages):
            problems.append(f"a stage index is given twice ({[s.stage_index for s in stages]})")
        if problems:
            raise ValueError(f"{name}: " + "; ".join(problems) + ": give this rank's stages of one pipeline, once each")

    def _engine_schedule(self, pp: int, num_stages: int, m: int) -> engine.Schedule:
        raise NotImplementedError

    # -- the step -------------------------------------------------------------------------

    def _loss(self, output: Any) -> Tensor:
        """The last stage's loss of the micro-batch it just ran, kept unscaled for `losses`; the
        engine weights it by 1/m (so `scale_grads=False` undoes that)."""
        i = self._state.last
        if self._targets is None:  # cut here, inside the engine's step (see `StepState`)
            whole, m = self._target, self._n_microbatches
            self._targets = split_tensor(whole, m, "target") if isinstance(whole, Tensor) else [whole] * m
        target = self._targets[i]
        loss = self._loss_fn(output, target, **self._loss_kwargs)  # type: ignore[misc]
        if isinstance(loss, Tensor):
            self._losses[i] = loss.detach()
        return loss if self.scale_grads else loss * self._n_microbatches

    def step(self, *args: Any, target: Any = None, losses: Optional[list[Any]] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict[str, Any]] = None, **kwargs: Any) -> Any:
        """One training step (forward only without a `loss_fn`) over the whole batch `args`;
        the joined outputs on the last stage's rank, `None` elsewhere."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step() runs the backward, so gradients must be enabled: call "
                               "it outside torch.no_grad(), or call eval() for a forward only")
        return self._run(args, kwargs, target, losses, return_outputs, loss_kwargs, train=self._has_backward)

    def eval(self, *args: Any, target: Any = None, losses: Optional[list[Any]] = None, **kwargs: Any) -> Any:
        """Forward only, under no_grad: the joined outputs on the last stage's rank (and, with a
        `loss_fn` and `target`, each micro-batch's loss in `losses`)."""
        return self._run(args, kwargs, target, losses, True, None, train=False)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, losses: Optional[list[Any]],
             return_outputs: bool, loss_kwargs: Optional[dict[str, Any]], train: bool) -> Any:
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list (it receives each micro-batch's loss), got {describe(losses)}")
        m = self._n_microbatches
        self._target, self._targets = target, None
        self._losses, self._loss_kwargs = {}, dict(loss_kwargs or {})
        with one_reduction_per_step([s.submod for s in self._stages] if train else []):  # (fully_shard stages)
            run_step(self._pipe, self._state, args, kwargs, train)
        if not self._pipe.layout.holds(self._num_stages - 1):
            return None
        outputs = [self._state.outputs[i] for i in range(m)]
        if not train and self._loss_fn is not None and target is not None:
            with torch.no_grad():
                for i, out in enumerate(outputs):
                    self._state.last = i
                    self._loss(out)
        if losses is not None and self._losses:
            losses.clear()
            losses.extend(self._losses[i] for i in range(m))
        return merge_microbatches(outputs) if return_outputs else None

    def close(self) -> None:
        """Give back the process group of the schedule's messages (collective; not in torch)."""
        self._pipe.close()


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule of one stage per rank: stage `s` on the group's rank `s`."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable[..., Tensor]] = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                 scale_grads: bool = True) -> None:
        if isinstance(stage, (list, tuple)):
            raise TypeError(f"{type(self).__name__} runs one PipelineStage per rank, got a {type(stage).__name__}: "
                            "pass the stage itself, or use ScheduleInterleaved1F1B for several stages per rank")
        self._stage = stage
        super().__init__([stage], n_microbatches, loss_fn, scale_grads, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec, output_merge_spec=output_merge_spec)

    def _check_stages(self) -> None:
        stage, name = self._stages[0], type(self).__name__
        if stage.num_stages != stage.group_size:
            raise ValueError(f"{name} runs one stage per rank, but num_stages={stage.num_stages} on a group of "
                             f"{stage.group_size} ranks: use {stage.group_size} stages, or a multi-stage schedule "
                             f"(ScheduleInterleaved1F1B, ScheduleLoopedBFS, ...) with several stages per rank")


class ScheduleGPipe(PipelineScheduleSingle):
    """Fill-drain: every micro-batch's forward, then every backward."""

    def _engine_schedule(self, pp: int, num_stages: int, m: int) -> engine.Schedule:
        return engine.ScheduleGPipe(num_stages, m)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: after a warm-up, one forward and one backward in turn. Needs at least as many
    micro-batches as stages (as torch's)."""

    def _engine_schedule(self, pp: int, num_stages: int, m: int) -> engine.Schedule:
        if m < num_stages:
            raise ValueError(f"Schedule1F1B(n_microbatches={m}) with {num_stages} stages: 1F1B needs at least as many "
                             f"micro-batches as stages; use n_microbatches >= {num_stages}, or ScheduleGPipe")
        return engine.Schedule1F1B(num_stages, m)


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule of several stages per rank (`stages`: this rank's, in any order)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable[..., Tensor]] = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        if isinstance(stages, PipelineStage) or not isinstance(stages, (list, tuple)) or not stages:
            raise TypeError(f"{type(self).__name__} takes a list of this rank's PipelineStages, got "
                            f"{describe(stages)}: e.g. [stage_a, stage_b]")
        super().__init__(list(stages), n_microbatches, loss_fn, scale_grads, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec, output_merge_spec=output_merge_spec)

    def _check_stages(self) -> None:
        super()._check_stages()
        stage, name = self._stages[0], type(self).__name__
        pp, n = stage.group_size, stage.num_stages
        if n % pp:
            raise ValueError(f"{name}: num_stages={n} on a group of {pp} ranks: every rank holds the same number of "
                             f"stages, so num_stages must be a multiple of {pp} (e.g. {n + pp - n % pp})")


class _Looped(PipelineScheduleMulti):
    def _engine_schedule(self, pp: int, num_stages: int, m: int) -> engine.Schedule:
        return self._looped(pp, num_stages // pp, m)

    def _looped(self, pp: int, v: int, m: int) -> engine.Schedule:
        raise NotImplementedError


class ScheduleLoopedBFS(_Looped):
    """Looped breadth-first: each rank's first stage runs every micro-batch, then its next."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable[..., Tensor]] = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, backward_requires_autograd: bool = True,
                 defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec, scale_grads=scale_grads)

    def _looped(self, pp: int, v: int, m: int) -> engine.Schedule:
        return engine.ScheduleLoopedBFS(pp, v, m)


class ScheduleInterleaved1F1B(_Looped):
    """Interleaved 1F1B (Megatron's): micro-batches go through the ranks in groups of the group
    size, so `n_microbatches` must be a multiple of it (torch's is laxer: see the report)."""

    def _looped(self, pp: int, v: int, m: int) -> engine.Schedule:
        if m % pp:
            raise ValueError(f"ScheduleInterleaved1F1B(n_microbatches={m}) on {pp} ranks: micro-batches go through "
                             f"the ranks in groups of {pp}, so use a multiple of {pp} (e.g. {m + pp - m % pp}), or "
                             "ScheduleInterleavedZeroBubble / ScheduleLoopedBFS, which take any number")
        return engine.ScheduleInterleaved1F1B(pp, v, m)


class ScheduleInterleavedZeroBubble(_Looped):
    """Zero bubble on interleaved placement: backwards split into their inputs' and weights' halves."""

    def _looped(self, pp: int, v: int, m: int) -> engine.Schedule:
        return engine.ScheduleInterleavedZeroBubble(pp, v, m)


class _VShaped(PipelineScheduleMulti):
    """Two stages per rank in a V: rank `k` holds stages `k` and `2 size - 1 - k`."""

    def _check_stages(self) -> None:
        _PipelineSchedule._check_stages(self)
        stage, name = self._stages[0], type(self).__name__
        if len(self._stages) != 2 or stage.num_stages != 2 * stage.group_size:
            raise ValueError(f"{name} holds exactly 2 stages per rank in a V, got {len(self._stages)} stages here and "
                             f"num_stages={stage.num_stages} on {stage.group_size} ranks: use "
                             f"num_stages={2 * stage.group_size}, stages {stage.group_rank} and "
                             f"{2 * stage.group_size - 1 - stage.group_rank} on rank {stage.group_rank}")


class ScheduleZBVZeroBubble(_VShaped):
    """ZB-V: two stages per rank in a V, backwards split into their halves."""

    def _engine_schedule(self, pp: int, num_stages: int, m: int) -> engine.Schedule:
        return engine.ScheduleZBVZeroBubble(pp, m)


class ScheduleDualPipeV(_VShaped):
    """DualPipeV: two stages per rank in a V, forward/backward pairs. Needs at least as many
    micro-batches as stages (as torch's)."""

    def _engine_schedule(self, pp: int, num_stages: int, m: int) -> engine.Schedule:
        if m < num_stages:
            raise ValueError(f"ScheduleDualPipeV(n_microbatches={m}) with {num_stages} stages: DualPipeV fills the V "
                             f"before its steady state; use n_microbatches >= {num_stages}, or ScheduleZBVZeroBubble")
        return engine.ScheduleDualPipeV(pp, m)
