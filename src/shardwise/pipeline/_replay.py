"""A pipeline step under `shardwise.compile`: its messages as host steps of the replayed graph.

A traced step records the stages' compute as usual. Each message that crosses ranks becomes
one `shardwise::host` node (`shardwise._compile`'s `Trace.host`) whose kernel runs the whole wire
protocol at every replay: a send posts its header (metadata inside) and payloads; a receive
reads the header (so a peer's failure still arrives as a message and stops this rank at
once), checks that the metadata is the one traced (the shapes the graph was built for) and
receives the payloads; the step's end checks the outcome over the pp ranks and waits for the
sends, as eager's does. A replay knows every message its step receives, so it posts their
headers' receives (always `PACKED` bytes) at its start. Since the protocol is the same, a
rank that replays talks to one that traces (or runs eagerly) as it would to itself.

`ReplayedStep` keeps what eager's `StepRun` keeps for failures: which action runs and which
messages were sent this step. When a replay raises, it tells the stages this rank still owes
a message, then agrees on the outcome with the other pp ranks, exactly as an eager step does
(`StepGuard.notify`, `conclude`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import Tensor

from ._channels import Channel
from ._context import StepContext
from ._schedule import Action

if TYPE_CHECKING:
    from .._compile import Trace

__all__ = ["ReplayedStep", "traced_step"]


class ReplayedStep:
    """One traced step over `order` (this rank's actions); `k` is the action being traced,
    which each message's host step remembers as where a replay is when it runs."""

    def __init__(self, ctx: StepContext, order: list[Action]) -> None:
        self.ctx, self.order = ctx, order
        self.k = 0
        self.index = 0
        self.current: Optional[Action] = None
        self.sent: set[tuple[int, int]] = set()
        self.concluded = False
        self.receives: list[tuple[Channel, int]] = []  # every message this rank's step receives, in order

    def at(self, k: int) -> None:
        """A replay reached the host step of action `k`."""
        self.index, self.current = k, self.order[k]

    def begin(self) -> None:
        """Before every replay: what an eager step does before the actions."""
        self.ctx.guard.begin()
        self.index, self.current, self.sent, self.concluded = 0, None, set(), False
        self.ctx.wire.prefetch(self.receives)

    def failed(self, exc: BaseException) -> None:
        """A replay raised `exc`: tell the stages still owed a message, agree on the outcome, raise."""
        if self.concluded:  # raised by the end-of-step check itself, which already did all this
            return
        self.concluded = True
        self.ctx.guard.conclude(self.ctx.guard.notify(exc, self.order[self.index:], self))

    def conclude(self, _: list[Tensor]) -> list[Tensor]:
        """The end of a successful step, a host step (at the trace and every replay): the outcome
        check and the sends' wait."""
        self.concluded = True
        self.ctx.guard.conclude(None)
        return []


def traced_step(ctx: StepContext, trace: Optional[Trace], order: list[Action]) -> Optional[ReplayedStep]:
    """Under `shardwise.compile`'s trace: the step whose messages become host steps of the
    graph, its hooks registered with the trace; None when not tracing, or when the trace is
    refused (the step then runs eagerly)."""
    if trace is None:
        return None
    if ctx.groups.cp is not None:
        trace.refuse("a context-parallel pipeline agrees on the sequence length over its pp ranks at every step")
        return None
    if any(c.crossing for c in ctx.layout.channels.channels):
        trace.refuse("messages between pipeline stages of different widths cross by the cross-mesh planner, "
                     "which is not replayed yet")
        return None
    replayed = ReplayedStep(ctx, order)
    trace.on_replay(replayed.begin, replayed.failed)
    ctx.wire.traced = replayed
    return replayed
