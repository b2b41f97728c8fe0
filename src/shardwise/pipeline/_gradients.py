"""A pipe's gradient sums after a step, registered as the reducers of its parameters.

A pipe's stages run one backward pass per micro-batch and stage, and its sums need all of
them: so they are end-of-backward `Step`s that the pipe finishes itself once the schedule is
done (`PipeGradients.finish`, in phase order), never armed at the end of one pass. They are
still the registered reducers of their parameters (see `_tensor/_end_of_backward.py`):
`shardwise.debug.gradient_reducers` names them, and a second reducer of one of them at the
same level (a `data_parallel` over the model given to the pipe, a second pipe over the same
live model) is refused, naming both registrations.

| level, phase | over | the sum |
|---|---|---|
| `replicas` | `mesh dim 'dp'` | average over the stage's dp replicas, bucketed (none under ZeRO-3: `data_parallel`'s units are that reducer) |
| `across` | `the stages sharing it (pp indices [...])` | a tied parameter's copies summed over the pp ranks holding them (`_ties`) |
| `across` | `mesh dim 'cp'` | every gradient summed over the cp ranks (each computed its own tokens' share) |

A tied parameter's copies sum with one all_reduce over just the holders' ranks; holders whose
tp rows differ in width swap gradients across meshes (`_crossing`) and each sums the terms in
pp order. Under cp, a tied parameter's one `across` reducer composes both sums (its record
says so): the tie's first, then cp's.

The cp sum is at level `across`: each cp rank's pipeline is a replica group of its own whose
replicas level is the dp average (under ZeRO-3, `data_parallel`'s), and the cp ranks then sum
across those groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from torch import Tensor, nn

from .. import _comm as comm
from .._placement import Replicate
from .._tensor import (DTensor, GradientReducer, Step, averaged_within_layout, caller_place, from_local, register,
                       unregister)
from ._channels import Channel
from ._guard import StepGuard
from ._layout import PipeLayout
from ._process_groups import PipeGroups
from ._ties import Tie
from ._wire import PipelineError, RemoteFailure, Wire

__all__ = ["PipeGradients", "PipeReducer", "pipe_gradients"]

Params = Callable[[], Sequence[tuple[str, nn.Parameter]]]  # (name, parameter) of this rank, looked up when asked

_HINT = ("A DistributedPipe reduces its stages' gradients itself (over its dp, cp and tied stages): build it from a "
         "model that no data_parallel / fully_shard holds, and close() an earlier pipe over the same model first.")


class PipeReducer:
    """One registered reducer of a pipe: its record and the parameters it reduces (looked up
    when asked, so sharding or `to_empty` replacing them does not leave the registry stale)."""

    def __init__(self, record: GradientReducer, params: Params) -> None:
        self.record, self.params = record, params

    def gradient_reducer(self) -> GradientReducer:
        return self.record

    def reduced_params(self) -> list[tuple[str, Tensor]]:
        return list(self.params())


class PipeGradients:
    """A pipe's reducers on this rank, registered (`register`), and its sums, finished after
    every training step in phase order (`finish`); `release` forgets them (at `close()`)."""

    def __init__(self, reducers: list[PipeReducer], steps: list[Step]) -> None:
        self.reducers, self.steps = reducers, steps  # in phase order: "replicas", then "across"

    def register(self) -> None:
        done: list[PipeReducer] = []
        try:
            for reducer in self.reducers:
                register(reducer, _HINT)
                done.append(reducer)
        except ValueError:
            for reducer in done:
                unregister(reducer)
            raise

    def finish(self) -> None:
        for step in self.steps:
            step.finish()

    def release(self) -> None:
        for reducer in self.reducers:
            unregister(reducer)
        self.reducers, self.steps = [], []


def pipe_gradients(layout: PipeLayout, groups: PipeGroups, wire: Wire, guard: StepGuard,
                   local: nn.ModuleDict) -> PipeGradients:
    """The reducers and sums of a pipe whose stages on this rank are `local` (not registered yet)."""
    where, bucket = caller_place(), int(layout.bucket_cap_mb * 2**20)

    def every() -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in local.named_parameters() if p.requires_grad]

    def averaged() -> list[tuple[str, nn.Parameter]]:  # (whole experts per dp rank average through their dispatch)
        assert layout.dp_dim is not None
        skip = averaged_within_layout(layout.stage_mesh.ranks_along(layout.dp_dim))
        return [(name, p) for name, p in every() if id(p) not in skip]

    found: list[tuple[PipeReducer, Step]] = []  # in phase order
    if groups.dp is not None and groups.dp_size > 1 and not layout.shard_parameters:
        assert layout.dp_dim is not None
        record = GradientReducer("DistributedPipe", "replicas", "avg", layout.stage_mesh.ranks_along(layout.dp_dim),
                                 f"mesh dim {layout.dp_dim!r}", where)
        found.append((PipeReducer(record, averaged), _BucketedSum(
            "replicas", averaged, groups.dp, groups.dp_size, "avg", bucket,
            f"rank {layout.rank}: averaging gradients over {layout.dp_dim!r}",
            "a rank of another data-parallel replica probably failed in this step")))
    cp = groups.cp if groups.cp is not None and groups.cp.size > 1 else None
    tied: set[str] = set()
    for k, (tie, group) in enumerate(zip(layout.ties, groups.ties)):
        def copies(tie: Tie = tie) -> list[tuple[str, nn.Parameter]]:
            return tie.params(local)

        held = {name for name, _ in copies()}
        if held:  # (a rank that holds none of them takes no part)
            tied |= held
            record = _tie_record(layout, tie, cp.ranks if cp is not None else None, where)
            found.append((PipeReducer(record, copies), _SumAcross(layout, wire, guard, k, tie, copies) if tie.across
                          else _BucketedSum("across", copies, group, len(tie.holders), "sum", bucket,
                                            f"rank {layout.rank}: summing the gradients of {list(tie.names)} over the "
                                            f"pp ranks {list(tie.holders)}", "one of them probably failed")))
    if cp is not None:
        def untied() -> list[tuple[str, nn.Parameter]]:
            return [(name, p) for name, p in every() if name not in tied]

        record = GradientReducer("DistributedPipe", "across", "sum", cp.ranks, f"mesh dim {layout.cp_dim!r}", where)
        found.append((PipeReducer(record, untied), _BucketedSum(
            "across", every, cp.group, cp.size, "sum", bucket, f"rank {layout.rank}: summing gradients over "
            f"{layout.cp_dim!r}", "a rank of another cp piece probably failed in this step")))
    return PipeGradients([reducer for reducer, _ in found], [step for _, step in found])


def _tie_record(layout: PipeLayout, tie: Tie, cp_ranks: Optional[tuple[int, ...]], where: str) -> GradientReducer:
    """The record of a tie's sum on this rank: over the holders' copies that line up with its
    own, then (under cp) over its cp peers' sums, which the cp step adds after it."""
    over = f"the stages sharing it (pp indices {list(tie.holders)})"
    if cp_ranks is None:
        return GradientReducer("DistributedPipe", "across", "sum", _tie_ranks(layout, tie), over, where)
    ranks = tuple(sorted({r for row in tie.rows if set(row) & set(cp_ranks) for r in row}))  # (one mesh: rows)
    return GradientReducer("DistributedPipe", "across", "sum", ranks, f"{over}, then mesh dim {layout.cp_dim!r}", where)


