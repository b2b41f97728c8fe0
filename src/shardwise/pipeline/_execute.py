"""Running one step of a pipe on one rank: its actions in the schedule's order, and how it ends.

`execute` runs the actions of a `StepRun` (`_step`) one after another, under the step's
context-parallel attention when the pipe has a cp dim, and ends the step through the
pipe's `StepGuard` (`_guard`): a failure is relayed to the stages this rank owes a message
and the outcome is agreed over the pp ranks. Under `shardwise.compile`'s trace the step's
messages become host steps of the graph (`_replay`), and the end-of-step check one more,
so that every replay ends the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

from .._compile import current_trace
from ..parallel._context_parallel import CpSession
from ._context import StepContext
from ._guard import Failure
from ._replay import traced_step
from ._schedule import Action
from ._step import StepRun, cp_attention

__all__ = ["execute"]


def execute(ctx: StepContext, run: StepRun, order: list[Action], input: Any, target: Any) -> None:
    """Run `order` (this rank's actions) on `input` and `target`; raise if the step failed anywhere."""
    ctx.guard.begin()
    k = 0
    failure: Optional[Failure] = None
    trace = current_trace()
    replayed = traced_step(ctx, trace, order)
    attention = cp_attention(ctx, input) if ctx.groups.cp is not None else None
    try:
        with CpSession(attention) if attention is not None else nullcontext():
            run.prepare(input, target)
            for k, action in enumerate(order):
                run.current = action
                if replayed is not None:
                    replayed.k = k
                run.do(action)
        run.current = None
    except BaseException as exc:
        failure = ctx.guard.notify(exc, order[k:], run)
    finally:
        ctx.wire.traced = None
    if failure is None and replayed is not None and trace is not None:
        trace.host(replayed.conclude, [])  # the end-of-step check, at every replay too
    else:
        ctx.guard.conclude(failure)
