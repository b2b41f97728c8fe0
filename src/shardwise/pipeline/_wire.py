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
the same rank never touch the network: they wait in a mailbox.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _comm as comm
from .._layout import contiguous_strides
from .._redistribute._cross import _volume
from .._tensor import DTensor, from_local
from .._tensor._cross import _region
from .._tensor._compile_comm import current_trace
from .._tensor._redistribute import redistribute_local
from ._channels import Channel, ChannelPlan
from ._crossing import Crossing, crossing, landing, spec_on
from ._replay import ReplayedStep

__all__ = ["Channel", "ChannelPlan", "PipelineError", "RemoteFailure", "Wire"]

OK, FAILED, DIED = 0, 1, 2
HEADER = 64  # int64 words: status, metadata bytes, tensor count, origin stage, origin rank, payloads inside, metadata
_FIELDS = 6
INLINE = (HEADER - _FIELDS) * 8  # metadata bytes the header carries itself (a longer one follows it)
PACKED = 64 * 1024  # bytes of a header message with its payloads inside: every header receive posts this many
_ALIGN = 16


class PipelineError(RuntimeError):
    """A pipeline step could not finish on this rank because a stage elsewhere failed (or
    its process died); the message names this stage and rank, the micro-batch, what it
    was waiting for, and the stage where the failure began."""


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
        # headers and metadata are bytes to read: on the CPU when tensors are meta (a dry run's pipe)
        self.small_device = torch.device("cpu") if device.type == "meta" else device
        self.tp_mesh = tp_mesh  # where DTensors that arrive live (the stage's tensor-parallel sub-mesh)
        self.num_channels = num_channels
        self.pending: list[comm.P2PWork] = []  # sends of this step, waited at its end
        self.mailbox: dict[tuple[int, int], Any] = {}
        self.traced: Optional[ReplayedStep] = None  # the step `shardwise.compile` is tracing (see `_replay`)
        self.prefetched: dict[tuple[int, int, int], comm.P2PWork] = {}  # header receives posted ahead (a replay's)

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
        if channel.crossing:
            self._send_across(channel, microbatch, value, skeleton, tensors, meta)
            return
        header, payload = [OK, len(meta), len(tensors), -1, -1, 0], [_wire_view(t) for t in tensors if t.numel() > 0]
        step, trace = self.traced, current_trace()
        if step is None or trace is None:
            self._post(channel, microbatch, header, meta, payload)
            return
        k = step.k

        def post(parts: list[Tensor]) -> list[Tensor]:  # at the trace and at every replay
            step.at(k)
            self._post(channel, microbatch, header, meta, parts)
            step.sent.add((channel.index, microbatch))
            return []

        trace.host(post, payload)

    def _send_across(self, channel: Channel, microbatch: int, value: Any, skeleton: Any, tensors: list[Tensor],
                     meta: bytes) -> None:
        """Every rank of the receiving row gets the header and metadata; then each tensor's
        boxes go where the cross-mesh plan sends them (Partials reduced on this row first)."""
        pieces: list[tuple[Tensor, Crossing]] = []
        for slot, t in zip(_slots(skeleton), tensors):
            if isinstance(slot, _DSlot) and self.tp_mesh is not None:
                dtensor = _dtensors(value)[slot.k]
                if dtensor.device_mesh != self.tp_mesh:
                    raise TypeError(f"{channel.label(microbatch)} holds a DTensor on {dtensor.device_mesh}, not on the "
                                    f"stage's tensor-parallel mesh {self.tp_mesh}: a stage's outputs live on its "
                                    "own tp mesh (redistribute(device_mesh=...) it there first)")
            placements = slot.placements if isinstance(slot, _DSlot) else None
            move = crossing(slot.shape if isinstance(slot, _DSlot) else tuple(t.shape), t.dtype, placements,
                            slot.shard_order if isinstance(slot, _DSlot) else (), channel.src_ranks, channel.dst_ranks)
            if isinstance(slot, _DSlot) and move.before != (slot.placements, slot.shard_order):
                placed, order = move.before  # a collective of this row (every rank of it sends alike)
                t = redistribute_local(t, spec_on(self.tp_mesh, slot.placements, slot.shape, t.dtype, slot.shard_order),
                                       spec_on(self.tp_mesh, placed, slot.shape, t.dtype, order))
            pieces.append((_wire_view(t), move))
        for dst in channel.dst_ranks:
            self._post(channel, microbatch, [OK, len(meta), len(tensors), -1, -1, 0], meta, [], dst=dst, pack=False)
        for piece, move in pieces:
            for peer, box in move.routes.sends:
                if _volume(box):
                    self._post(channel, microbatch, None, b"", [_region(piece, box).contiguous()], dst=peer, pack=False)

    def send_failure(self, channel: Channel, microbatch: int, failure: RemoteFailure) -> None:
        """Tell `channel`'s receiver that this step failed (instead of the message it expects)."""
        if channel.local:
            return
        text = failure.cause.encode()
        for dst in channel.dst_ranks or (channel.dst_rank,):
            self._post(channel, microbatch, [DIED if failure.died else FAILED, len(text), 0, failure.origin_stage,
                                             failure.origin_rank, 0], text, [], dst=dst)

    def _post(self, channel: Channel, microbatch: int, header: Optional[list[int]], meta: bytes,
              tensors: list[Tensor], dst: Optional[int] = None, pack: bool = True) -> None:
        """Post a header (None: none) with `meta`, then `tensors`; with `pack`, tensors that fit
        travel inside the header's message (see the module docstring)."""
        tag, label = self.tag(channel, microbatch), channel.label(microbatch)
        dst = channel.dst_rank if dst is None else dst
        parts: list[Tensor] = []
        if header is not None:
            inline_meta = len(meta) <= INLINE
            packed = pack and inline_meta and tensors and HEADER * 8 + _packed_size(tensors) <= PACKED
            parts.append(_header_words(header[:_FIELDS - 1] + [int(bool(packed))], meta if inline_meta else b"",
                                       tensors if packed else [], self.small_device))
            if not inline_meta:
                parts.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.small_device))
            if packed:
                tensors = []
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
        """Forget the step's sends and the header receives posted ahead (after a failure some will
        never complete); return them so the caller can keep their buffers alive."""
        pending, self.pending = self.pending + list(self.prefetched.values()), []
        self.mailbox.clear()
        self.prefetched.clear()
        return pending

    def prefetch(self, receives: list[tuple[Channel, int]]) -> None:
        """Post the header receive of each (channel, micro-batch) now: a header's receive is always
        `PACKED` bytes, so a replay, which knows every receive of its step, posts them all at its
        start and each message is there by the time its stage asks for it."""
        for channel, microbatch in receives:
            key = (channel.index, microbatch, channel.src_rank)
            if key not in self.prefetched:  # (a function stepping the pipe twice: its second step posts its own)
                self.prefetched[key] = self._post_header(channel, microbatch, channel.src_rank)

    def _post_header(self, channel: Channel, microbatch: int, src: int) -> comm.P2PWork:
        buf = torch.empty(PACKED, dtype=torch.uint8, device=self.small_device)
        return comm.irecv(buf, src, self.group, tag=self.tag(channel, microbatch), label=channel.label(microbatch),
                          record=False)  # recorded with the message's own size (`_header`)

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, channel: Channel, microbatch: int, *, requires_grad: bool) -> Any:
        """The value sent on `channel` for `microbatch`; floating tensors become leaves that
        require grad when `requires_grad`. Raises `RemoteFailure` when the sender failed."""
        if channel.local:
            value = self.mailbox.pop((channel.index, microbatch))
            return _leaves(value, requires_grad)
        try:
            if channel.crossing:
                return self._receive_across(channel, microbatch, requires_grad)
            return self._receive(channel, microbatch, requires_grad)
        except comm.P2PError as exc:
            raise _never_sent(channel, microbatch, channel.src_rank, exc) from exc

    def _header(self, channel: Channel, microbatch: int, src: int) -> tuple[Any, list[Any], bytes,
                                                                             Optional[list[Tensor]]]:
        """The header and metadata from `src`: the value's skeleton, its tensors' (shape, dtype),
        the raw metadata, and the tensors when they came inside the header (else None);
        RemoteFailure when the sender reports a failure."""
        tag, label = self.tag(channel, microbatch), channel.label(microbatch)
        posted = self.prefetched.pop((channel.index, microbatch, src), None)
        if posted is None:
            posted = self._post_header(channel, microbatch, src)
        message = posted.wait()
        header = message[:HEADER * 8].cpu().view(torch.int64)
        status, meta_size, count, origin_stage, origin_rank, packed = header[:_FIELDS].tolist()
        if meta_size <= INLINE:
            meta = header[_FIELDS:].numpy().tobytes()[:meta_size]
        else:
            buf = torch.empty(meta_size, dtype=torch.uint8, device=self.small_device)
            meta = bytes(comm.irecv(buf, src, self.group, tag=tag, label=label).wait().cpu().numpy().tobytes())
        if status != OK:
            comm.received(posted, HEADER * 8)
            raise RemoteFailure(meta.decode(errors="replace"), status == DIED, origin_stage, origin_rank,
                                f"while waiting for {label} from rank {src}")
        skeleton, specs = pickle.loads(meta)
        comm.received(posted, HEADER * 8 + (sum(_padded(math.prod(shape) * dtype.itemsize) for shape, dtype in specs)
                                            if packed else 0))
        if len(specs) != count:
            raise RuntimeError(f"{label} from rank {src} is malformed: header says {count} tensors, metadata "
                               f"{len(specs)}; report this as a bug")
        return skeleton, specs, meta, _unpack(message, specs, self.device) if packed else None

    def _receive(self, channel: Channel, microbatch: int, requires_grad: bool) -> Any:
        label, src = channel.label(microbatch), channel.src_rank
        step, trace = self.traced, current_trace()
        if step is None or trace is None:
            skeleton, specs, _, inside = self._header(channel, microbatch, src)
            tensors = self._payloads(channel, microbatch, specs) if inside is None else inside
            return _leaves(_unflatten(skeleton, tensors, self.tp_mesh, label), requires_grad)
        k, traced = step.k, dict[str, Any]()
        step.receives.append((channel, microbatch))

        def receive(_: list[Tensor]) -> list[Tensor]:  # at the trace and at every replay
            step.at(k)
            skeleton, specs, meta, inside = self._header(channel, microbatch, src)
            if traced.setdefault("meta", meta) != meta:
                _, was = pickle.loads(traced["meta"])
                raise RuntimeError(f"{label} from rank {src} holds tensors {_specs(specs)}, but this rank's compiled "
                                   f"step was traced receiving {_specs(was)}: the ranks called it with different "
                                   "shapes; call the step with the same batch shapes on every pp rank")
            traced["skeleton"] = skeleton
            return self._payloads(channel, microbatch, specs) if inside is None else inside

        tensors = trace.host(receive, [])
        return _leaves(_unflatten(traced["skeleton"], tensors, self.tp_mesh, label), requires_grad)

    def _payloads(self, channel: Channel, microbatch: int, specs: list[Any]) -> list[Tensor]:
        """The tensors of a message whose metadata said `specs`, received from its one sender."""
        tag, label, src = self.tag(channel, microbatch), channel.label(microbatch), channel.src_rank
        tensors = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
                   for shape, dtype in specs]
        works = [comm.irecv(t, src, self.group, tag=tag, label=label) for t in tensors if t.numel() > 0]
        for work in works:
            work.wait()
        return [t.view(torch.bool) if dtype == torch.bool else t for t, (_, dtype) in zip(tensors, specs)]

    def _receive_across(self, channel: Channel, microbatch: int, requires_grad: bool) -> Any:
        """Every sending rank's header first (any of them may report a failure), then this
        rank's boxes of each tensor from the senders the cross-mesh plan deals them to."""
        tag, label = self.tag(channel, microbatch), channel.label(microbatch)
        skeleton: Any = None
        specs: list[tuple[tuple[int, ...], torch.dtype]] = []
        for src in channel.src_ranks:  # the first failure reported (or a sender gone) stops the wait
            try:
                found = self._header(channel, microbatch, src)
            except comm.P2PError as exc:
                raise _never_sent(channel, microbatch, src, exc) from exc
            if skeleton is None:
                skeleton, specs, _, _ = found
        tensors = []
        for slot, (shape, dtype) in zip(_slots(skeleton), specs):
            placements = slot.placements if isinstance(slot, _DSlot) else None
            move = crossing(slot.shape if isinstance(slot, _DSlot) else tuple(shape), dtype, placements,
                            slot.shard_order if isinstance(slot, _DSlot) else (), channel.src_ranks, channel.dst_ranks)
            wire_dtype = torch.uint8 if dtype == torch.bool else dtype
            out = torch.empty(move.routes.out_shape, dtype=wire_dtype, device=self.device)
            works = [(src, box, comm.irecv(torch.empty(_box_shape(box), dtype=wire_dtype, device=self.device), src,
                                           self.group, tag=tag, label=label))
                     for src, box in move.routes.recvs if _volume(box)]
            for src, box, work in works:
                try:
                    _region(out, box).copy_(work.wait())
                except comm.P2PError as exc:
                    raise _never_sent(channel, microbatch, src, exc) from exc
            out = out.view(torch.bool) if dtype == torch.bool else out
            if isinstance(slot, _DSlot):
                assert self.tp_mesh is not None
                out = from_local(out, self.tp_mesh, landing(slot.placements), shape=slot.shape,
                                 stride=contiguous_strides(slot.shape))
            tensors.append(out)
        return _leaves(_fill(skeleton, tensors), requires_grad)


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


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed_size(tensors: list[Tensor]) -> int:
    return sum(_padded(t.numel() * t.element_size()) for t in tensors)


