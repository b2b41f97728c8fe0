"""One rank's end of a pipe's point-to-point messages: tagged transfers of headers and payloads.

`Link` is the transport under `Wire`: it posts a message's header (with its metadata, and
its payloads when they fit: see `_message`) and payloads under the message's tag
(`micro-batch * channels + channel`), reads a header back (raising `RemoteFailure` when it
reports a sender's failure), receives a message's payloads, and keeps the step's sends,
waited at the step's end, and the header receives a replay posts ahead. It knows bytes and
tags, not values: `Wire` turns values into messages and back.
"""

from __future__ import annotations

import math
import pickle
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _comm as comm
from ._channels import Channel
from ._message import DIED, FAILED, FIELDS, HEADER, INLINE, OK, PACKED, header_words, packed_size, padded, unpack

__all__ = ["Header", "Link", "RemoteFailure", "never_sent"]

Header = tuple[Any, list[Any], bytes, Optional[list[Tensor]]]  # skeleton, (shape, dtype)s, metadata, tensors inside


class RemoteFailure(Exception):
    """Raised by `Wire` when the awaited message says its sender failed, or a message could
    not be received or sent. `cause` describes the first failure (stage, rank, what), `died`
    whether a process may be gone, `doing` what this rank was doing ("waiting for ...")."""

    def __init__(self, cause: str, died: bool, origin_stage: int, origin_rank: int, doing: str = "") -> None:
        super().__init__(cause)
        self.cause, self.died = cause, died
        self.origin_stage, self.origin_rank = origin_stage, origin_rank
        self.doing = doing


class Link:
    """Tagged point-to-point transfers over `group` for one rank (tensors on `device`)."""

    def __init__(self, group: Any, device: torch.device, num_channels: int) -> None:
        self.group = group
        self.device = device
        # headers and metadata are bytes to read: on the CPU when tensors are meta (a dry run's pipe)
        self.small_device = torch.device("cpu") if device.type == "meta" else device
        self.num_channels = num_channels
        self.pending: list[comm.P2PWork] = []  # sends of this step, waited at its end
        self.prefetched: dict[tuple[int, int, int], comm.P2PWork] = {}  # header receives posted ahead (a replay's)

    def tag(self, channel: Channel, microbatch: int) -> int:
        return microbatch * self.num_channels + channel.index

    # -- sending ------------------------------------------------------------------------------

    def post(self, channel: Channel, microbatch: int, header: Optional[list[int]], meta: bytes,
             tensors: list[Tensor], dst: Optional[int] = None, pack: bool = True) -> None:
        """Post a header (None: none) with `meta`, then `tensors`; with `pack`, tensors that fit
        travel inside the header's message (see `_message`)."""
        tag, label = self.tag(channel, microbatch), channel.label(microbatch)
        dst = channel.dst_rank if dst is None else dst
        parts: list[Tensor] = []
        if header is not None:
            inline_meta = len(meta) <= INLINE
            packed = pack and inline_meta and tensors and HEADER * 8 + packed_size(tensors) <= PACKED
            parts.append(header_words(header[:FIELDS - 1] + [int(bool(packed))], meta if inline_meta else b"",
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

    def post_failure(self, channel: Channel, microbatch: int, failure: RemoteFailure) -> None:
        """A *failed* header, with the cause as its metadata, to every receiver of `channel`."""
        text = failure.cause.encode()
        for dst in channel.dst_ranks or (channel.dst_rank,):
            self.post(channel, microbatch, [DIED if failure.died else FAILED, len(text), 0, failure.origin_stage,
                                            failure.origin_rank, 0], text, [], dst=dst)

    def finish(self) -> None:
        """Wait for every send of the step (each has a matching receive when the step succeeded)."""
        pending, self.pending = self.pending, []
        for work in pending:
            work.wait()

    def abandon(self) -> list[comm.P2PWork]:
        """Forget the step's sends and the header receives posted ahead; return them."""
        pending, self.pending = self.pending + list(self.prefetched.values()), []
        self.prefetched.clear()
        return pending

    # -- receiving ----------------------------------------------------------------------------

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
                          record=False)  # recorded with the message's own size (`header`)

    def header(self, channel: Channel, microbatch: int, src: int) -> Header:
        """The header and metadata from `src`: the value's skeleton, its tensors' (shape, dtype),
        the raw metadata, and the tensors when they came inside the header (else None);
        RemoteFailure when the sender reports a failure."""
        tag, label = self.tag(channel, microbatch), channel.label(microbatch)
        posted = self.prefetched.pop((channel.index, microbatch, src), None)
        if posted is None:
            posted = self._post_header(channel, microbatch, src)
        message = posted.wait()
        header = message[:HEADER * 8].cpu().view(torch.int64)
        status, meta_size, count, origin_stage, origin_rank, packed = header[:FIELDS].tolist()
        if meta_size <= INLINE:
            meta = header[FIELDS:].numpy().tobytes()[:meta_size]
        else:
            buf = torch.empty(meta_size, dtype=torch.uint8, device=self.small_device)
            meta = bytes(comm.irecv(buf, src, self.group, tag=tag, label=label).wait().cpu().numpy().tobytes())
        if status != OK:
            comm.received(posted, HEADER * 8)
            raise RemoteFailure(meta.decode(errors="replace"), status == DIED, origin_stage, origin_rank,
                                f"while waiting for {label} from rank {src}")
        skeleton, specs = pickle.loads(meta)
        comm.received(posted, HEADER * 8 + (sum(padded(math.prod(shape) * dtype.itemsize) for shape, dtype in specs)
                                            if packed else 0))
        if len(specs) != count:
            raise RuntimeError(f"{label} from rank {src} is malformed: header says {count} tensors, metadata "
                               f"{len(specs)}; report this as a bug")
        return skeleton, specs, meta, unpack(message, specs, self.device) if packed else None

    def payloads(self, channel: Channel, microbatch: int, specs: list[Any]) -> list[Tensor]:
        """The tensors of a message whose metadata said `specs`, received from its one sender."""
        tag, label, src = self.tag(channel, microbatch), channel.label(microbatch), channel.src_rank
        tensors = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
                   for shape, dtype in specs]
        works = [comm.irecv(t, src, self.group, tag=tag, label=label) for t in tensors if t.numel() > 0]
        for work in works:
            work.wait()
        return [t.view(torch.bool) if dtype == torch.bool else t for t, (_, dtype) in zip(tensors, specs)]


def never_sent(channel: Channel, microbatch: int, src: int, exc: comm.P2PError) -> RemoteFailure:
    """The failure to relay when `src` never sent `channel`'s message (its process may be gone)."""
    cause = f"stage {channel.src_stage} on rank {src} never sent {channel.label(microbatch)}: {exc.reason}"
    return RemoteFailure(cause, True, channel.src_stage, src,
                         f"while waiting for {channel.label(microbatch)} from rank {src}")
