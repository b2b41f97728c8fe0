"""Messages between pipeline stages on different ranks: values, gradients, and failures.

Stages exchange four kinds of message, each on its own `Channel` (a kind, a source
stage and a destination stage): the activation of stage `s` to `s + 1`, the gradient
back from `s + 1` to `s`, a skip tensor from the stage that stashes it straight to the
stage that pops it, and the skip's gradient straight back. Every message of a step has
its own tag (`micro-batch * channels + channel`), so a receiver never depends on the
order in which a peer posts its sends; `ChannelPlan` numbers the channels the same way
on every process.

A message is a header (status, metadata size, tensor count, origin of a failure), the
pickled metadata (the value's structure with each tensor's shape and dtype; non-tensor
values travel inside it), then one payload per non-empty tensor. Sending shapes along
costs one small message but lets every micro-batch differ (an uneven last one, a skip
that is `None` this time) with no agreement ahead of time.

The header is also how failure spreads. A stage that fails sends, on every channel it
still owes a message this step, a header that says *failed* and carries the cause as
text; a stage waiting on that channel raises instead of waiting for the timeout, and
relays the same cause on the channels *it* owes, and so on, so every rank learns of the
failure at the speed of the messages. A peer whose process died cannot send anything:
the receive fails (the connection closes, or the collective timeout passes) and the
cause relayed from there says the process may be gone. Messages between two stages on
the same rank never touch the network: they wait in a mailbox.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _comm as comm
from .._layout import contiguous_strides
from .._tensor import DTensor, from_local
from ._schedule import Action
from .skip._routes import SkipRoutes
from .skip._namespace import Namespace
from .skip._tracker import SkipKey

__all__ = ["Channel", "ChannelPlan", "PipelineError", "RemoteFailure", "Wire"]

OK, FAILED, DIED = 0, 1, 2
HEADER = 5  # int64: status, metadata bytes, tensor count, origin stage, origin rank


class PipelineError(RuntimeError):
    """A pipeline step could not finish on this rank because a stage elsewhere failed (or
    its process died); the message names this stage and rank, the micro-batch, what it
    was waiting for, and the stage where the failure began."""


@dataclass(frozen=True)
class Channel:
    """The messages of one kind from stage `src_stage` (on global rank `src_rank`) to
    `dst_stage` (on `dst_rank`), one per micro-batch; `index` numbers it in the pipeline."""

    index: int
    kind: str  # "activation" | "gradient" | "skip" | "skip gradient"
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    skip: str = ""  # the skip's name (and namespace) for skip channels

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    def label(self, microbatch: int) -> str:
        what = f"{self.kind} {self.skip}" if self.skip else self.kind
        return f"the {what} of micro-batch {microbatch} (stage {self.src_stage} -> {self.dst_stage})"


class ChannelPlan:
    """Every channel of a pipeline of `num_stages` stages, stage `s` on global rank `rank_of[s]`:
    activations `s -> s+1`, gradients `s+1 -> s`, and for each skip that crosses stages one
    channel from its stash stage to its pop stage and one back. Numbered the same way on
    every process (tags depend on it), so skips are ordered by where they are stashed and
    popped, never by namespace: `SkipRoutes.routes` sorts namespaces by their ids, which are
    random per process.

    >>> from shardwise.pipeline.skip import SkipRoutes, SkipRoute
    >>> plan = ChannelPlan(3, SkipRoutes(3, [SkipRoute(None, "x", 0, 2)]), rank_of=[0, 1, 2])
    >>> for c in plan.channels:
    ...     print(c.index, c.label(0))
    0 the activation of micro-batch 0 (stage 0 -> 1)
    1 the activation of micro-batch 0 (stage 1 -> 2)
    2 the gradient of micro-batch 0 (stage 1 -> 0)
    3 the gradient of micro-batch 0 (stage 2 -> 1)
    4 the skip 'x' of micro-batch 0 (stage 0 -> 2)
    5 the skip gradient 'x' of micro-batch 0 (stage 2 -> 0)
    >>> [c.index for c in plan.outgoing(Action("F", 0, 0))]  # stage 0's forward: activation and skip
    [0, 4]
    """

    def __init__(self, num_stages: int, layout: SkipRoutes, rank_of: Sequence[int]) -> None:
        self.channels: list[Channel] = []
        self.num_stages = num_stages
        crossing = sorted((r for r in layout.routes if r.stash_partition != r.pop_partition),
                          key=lambda r: (r.stash_partition, r.pop_partition, r.stash_layer or "", r.pop_layer or "",
                                         r.name))

        def channel(kind: str, src: int, dst: int, skip: str = "") -> Channel:
            c = Channel(len(self.channels), kind, src, dst, rank_of[src], rank_of[dst], skip)
            self.channels.append(c)
            return c

        S = num_stages
        self.activation = {s: channel("activation", s, s + 1) for s in range(S - 1)}
        self.gradient = {s: channel("gradient", s, s - 1) for s in range(1, S)}
        self.skip = {(r.ns, r.name): channel("skip", r.stash_partition, r.pop_partition, _skip_name(r.ns, r.name))
                     for r in crossing}
        self.skip_grad = {(r.ns, r.name): channel("skip gradient", r.pop_partition, r.stash_partition,
                                                  _skip_name(r.ns, r.name)) for r in crossing}
        self.stashed_at: dict[int, list[SkipKey]] = {
            s: [(r.ns, r.name) for r in crossing if r.stash_partition == s] for s in range(S)}
        self.popped_at: dict[int, list[SkipKey]] = {
            s: [(r.ns, r.name) for r in crossing if r.pop_partition == s] for s in range(S)}

    def outgoing(self, a: Action) -> list[Channel]:
        """The channels on which action `a` sends (its forward's output and stashes, or its
        backward's input gradient and popped skips' gradients)."""
        s, last = a.stage, self.num_stages - 1
        if a.kind == "F":
            return ([self.activation[s]] if s < last else []) + [self.skip[k] for k in self.stashed_at[s]]
        return ([self.gradient[s]] if s > 0 else []) + [self.skip_grad[k] for k in self.popped_at[s]]


def _skip_name(ns: Optional[Namespace], name: str) -> str:
    return f"'{name}'" if ns is None else f"'{name}' in {ns!r}"


class RemoteFailure(Exception):
    """Raised by `Wire` when the awaited message says its sender failed, or a message could
    not be received or sent. `cause` describes the first failure (stage, rank, what), `died`
    whether a process may be gone, `doing` what this rank was doing ("waiting for ...")."""

    def __init__(self, cause: str, died: bool, origin_stage: int, origin_rank: int, doing: str = "") -> None:
        super().__init__(cause)
        self.cause, self.died = cause, died
        self.origin_stage, self.origin_rank = origin_stage, origin_rank
        self.doing = doing


@dataclass(frozen=True)
class _Slot:
    """Where tensor number `k` of a message goes back into its value."""

    k: int


@dataclass(frozen=True)
class _DSlot(_Slot):
    """Tensor number `k` is this rank's piece of a DTensor of `shape` in `placements`: it
    becomes one again on the receiving stage's tensor-parallel mesh (the matching rank of
    the same coordinate holds the same piece there, so nothing is gathered)."""

    placements: tuple[Any, ...]
    shard_order: Any
    shape: tuple[int, ...]


class Wire:
    """Sends and receives a pipeline's messages for one rank over `group` (tensors on `device`)."""

    def __init__(self, group: Any, device: torch.device, num_channels: int, tp_mesh: Any = None) -> None:
        self.group = group
        self.device = device
        self.tp_mesh = tp_mesh  # where DTensors that arrive live (the stage's tensor-parallel sub-mesh)
        self.num_channels = num_channels
        self.pending: list[comm.P2PWork] = []  # sends of this step, waited at its end
        self.mailbox: dict[tuple[int, int], Any] = {}

    def tag(self, channel: Channel, microbatch: int) -> int:
        return microbatch * self.num_channels + channel.index

    # -- sending ------------------------------------------------------------------------------

    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        """Post `value` (a tensor, None, or a tuple of values) on `channel`; do not wait."""
        if channel.local:
            self.mailbox[(channel.index, microbatch)] = _detached(value)
            return
        skeleton, tensors = _flatten(value)
        meta = pickle.dumps((skeleton, [(tuple(t.shape), t.dtype) for t in tensors]))
        self._post(channel, microbatch, [OK, len(meta), len(tensors), -1, -1], meta,
                   [_wire_view(t) for t in tensors if t.numel() > 0])

    def send_failure(self, channel: Channel, microbatch: int, failure: RemoteFailure) -> None:
        """Tell `channel`'s receiver that this step failed (instead of the message it expects)."""
        if channel.local:
            return
        text = failure.cause.encode()
        self._post(channel, microbatch, [DIED if failure.died else FAILED, len(text), 0, failure.origin_stage,
                                         failure.origin_rank], text, [])

    def _post(self, channel: Channel, microbatch: int, header: list[int], meta: bytes, tensors: list[Tensor]) -> None:
        tag, label, dst = self.tag(channel, microbatch), channel.label(microbatch), channel.dst_rank
        parts = [torch.tensor(header, dtype=torch.int64, device=self.device)]
        if meta:
            parts.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device))
        try:
            for t in parts + tensors:
                self.pending.append(comm.isend(t, dst, self.group, tag=tag, label=label))
        except comm.P2PError as exc:
            cause = f"stage {channel.dst_stage} on rank {dst} could not be sent {label}: {exc.reason}"
            raise RemoteFailure(cause, True, channel.dst_stage, dst, f"while sending {label} to rank {dst}") from exc

    def finish(self) -> None:
        """Wait for every send of the step (each has a matching receive when the step succeeded)."""
        pending, self.pending = self.pending, []
        for work in pending:
            work.wait()

    def abandon(self) -> list[comm.P2PWork]:
        """Forget the step's sends (after a failure some will never be received); return them so
        the caller can keep their buffers alive."""
        pending, self.pending = self.pending, []
        self.mailbox.clear()
        return pending

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, channel: Channel, microbatch: int, *, requires_grad: bool) -> Any:
        """The value sent on `channel` for `microbatch`; floating tensors become leaves that
        require grad when `requires_grad`. Raises `RemoteFailure` when the sender failed."""
        if channel.local:
            value = self.mailbox.pop((channel.index, microbatch))
            return _leaves(value, requires_grad)
        try:
            return self._receive(channel, microbatch, requires_grad)
        except comm.P2PError as exc:
            cause = (f"stage {channel.src_stage} on rank {channel.src_rank} never sent "
                     f"{channel.label(microbatch)}: {exc.reason}")
            raise RemoteFailure(cause, True, channel.src_stage, channel.src_rank,
                                f"while waiting for {channel.label(microbatch)} from rank {channel.src_rank}") from exc

    def _receive(self, channel: Channel, microbatch: int, requires_grad: bool) -> Any:
        tag, label, src = self.tag(channel, microbatch), channel.label(microbatch), channel.src_rank
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        status, meta_size, count, origin_stage, origin_rank = \
            comm.irecv(header, src, self.group, tag=tag, label=label).wait().tolist()
        meta = b""
        if meta_size:
            buf = torch.empty(meta_size, dtype=torch.uint8, device=self.device)
            meta = bytes(comm.irecv(buf, src, self.group, tag=tag, label=label).wait().cpu().numpy().tobytes())
        if status != OK:
            raise RemoteFailure(meta.decode(errors="replace"), status == DIED, origin_stage, origin_rank,
                                f"while waiting for {label} from rank {src}")
        skeleton, specs = pickle.loads(meta)
        if len(specs) != count:
            raise RuntimeError(f"{label} from rank {src} is malformed: header says {count} tensors, metadata "
                               f"{len(specs)}; report this as a bug")
        tensors = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
                   for shape, dtype in specs]
        works = [comm.irecv(t, src, self.group, tag=tag, label=label) for t in tensors if t.numel() > 0]
        for work in works:
            work.wait()
        tensors = [t.view(torch.bool) if dtype == torch.bool else t for t, (_, dtype) in zip(tensors, specs)]
        return _leaves(_unflatten(skeleton, tensors, self.tp_mesh, label), requires_grad)