def _header_words(fields: list[int], meta: bytes, tensors: list[Tensor], device: torch.device) -> Tensor:
    """A header message: its fields, its metadata (when given: it fits `INLINE` bytes), then
    `tensors` (contiguous, non-empty), each from an `_ALIGN`-byte boundary; bytes on `device`."""
    words = torch.zeros(HEADER, dtype=torch.int64)
    words[:_FIELDS] = torch.tensor(fields, dtype=torch.int64)
    if meta:
        words[_FIELDS:].view(torch.uint8)[:len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    if not tensors:
        return words.view(torch.uint8).to(device)
    out = torch.zeros(HEADER * 8 + _packed_size(tensors), dtype=torch.uint8, device=device)
    out[:HEADER * 8] = words.view(torch.uint8).to(device)
    at = HEADER * 8
    for t in tensors:
        n = t.numel() * t.element_size()
        if not t.is_meta:  # (a dry run's message: its size is right, its bytes are not data)
            out[at:at + n] = t.reshape(-1).view(torch.uint8)
        at += _padded(n)
    return out


def _unpack(message: Tensor, specs: list[Any], device: torch.device) -> list[Tensor]:
    """The tensors of `specs` ((shape, dtype) each; bools as bytes) from a header message that
    carries them (see `_header_words`), copied out of it; empty ones made anew."""
    at, out = HEADER * 8, []
    for shape, dtype in specs:
        wire = torch.uint8 if dtype == torch.bool else dtype
        t = torch.empty(shape, dtype=wire, device=device)
        n = t.numel() * t.element_size()
        if n:
            t.copy_(message[at:at + n].view(wire).view(shape))
            at += _padded(n)
        out.append(t.view(torch.bool) if dtype == torch.bool else t)
    return out


def _specs(specs: list[Any]) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for shape, dtype in specs) or "none"


