"""A pipeline message as bytes: its header's words, its value's skeleton and tensors.

A message (see `_wire`) is a header of `HEADER` int64 words (status, metadata size, tensor
count, origin of a failure, whether the payloads follow inside it, then the pickled metadata
when it fits in `INLINE` bytes), and one payload per non-empty tensor, which a small value
carries inside the header message itself (a header receive always posts `PACKED` bytes).
The metadata is the value's skeleton (a tensor, None, or a tuple, each tensor replaced by a
`Slot`, a DTensor's by a `DSlot` that remembers its layout) with each tensor's shape and
dtype. These functions make and read those pieces; `Wire` moves them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._layout import contiguous_strides
from .._tensor import DTensor, from_local

__all__ = ["DIED", "DSlot", "FAILED", "FIELDS", "HEADER", "INLINE", "OK", "PACKED", "Slot", "box_shape",
           "describe_specs", "detached", "dtensors_of", "fill", "flatten", "header_words", "leaves", "packed_size",
           "padded", "slots_of", "unflatten", "unpack", "wire_view"]

OK, FAILED, DIED = 0, 1, 2
HEADER = 64  # int64 words: status, metadata bytes, tensor count, origin stage, origin rank, payloads inside, metadata
FIELDS = 6
INLINE = (HEADER - FIELDS) * 8  # metadata bytes the header carries itself (a longer one follows it)
PACKED = 64 * 1024  # bytes of a header message with its payloads inside: every header receive posts this many
_ALIGN = 16


@dataclass(frozen=True)
class Slot:
    """Where tensor number `k` of a message goes back into its value."""

    k: int


@dataclass(frozen=True)
class DSlot(Slot):
    """Tensor number `k` is this rank's piece of a DTensor of `shape` in `placements`: it
    becomes one again on the receiving stage's tensor-parallel mesh (the matching rank of
    the same coordinate holds the same piece there, so nothing is gathered)."""

    placements: tuple[Any, ...]
    shard_order: Any
    shape: tuple[int, ...]


def flatten(value: Any) -> tuple[Any, list[Tensor]]:
    """A message's value as its skeleton and its tensors (a DTensor's as this rank's piece)."""
    tensors: list[Tensor] = []

    def slot(v: Any) -> Any:
        if isinstance(v, DTensor):
            tensors.append(v.to_local().detach())
            return DSlot(len(tensors) - 1, tuple(v.placements), v.shard_order, tuple(v.shape))
        if isinstance(v, Tensor):
            tensors.append(v.detach())
            return Slot(len(tensors) - 1)
        return v

    skeleton = tuple(slot(v) for v in value) if isinstance(value, tuple) else slot(value)
    return skeleton, tensors


def padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def packed_size(tensors: list[Tensor]) -> int:
    return sum(padded(t.numel() * t.element_size()) for t in tensors)


def header_words(fields: list[int], meta: bytes, tensors: list[Tensor], device: torch.device) -> Tensor:
    """A header message: its fields, its metadata (when given: it fits `INLINE` bytes), then
    `tensors` (contiguous, non-empty), each from an `_ALIGN`-byte boundary; bytes on `device`."""
    words = torch.zeros(HEADER, dtype=torch.int64)
    words[:FIELDS] = torch.tensor(fields, dtype=torch.int64)
    if meta:
        words[FIELDS:].view(torch.uint8)[:len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    if not tensors:
        return words.view(torch.uint8).to(device)
    out = torch.zeros(HEADER * 8 + packed_size(tensors), dtype=torch.uint8, device=device)
    out[:HEADER * 8] = words.view(torch.uint8).to(device)
    at = HEADER * 8
    for t in tensors:
        n = t.numel() * t.element_size()
        if not t.is_meta:  # (a dry run's message: its size is right, its bytes are not data)
            out[at:at + n] = t.reshape(-1).view(torch.uint8)
        at += padded(n)
    return out


def unpack(message: Tensor, specs: list[Any], device: torch.device) -> list[Tensor]:
    """The tensors of `specs` ((shape, dtype) each; bools as bytes) from a header message that
    carries them (see `header_words`), copied out of it; empty ones made anew."""
    at, out = HEADER * 8, []
    for shape, dtype in specs:
        wire = torch.uint8 if dtype == torch.bool else dtype
        t = torch.empty(shape, dtype=wire, device=device)
        n = t.numel() * t.element_size()
        if n:
            t.copy_(message[at:at + n].view(wire).view(shape))
            at += padded(n)
        out.append(t.view(torch.bool) if dtype == torch.bool else t)
    return out


def describe_specs(specs: list[Any]) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for shape, dtype in specs) or "none"


def slots_of(skeleton: Any) -> list[Slot]:
    """The tensor slots of a message's skeleton, in tensor order."""
    slots = [v for v in (skeleton if isinstance(skeleton, tuple) else (skeleton,)) if isinstance(v, Slot)]
    return sorted(slots, key=lambda v: v.k)


def dtensors_of(value: Any) -> dict[int, DTensor]:
    """The DTensors of a message's value, by tensor number (as `flatten` numbers them)."""
    values = value if isinstance(value, tuple) else (value,)
    tensors = [v for v in values if isinstance(v, Tensor)]
    return {k: v for k, v in enumerate(tensors) if isinstance(v, DTensor)}


def fill(skeleton: Any, tensors: list[Tensor]) -> Any:
    """The value of a message from its skeleton and its tensors, already made (DTensors too)."""
    def one(v: Any) -> Any:
        return tensors[v.k] if isinstance(v, Slot) else v

    return tuple(one(v) for v in skeleton) if isinstance(skeleton, tuple) else one(skeleton)


def box_shape(box: Any) -> tuple[int, ...]:
    return tuple(length for _, length in box)


def unflatten(skeleton: Any, tensors: list[Tensor], tp_mesh: Any = None, label: str = "a message") -> Any:
    """The value of a message from its skeleton and its received tensors: a DTensor's piece
    becomes a DTensor again on `tp_mesh` (the receiving stage's tensor-parallel mesh)."""
    def one(v: Any) -> Any:
        if isinstance(v, DSlot):
            if tp_mesh is None:
                raise TypeError(f"{label} is a DTensor, but this stage has no tensor-parallel mesh to put it on: give "
                                "DistributedPipe a mesh with a tp dim (and a tp_plan), or send plain tensors")
            return from_local(tensors[v.k], tp_mesh, v.placements, shape=v.shape, stride=contiguous_strides(v.shape),
                              shard_order=v.shard_order)
        return tensors[v.k] if isinstance(v, Slot) else v

    return tuple(one(v) for v in skeleton) if isinstance(skeleton, tuple) else one(skeleton)


def wire_view(t: Tensor) -> Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def detached(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(v.detach() if isinstance(v, Tensor) else v for v in value)
    return value.detach() if isinstance(value, Tensor) else value


def leaves(value: Any, requires_grad: bool) -> Any:
    """`value` with its floating tensors made leaves that require grad (when asked)."""
    def leaf(v: Any) -> Any:
        if isinstance(v, Tensor) and requires_grad and (v.is_floating_point() or v.is_complex()):
            return v.detach().requires_grad_(True)
        return v

    return tuple(leaf(v) for v in value) if isinstance(value, tuple) else leaf(value)
