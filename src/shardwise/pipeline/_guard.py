"""How a pipe's step ends on one rank: failures relayed, the outcome agreed, a broken pipe refused.

A stage that raises tells every stage it still owes a message this step (`notify`: a
*failed* header on each such channel, see `_wire`), so they stop at once instead of waiting
for the timeout. At the end of every step the pp ranks compare outcomes (`conclude`: one
small all_gather), so a rank that had finished its part still fails when another did; the
failing rank re-raises its own exception, the others raise `PipelineError` naming their
stage, rank and where the failure began. After a failure the pipe refuses further steps
(`begin`): its channels may hold stale messages. An eager step and a replayed one
(`_replay`) end the same way, through one `StepGuard` per pipe.
"""

from __future__ import annotations

from typing import Optional, Protocol

from .. import _comm as comm
from ._layout import PipeLayout
from ._process_groups import PipeGroups
from ._schedule import Action
from ._wire import PipelineError, RemoteFailure, Wire

__all__ = ["Failure", "Progress", "StepGuard"]

Failure = tuple[BaseException, RemoteFailure]  # the error to raise here, the one relayed to the others


class Progress(Protocol):
    """Where a step is (an eager `StepRun` or a `ReplayedStep`): the action running, and the
    (channel, micro-batch) messages sent so far."""

    current: Optional[Action]
    sent: set[tuple[int, int]]


class StepGuard:
    """The steps of one pipe on this rank: counted, failures relayed and agreed, and after a
    failure no more (the outcome is agreed over the pipe's point-to-point group)."""

    def __init__(self, layout: PipeLayout, wire: Wire, groups: PipeGroups) -> None:
        self.layout, self.wire, self.groups = layout, wire, groups
        self.stages = list(layout.local_stages)  # named in errors, as a list
        self.broken: Optional[str] = None
        self.steps = 0  # steps begun, named in errors ("... of micro-batch 2 of step 3")
        self.abandoned: list[comm.P2PWork] = []  # sends no one will receive; their buffers must outlive them

    def begin(self) -> None:
        """A step begins: refused when an earlier one failed."""
        if self.broken is not None:
            raise RuntimeError(f"this DistributedPipe failed in an earlier step ({self.broken}); its channels "
                               "may hold undelivered messages: build a new pipe (after a dead process, new "
                               "process groups too)")
        self.steps += 1

    def notify(self, exc: BaseException, remaining: list[Action], run: Progress) -> Failure:
        """Tell every stage this rank still owes a message that the step failed; return the error to raise here."""
        action, rank = run.current, self.layout.rank
        where = (f"before its first micro-batch of step {self.steps}" if action is None else
                 f"in the {'forward' if action.kind == 'F' else 'backward'} of micro-batch {action.microbatch} of "
                 f"step {self.steps}")
        stage = action.stage if action is not None else min(self.stages)
        if isinstance(exc, RemoteFailure):
            relay = exc
            local: BaseException = PipelineError(f"stage {stage} on rank {rank} stopped {where} {exc.doing}: "
                                                 f"{exc.cause}")
        else:
            relay = RemoteFailure(f"stage {stage} on rank {rank} raised {type(exc).__name__}: {exc} ({where})",
                                  False, stage, rank)
            local = exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised by stage {stage} on rank {rank} {where}; the other stages were told "
                             "and stop with PipelineError)")
        for a in remaining:
            for channel in self.layout.channels.outgoing(a):
                if (channel.index, a.microbatch) not in run.sent:
                    run.sent.add((channel.index, a.microbatch))
                    try:
                        self.wire.send_failure(channel, a.microbatch, relay)
                    except RemoteFailure:  # that stage's process is gone; it needs no news
                        pass
        return local, relay

    def conclude(self, failure: Optional[Failure]) -> None:
        """Agree with the other pp ranks on the step's outcome; wait for the sends, or raise."""
        if failure is not None and failure[1].died:  # a process may be gone: no collective can complete
            self.give_up(failure[1].cause)
            raise failure[0]
        me = [0, -1, -1] if failure is None else [1, failure[1].origin_stage, failure[1].origin_rank]
        try:
            size = self.groups.p2p_size
            outcomes = comm.all_gather_ints(me, self.groups.p2p, size) if size > 1 else [me]
        except RuntimeError as exc:
            self.give_up(str(exc))
            if failure is not None:
                raise failure[0]
            raise PipelineError(
                f"stages {self.stages} on rank {self.layout.rank} finished their part of the step, but the check "
                f"of the step's outcome over the pp ranks failed ({exc}): another stage's process has probably "
                "died or is stuck") from exc
        if failure is not None:
            self.give_up(failure[1].cause)
            raise failure[0]
        failed = [(stage, rank) for code, stage, rank in outcomes if code]
        if failed:
            origin = ", ".join(sorted({f"stage {s} on rank {r}" for s, r in failed}))
            self.give_up(f"failure at {origin}")
            raise PipelineError(f"stages {self.stages} on rank {self.layout.rank} finished their part of the step, "
                                f"but it failed at {origin} (see that rank's error); the gradients of this step "
                                "are partial")
        try:
            self.wire.finish()
        except comm.P2PError as exc:
            self.give_up(str(exc))
            raise PipelineError(f"rank {self.layout.rank}: a message of the step was never received: {exc}") from exc

    def give_up(self, reason: str) -> None:
        """The pipe is broken: no more steps, and the step's pending messages are abandoned."""
        self.broken = reason
        self.abandoned += self.wire.abandon()
