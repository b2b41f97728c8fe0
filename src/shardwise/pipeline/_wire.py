"""Messages between pipeline stages on different ranks: values, gradients, and failures.

Stages exchange four kinds of message, each on its own `Channel` (a kind, a source
stage and a destination stage): the activation of stage `s` to `s + 1`, the gradient
back from `s + 1` to `s`, a skip tensor from the stage that stashes it straight to the
stage that pops it, and the skip's gradient straight back. Every message of a step has
its own tag (`micro-batch * channels + channel`), so a receiver never depends on the
order in which a peer posts its sends; `ChannelPlan` numbers the channels the same way
on every process.

A message is a header (status, metadata size, tensor count, origin of a failure, whether
the payloads follow inside it, and the pickled metadata itself when it fits in the header's
`INLINE` bytes: the value's structure with each tensor's shape and dtype, non-tensor values
inside it), the metadata as a message of its own only when it does not fit, then one payload
per non-empty tensor. A receiver posts every header's receive as `PACKED` bytes before it
knows the message's size (a shorter message fills the front of it), so a sender puts the
payloads of a small value into the header itself, behind its `HEADER` words: a small message
is one transfer, not three. Sending shapes along lets every micro-batch differ (an uneven
last one, a skip that is `None` this time) with no agreement ahead of time.

The header is also how failure spreads. A stage that fails sends, on every channel it
still owes a message this step, a header that says *failed* and carries the cause as
text; a stage waiting on that channel raises instead of waiting for the timeout, and
relays the same cause on the channels *it* owes, and so on, so every rank learns of the
failure at the speed of the messages. A peer whose process died cannot send anything:
the receive fails (the connection closes, or the collective timeout passes) and the
cause relayed from there says the process may be gone. Messages between two stages on
the same rank never touch the network: they wait in a mailbox. The bytes of a message (its
header's words, its value's skeleton) are made and read by `_message`, moved by `_link`'s
`Link`; a message between rows of different sizes crosses by `_crossing`.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from .. import _comm as comm
from .._compile import current_trace
from ._channels import Channel, ChannelPlan
from ._crossing import receive_across, send_across
from ._link import Link, RemoteFailure, never_sent
from ._message import HEADER, INLINE, OK, describe_specs, detached, flatten, leaves, unflatten, wire_view

__all__ = ["HEADER", "INLINE", "Channel", "ChannelPlan", "PipelineError", "RemoteFailure", "TracedStep", "Wire"]


class TracedStep(Protocol):
    """What the wire needs of the step `shardwise.compile` is tracing (`_replay.ReplayedStep`):
    the action being traced (`k`), where a replay is (`at`), what it sent and what it receives."""

    k: int
    sent: set[tuple[int, int]]
    receives: list[tuple[Channel, int]]

    def at(self, k: int) -> None: ...


class PipelineError(RuntimeError):
    """A pipeline step could not finish on this rank because a stage elsewhere failed (or
    its process died); the message names this stage and rank, the micro-batch, what it
    was waiting for, and the stage where the failure began."""


class Wire:
    """Sends and receives a pipeline's messages for one rank over `group` (tensors on `device`)."""

    def __init__(self, group: Any, device: torch.device, num_channels: int, tp_mesh: Any = None) -> None:
        self.link = Link(group, device, num_channels)
        self.tp_mesh = tp_mesh  # where DTensors that arrive live (the stage's tensor-parallel sub-mesh)
        self.mailbox: dict[tuple[int, int], Any] = {}
        self.traced: Optional[TracedStep] = None  # the step `shardwise.compile` is tracing (see `_replay`)

    @property
    def num_channels(self) -> int:
        return self.link.num_channels

    # -- sending ------------------------------------------------------------------------------

    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        """Post `value` (a tensor, None, or a tuple of values) on `channel`; do not wait."""
        if channel.local:
            self.mailbox[(channel.index, microbatch)] = detached(value)
            return
        skeleton, tensors = flatten(value)
        meta = pickle.dumps((skeleton, [(tuple(t.shape), t.dtype) for t in tensors]))
        if channel.crossing:
            send_across(self.link, self.tp_mesh, channel, microbatch, value, skeleton, tensors, meta)
            return
        header, payload = [OK, len(meta), len(tensors), -1, -1, 0], [wire_view(t) for t in tensors if t.numel() > 0]
        step, trace, link = self.traced, current_trace(), self.link
        if step is None or trace is None:
            link.post(channel, microbatch, header, meta, payload)
            return
        k = step.k

        def post(parts: list[Tensor]) -> list[Tensor]:  # at the trace and at every replay
            step.at(k)
            link.post(channel, microbatch, header, meta, parts)
            step.sent.add((channel.index, microbatch))
            return []

        trace.host(post, payload)

    def send_failure(self, channel: Channel, microbatch: int, failure: RemoteFailure) -> None:
        """Tell `channel`'s receiver that this step failed (instead of the message it expects)."""
        if not channel.local:
            self.link.post_failure(channel, microbatch, failure)

    def finish(self) -> None:
        """Wait for every send of the step (each has a matching receive when the step succeeded)."""
        self.link.finish()

    def abandon(self) -> list[comm.P2PWork]:
        """Forget the step's sends and the header receives posted ahead (after a failure some will
        never complete); return them so the caller can keep their buffers alive."""
        self.mailbox.clear()
        return self.link.abandon()

    def prefetch(self, receives: list[tuple[Channel, int]]) -> None:
        """Post the header receives of a replayed step's messages at its start (see `Link.prefetch`)."""
        self.link.prefetch(receives)

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, channel: Channel, microbatch: int, *, requires_grad: bool) -> Any:
        """The value sent on `channel` for `microbatch`; floating tensors become leaves that
        require grad when `requires_grad`. Raises `RemoteFailure` when the sender failed."""
        if channel.local:
            value = self.mailbox.pop((channel.index, microbatch))
            return leaves(value, requires_grad)
        try:
            if channel.crossing:
                return receive_across(self.link, self.tp_mesh, channel, microbatch, requires_grad)
            return self._receive(channel, microbatch, requires_grad)
        except comm.P2PError as exc:
            raise never_sent(channel, microbatch, channel.src_rank, exc) from exc

    def _receive(self, channel: Channel, microbatch: int, requires_grad: bool) -> Any:
        label, src, link = channel.label(microbatch), channel.src_rank, self.link
        step, trace = self.traced, current_trace()
        if step is None or trace is None:
            skeleton, specs, _, inside = link.header(channel, microbatch, src)
            tensors = link.payloads(channel, microbatch, specs) if inside is None else inside
            return leaves(unflatten(skeleton, tensors, self.tp_mesh, label), requires_grad)
        k, traced = step.k, dict[str, Any]()
        step.receives.append((channel, microbatch))

        def receive(_: list[Tensor]) -> list[Tensor]:  # at the trace and at every replay
            step.at(k)
            skeleton, specs, meta, inside = link.header(channel, microbatch, src)
            if traced.setdefault("meta", meta) != meta:
                _, was = pickle.loads(traced["meta"])
                raise RuntimeError(f"{label} from rank {src} holds tensors {describe_specs(specs)}, but this rank's "
                                   f"compiled step was traced receiving {describe_specs(was)}: the ranks called it "
                                   "with different shapes; call the step with the same batch shapes on every pp rank")
            traced["skeleton"] = skeleton
            return link.payloads(channel, microbatch, specs) if inside is None else inside

        tensors = trace.host(receive, [])
        return leaves(unflatten(traced["skeleton"], tensors, self.tp_mesh, label), requires_grad)