def _flatten(value: Any) -> tuple[Any, list[Tensor]]:
    tensors: list[Tensor] = []

    def slot(v: Any) -> Any:
        if isinstance(v, DTensor):
            tensors.append(v.to_local().detach())
            return _DSlot(len(tensors) - 1, tuple(v.placements), v.shard_order, tuple(v.shape))
        if isinstance(v, Tensor):
            tensors.append(v.detach())
            return _Slot(len(tensors) - 1)
        return v

    skeleton = tuple(slot(v) for v in value) if isinstance(value, tuple) else slot(value)
    return skeleton, tensors


def _unflatten(skeleton: Any, tensors: list[Tensor], tp_mesh: Any = None, label: str = "a message") -> Any:
    def fill(v: Any) -> Any:
        if isinstance(v, _DSlot):
            if tp_mesh is None:
                raise TypeError(f"{label} is a DTensor, but this stage has no tensor-parallel mesh to put it on: give "
                                "DistributedPipe a mesh with a tp dim (and a tp_plan), or send plain tensors")
            return from_local(tensors[v.k], tp_mesh, v.placements, shape=v.shape, stride=contiguous_strides(v.shape),
                              shard_order=v.shard_order)
        return tensors[v.k] if isinstance(v, _Slot) else v

    return tuple(fill(v) for v in skeleton) if isinstance(skeleton, tuple) else fill(skeleton)


def _wire_view(t: Tensor) -> Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _detached(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(v.detach() if isinstance(v, Tensor) else v for v in value)
    return value.detach() if isinstance(value, Tensor) else value


def _leaves(value: Any, requires_grad: bool) -> Any:
    """`value` with its floating tensors made leaves that require grad (when asked)."""
    def leaf(v: Any) -> Any:
        if isinstance(v, Tensor) and requires_grad and (v.is_floating_point() or v.is_complex()):
            return v.detach().requires_grad_(True)
        return v

    return tuple(leaf(v) for v in value) if isinstance(value, tuple) else leaf(value)