def _never_sent(channel: Channel, microbatch: int, src: int, exc: comm.P2PError) -> RemoteFailure:
    cause = f"stage {channel.src_stage} on rank {src} never sent {channel.label(microbatch)}: {exc.reason}"
    return RemoteFailure(cause, True, channel.src_stage, src,
                         f"while waiting for {channel.label(microbatch)} from rank {src}")


def _slots(skeleton: Any) -> list[_Slot]:
    """The tensor slots of a message's skeleton, in tensor order."""
    slots = [v for v in (skeleton if isinstance(skeleton, tuple) else (skeleton,)) if isinstance(v, _Slot)]
    return sorted(slots, key=lambda v: v.k)


def _dtensors(value: Any) -> dict[int, DTensor]:
    """The DTensors of a message's value, by tensor number (as `_flatten` numbers them)."""
    values = value if isinstance(value, tuple) else (value,)
    tensors = [v for v in values if isinstance(v, Tensor)]
    return {k: v for k, v in enumerate(tensors) if isinstance(v, DTensor)}


def _fill(skeleton: Any, tensors: list[Tensor]) -> Any:
    """The value of a message from its skeleton and its tensors, already made (DTensors too)."""
    def fill(v: Any) -> Any:
        return tensors[v.k] if isinstance(v, _Slot) else v

    return tuple(fill(v) for v in skeleton) if isinstance(skeleton, tuple) else fill(skeleton)


def _box_shape(box: Any) -> tuple[int, ...]:
    return tuple(length for _, length in box)


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
