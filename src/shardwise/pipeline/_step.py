"""One training (or forward-only) step of a `DistributedPipe` on one rank: the actions themselves.

`StepRun` holds what a step keeps between actions: this rank's micro-batches (first
stage) and targets (last stage), one skip tracker per micro-batch, the received inputs
and the stage outputs whose backward is still to come. `do(action)` runs one forward or
backward of the schedule, receiving what it needs and posting what it owes through the
context's `Wire`; `_execute` runs the actions in the schedule's order and handles failures.
Under a cp dim, `cp_attention` makes the step's context-parallel attention first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _comm as comm
from .._describe import describe
from .._tensor import DTensor
from ..parallel._context_parallel import current_cp_attention, make_cp_attention
from ..parallel._cp_attention import CpAttention
from ..parallel import no_sync
from ._channels import Channel
from ._context import StepContext
from ._microbatch import Batch, BatchValue, check, scatter
from ._schedule import Action
from ._split_backward import WeightGrad, backward_input
from ._stage import SkipTrackerThroughRanks
from ._timeline import current_timeline

__all__ = ["LossFn", "StepRun", "cp_attention"]

LossFn = Callable[..., Tensor]

_IGNORE = -100  # the label a mean does not count (torch's and transformers' ignore_index)


class StepRun:
    """One step's state on one rank: micro-batches, per-micro-batch trackers, what backward needs.
    `train`: forward and backward (with `loss_fn`), else forward only; `training`: the pipe's
    mode (checkpointing is for training only)."""

    def __init__(self, ctx: StepContext, *, train: bool, training: bool, loss_fn: Optional[LossFn] = None) -> None:
        layout = ctx.layout
        self.ctx, self.layout, self.train, self.loss_fn = ctx, layout, train, loss_fn
        m = layout.schedule.num_microbatches
        self.trackers = [SkipTrackerThroughRanks(layout.skip_routes) for _ in range(m)]
        self.batches: list[Batch] = []
        self.targets: list[Any] = []
        self.weights: list[float] = [1.0 / m] * m
        self.inputs: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self.kept: dict[tuple[int, int], Batch] = {}  # stage outputs (or losses) whose backward is to come
        self.outputs: dict[int, Batch] = {}
        self.sent: set[tuple[int, int]] = set()
        self.loss: Optional[Tensor] = None
        self.cp: Optional[CpAttention] = None
        self.counts: list[int] = []  # under cp: each micro-batch's counted target tokens, whole
        self.current: Optional[Action] = None
        self._began = 0.0  # when the action running began, its inputs received (its timeline span's start)
        self.weight_grads: dict[tuple[int, int], WeightGrad] = {}  # W still to run, after an I
        stop = {"always": m, "except_last": m - 1, "never": 0}[layout.checkpoint]
        self.checkpoint_stop = stop if train and training else 0
        order = layout.schedule.rank_order(layout.pp_rank)
        # where a stage's weights get their gradients: B, or W when the backward is split, or I for a
        # checkpointed micro-batch, whose backward stays whole (the last wins)
        self.last_backward = {a.stage: (a.microbatch, a.stage) for a in order
                              if a.kind == "B" or a.kind == ("I" if self._whole(a.microbatch) else "W")}

    def prepare(self, input: Any, target: Any) -> None:
        layout = self.layout
        m = layout.schedule.num_microbatches
        self.cp = cp = current_cp_attention()  # under cp_dim: this rank runs its piece of every sequence
        if layout.holds(0):
            if input is None:
                raise ValueError(f"rank {layout.rank} holds the first stage, so it needs the input: pass it to "
                                 "step()/the pipe on this rank")
            check(input)
            self.batches = _split(_to(input, layout.device), m, "input")
            if cp is not None:
                self.batches = [Batch(_cut(b.value, cp)) for b in self.batches]
        if self.train and layout.holds(layout.num_stages - 1) and target is not None:
            target = _to(target, layout.device)
            if cp is not None and getattr(self.loss_fn, "shifts_labels", False):
                target = _shift(target)  # next-token labels over the whole sequence, before it is cut
            self.targets = [b.value for b in _split(target, m, "target")]
            rows = [Batch(t).tensors[0].shape[0] for t in self.targets]
            self.weights = [r / sum(rows) for r in rows]
            if cp is not None:
                self.counts = [_counted(t) for t in self.targets]
                self.targets = [_cut(t, cp) for t in self.targets]

    def do(self, a: Action) -> None:
        """Run `a`; in the active timeline its span runs from the moment its inputs are in (a wait
        for a peer is the bubble's, not the stage's) to its end."""
        self._began = time.perf_counter()
        if a.kind == "F":
            self.forward(a.microbatch, a.stage)
        elif a.kind == "W":
            self.weights_backward(a.microbatch, a.stage)
        else:
            self.backward(a.microbatch, a.stage, split=a.kind == "I")
        timeline = current_timeline()
        if timeline is not None:
            timeline.record(self.layout.rank, a.stage, a.microbatch, a.kind, self._began, time.perf_counter())

    def _received(self) -> None:
        """The current action's inputs are in: its span starts here."""
        self._began = time.perf_counter()

    def _send(self, channel: Channel, i: int, value: Any) -> None:
        self.ctx.wire.send(channel, i, value)
        self.sent.add((channel.index, i))

    def forward(self, i: int, s: int) -> None:
        layout, plan, wire, tracker = self.layout, self.layout.channels, self.ctx.wire, self.trackers[i]
        if s == 0:
            value = self.batches[i].value
        else:
            value = wire.receive(plan.activation[s - 1], i, requires_grad=self.train)
            self.inputs[(i, s)] = Batch(value).tensors
        for key in plan.popped_at[s]:
            skip = wire.receive(plan.skip[key], i, requires_grad=self.train)
            tracker.deliver(key, skip if isinstance(skip, Tensor) else None)
        self._received()
        out = self.ctx.stages[s].run(value, tracker, checkpoint=i < self.checkpoint_stop)
        stashed = dict(tracker.take_outbox())  # the layers made sure every declared stash happened
        for key in plan.stashed_at[s]:  # in channel order, the order the popping side receives in
            self._send(plan.skip[key], i, stashed[key])
        if s < layout.num_stages - 1:
            self._send(plan.activation[s], i, out.value)
            if self.train:
                self.kept[(i, s)] = out
        elif self.train:
            assert self.loss_fn is not None  # step() checked
            loss = self.loss_fn(out.value, self.targets[i]) if self.targets else self.loss_fn(out.value)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a one-element tensor (the micro-batch's mean loss), got "
                                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}")
            if self.cp is not None:  # this rank's tokens' share of the micro-batch's mean
                loss = self._share(loss, out, i)
            weighted = loss.reshape(()) * self.weights[i]
            self.kept[(i, s)] = Batch(weighted)
            self.loss = weighted.detach() if self.loss is None else self.loss + weighted.detach()
        else:
            self.outputs[i] = out

    def _share(self, loss: Tensor, out: Batch, i: int) -> Tensor:
        """`loss` (a mean over this rank's counted tokens) as its part of the mean over the whole
        sequences' tokens; zero, with the graph kept, when this rank holds none of them."""
        assert self.cp is not None
        if self.targets:
            mine, whole = _counted(self.targets[i]), self.counts[i]
        else:
            mine, whole = out.tensors[0].size(1), self.cp.layout.length
        if mine == 0:
            return sum((t.sum() for t in out.tensors if t.is_floating_point()), loss.new_zeros(())) * 0.0
        return loss * (mine / whole)

    def backward(self, i: int, s: int, split: bool = False) -> None:
        """B of micro-batch `i` on stage `s`; `split`: I, the inputs' gradients only (sent on at
        once), leaving the weights' to `weights_backward` (W)."""
        layout, plan, wire, tracker = self.layout, self.layout.channels, self.ctx.wire, self.trackers[i]
        out = self.kept.pop((i, s))
        grads: tuple[Any, ...] = ()
        if s < layout.num_stages - 1:
            received = wire.receive(plan.gradient[s + 1], i, requires_grad=False)
            grads = received if isinstance(received, tuple) else (received,)
        for key in plan.stashed_at[s]:
            g = wire.receive(plan.skip_grad[key], i, requires_grad=False)
            tracker.put_grad(key, g if isinstance(g, Tensor) else None)
        self._received()
        if s == layout.num_stages - 1:
            roots: list[tuple[Tensor, Optional[Tensor]]] = [(out.tensor, None)] if out.tensor.requires_grad else []
        else:  # an output the next stage did not use gets a zero gradient (skip gradients may still flow)
            roots = [(t, g if g is not None else torch.zeros_like(t))
                     for t, g in zip(out.tensors, grads) if t.requires_grad]
        split = split and not self._whole(i)
        leaves = self.inputs.pop((i, s)) if s > 0 else ()
        popped = [tracker.inbox.get(key) for key in plan.popped_at[s]] if split else []
        got: list[Optional[Tensor]] = []
        if roots and split:
            wanted = [t for t in (*leaves, *popped) if t is not None]
            with self._deferring(i, s):
                got, self.weight_grads[(i, s)] = backward_input([t for t, _ in roots], [g for _, g in roots], wanted)
        elif roots:
            with self._deferring(i, s):
                torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        del out, roots
        tracker.release(plan.stashed_at[s])
        if split:  # the gradients backward_input returned, in the order asked, None where none came
            found = iter(got or [None] * sum(t is not None for t in (*leaves, *popped)))
            leaf_grads = [next(found) for _ in leaves]
            skip_grads = [next(found) if t is not None else None for t in popped]
            if s > 0:
                self._send(plan.gradient[s], i, tuple(leaf_grads))
            for key, g in zip(plan.popped_at[s], skip_grads):
                tracker.inbox.pop(key)
                self._send(plan.skip_grad[key], i, g)
            return
        if s > 0:
            self._send(plan.gradient[s], i, tuple(t.grad if t.requires_grad else None for t in leaves))
        for key in plan.popped_at[s]:
            self._send(plan.skip_grad[key], i, tracker.popped_grad(key))

    def _whole(self, i: int) -> bool:
        """Whether micro-batch `i`'s backward runs whole even where the schedule splits it: a
        checkpointed micro-batch's stage recomputes and runs its backward inside one autograd
        node (`_checkpoint`), which cannot be cut in two; its I does it all and its W nothing."""
        return i < self.checkpoint_stop

    def weights_backward(self, i: int, s: int) -> None:
        """W of micro-batch `i` on stage `s`: the weights' gradients its I left."""
        weight_grad = self.weight_grads.pop((i, s), None)
        if weight_grad is not None:
            with self._deferring(i, s):
                weight_grad.run()

    def _deferring(self, i: int, s: int) -> Any:
        """ZeRO-3 stages: replicated gradients stay unreduced until the stage's last backward (or
        W) of the step, so they are averaged over dp once per step, not once per micro-batch."""
        defer = self.layout.shard_parameters and (i, s) != self.last_backward.get(s)
        return no_sync(self.ctx.partitions[str(s)]) if defer else nullcontext()

    def whole_loss(self) -> Optional[Tensor]:
        """The step's loss on the last stage's rank (None elsewhere): under cp, this rank's share
        summed with the other cp ranks'."""
        if self.loss is None or not self.layout.holds(self.layout.num_stages - 1):
            return None
        loss = self.loss.full_tensor() if isinstance(self.loss, DTensor) else self.loss
        cp = self.ctx.groups.cp
        if cp is None or cp.size == 1:
            return loss
        record = comm.AllReduce(group=cp.group, size=cp.size, shape=tuple(loss.shape), dtype=loss.dtype, op="sum",
                                mesh_dims=(cp.mesh_dim,))
        return comm.run(record, loss.detach())