def _tie_ranks(layout: PipeLayout, tie: Tie) -> tuple[int, ...]:
    """The global ranks whose copies of `tie` this rank's copy is summed with (itself included)."""
    if tie.across:
        return tuple(sorted({r for h in tie.holders for r in layout.topology.row(h)}))
    return next((row for row in tie.rows if layout.rank in row), (layout.rank,))


class _BucketedSum(Step):
    """The gradients of `params()` summed (or averaged) over `group`, one all_reduce per bucket;
    a failure is a PipelineError saying what failed (`what`) and who probably did (`suspect`)."""

    def __init__(self, phase: str, params: Params, group: Any, size: int, op: str, bucket_bytes: int, what: str,
                 suspect: str) -> None:
        self.phase, self.params, self.group, self.size, self.op = phase, params, group, size, op
        self.bucket_bytes, self.what, self.suspect = bucket_bytes, what, suspect

    def finish(self) -> None:
        params = [p for _, p in self.params()]
        grads = [p.grad for p in params]
        try:  # a tensor-parallel parameter's piece, with the same piece on the other ranks
            reduced = comm.all_reduce_coalesced([_piece(g) for g in grads], self.group, self.size, self.op,
                                                templates=[_local(p) for p in params], bucket_bytes=self.bucket_bytes)
        except RuntimeError as exc:
            raise PipelineError(f"{self.what} failed ({exc}): {self.suspect}") from exc
        for p, g, piece in zip(params, grads, reduced):
            if piece is not None:
                p.grad = _like(piece.clone(), g if g is not None else p)