def cp_attention(ctx: StepContext, input: Any) -> CpAttention:
    """The step's context-parallel attention: the first stage's ranks tell the others the
    sequence length (one small all_gather over the pp ranks)."""
    layout, groups = ctx.layout, ctx.groups
    assert groups.cp is not None
    length = -1
    if layout.holds(0) and input is not None:
        first = Batch(input).tensors[0]
        length = first.size(1) if first.dim() >= 2 else -1
    rows = comm.all_gather_ints([length], groups.p2p, groups.p2p_size) if groups.p2p_size > 1 else [[length]]
    lengths = {n for (n,) in rows if n >= 0}
    if len(lengths) != 1:
        raise ValueError(f"DistributedPipe(cp_dim={layout.cp_dim!r}): the first stage's input must be (batch, seq, "
                         f"...) whole sequences, one length; the first stage's ranks gave lengths "
                         f"{sorted(n for (n,) in rows if n >= 0) or 'none'}")
    return make_cp_attention(lengths.pop(), groups.cp)


def _cut(value: Any, cp: CpAttention) -> Any:
    """This cp rank's tokens of every tensor of `value` whose dim 1 is the sequence."""
    if isinstance(value, tuple):
        return tuple(_cut(v, cp) for v in value)
    if isinstance(value, Tensor) and value.dim() >= 2 and value.size(1) == cp.layout.length:
        return value.index_select(1, cp.layout.index(cp.cp.rank, value.device))
    return value


def _shift(target: Any) -> Any:
    """(batch, seq) labels shifted one to the left, the last position ignored (-100)."""
    if not isinstance(target, Tensor) or target.dim() < 2 or target.is_floating_point():
        raise ValueError(f"a loss_fn that shifts labels takes (batch, seq) integer labels, got {describe(target)}")
    pad = torch.full_like(target.narrow(1, 0, 1), _IGNORE)
    return torch.cat([target.narrow(1, 1, target.size(1) - 1), pad], 1)


def _counted(target: Any) -> int:
    """How many of the target's tokens a mean counts (labels: those not -100)."""
    t = Batch(target).tensors[0]
    return t.numel() if t.is_floating_point() else int((t != _IGNORE).sum())


def _split(value: BatchValue, m: int, what: str) -> list[Batch]:
    batches = scatter(value, m)
    if len(batches) != m:
        rows = Batch(value).tensors[0].shape[0]
        sizes = [b.tensors[0].shape[0] for b in batches]
        raise ValueError(f"the {what} has {rows} rows, which Tensor.chunk cuts into {len(batches)} micro-batches "
                         f"{sizes}, not chunks={m}: every stage runs the schedule for exactly chunks micro-batches; "
                         f"use a batch of at least {m} rows that chunk() splits {m} ways (e.g. a multiple of {m})")
    return batches


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(v.to(device) if isinstance(v, Tensor) else v for v in value)
    return value