class _SumAcross(Step):
    """A tie whose holders' tp rows differ in width: each holder sends its gradients to every
    other by the cross-mesh planner (landing split as they are split there), brings what it
    receives into its own copy's layout, and sums every holder's term in pp order, so every
    copy gets the same sum."""

    phase = "across"

    def __init__(self, layout: PipeLayout, wire: Wire, guard: StepGuard, k: int, tie: Tie, params: Params) -> None:
        self.layout, self.wire, self.guard, self.k, self.tie, self.params = layout, wire, guard, k, tie, params

    def _channel(self, src: int, dst: int) -> Channel:
        """Numbered past the step's channels, the same on every process."""
        pp, topology = self.layout.topology.pp, self.layout.topology
        index = self.wire.num_channels + (self.k * pp + src) * pp + dst
        rows = topology.row(src), topology.row(dst)
        return Channel(index, "shared gradient", src, dst, rows[0][0], rows[1][0], ", ".join(self.tie.names),
                       rows[0], rows[1])

    def finish(self) -> None:
        me, holders, wire = self.layout.pp_rank, self.tie.holders, self.wire
        m = self.layout.schedule.num_microbatches
        params = [p for _, p in self.params()]
        own = tuple(_settled(p.grad, p) for p in params)
        terms: dict[int, tuple[Any, ...]] = {me: own}
        try:
            for h in holders:
                if h != me:
                    wire.send(self._channel(me, h), m, own)
            for h in holders:
                if h != me:
                    received = wire.receive(self._channel(h, me), m, requires_grad=False)
                    terms[h] = tuple(_into(g, p) for g, p in zip(received, params))
            wire.finish()
        except (RemoteFailure, comm.P2PError) as exc:
            self.guard.give_up(str(exc))
            raise PipelineError(f"rank {self.layout.rank}: summing the gradients of {', '.join(self.tie.names)} with "
                                f"the stages on pp indices {list(holders)} that share them failed ({exc}): one of "
                                "them probably failed") from exc
        for j, p in enumerate(params):
            total = None
            for h in holders:  # in pp order on every holder: the same sum everywhere
                g = terms[h][j]
                total = g if total is None else total if g is None else total + g
            p.grad = total


def _settled(grad: Optional[Tensor], param: Tensor) -> Optional[Tensor]:
    """`grad` in its parameter's layout (a Partial gradient reduced)."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _into(value: Any, param: Tensor) -> Optional[Tensor]:
    """A gradient that arrived from another mesh, in `param`'s layout here."""
    if not isinstance(value, Tensor):
        return None
    if isinstance(param, DTensor):
        if not isinstance(value, DTensor):  # a whole gradient: this rank's piece of it
            value = from_local(value, param.device_mesh, tuple(Replicate() for _ in param.placements))
        moved: Tensor = value.redistribute(param.device_mesh, param.placements)
        return moved
    whole: Tensor = value.full_tensor() if isinstance(value, DTensor) else value
    return whole


def _piece(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(piece: Tensor, ref: Tensor) -> Tensor:
    """`piece` as `ref` is: a DTensor of its layout when `ref` is one."""
    if not isinstance(ref, DTensor):
        return piece
    return from_local(piece, ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride(),
                      shard_order=ref.shard_order)
