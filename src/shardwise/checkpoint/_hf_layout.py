"""Where each byte of a Hugging Face safetensors directory goes, from global shapes and dtypes alone.

A safetensors file is an 8-byte little-endian length, a JSON header naming each tensor's
dtype, shape and byte range (`data_offsets`, counted from the end of the header), then the
tensors' bytes, row-major, back to back. Nothing in the header depends on the values, so
every rank computes the same layout from the global shapes and dtypes and writes the bytes
of its own pieces at their offsets: no rank gathers a whole tensor.

Tensors go to files in state-dict order; the next tensor starts a new file when it would
take the current one past `max_shard_size` (a tensor larger than that gets a file of its
own), as transformers splits a model. One file is `model.safetensors`; several are
`model-0000k-of-0000n.safetensors`, with `model.safetensors.index.json` naming each
tensor's file. Inside a file, tensors are ordered by element size, largest first, then by
name (as the safetensors package writes them), so each starts aligned to its element size;
the header is padded with spaces to a multiple of 8 bytes.

>>> files = plan_files([("a", (2, 3), torch.float32), ("b", (5,), torch.bfloat16), ("c", (4,), torch.float32)], 30)
>>> [(f.name, [(s.name, s.begin - len(f.header), s.nbytes) for s in f.slots]) for f in files]
[('model-00001-of-00002.safetensors', [('a', 0, 24)]), ('model-00002-of-00002.safetensors', [('c', 0, 16), ('b', 16, 10)])]
>>> json.loads(files[1].header[8:])["b"]
{'dtype': 'BF16', 'shape': [5], 'data_offsets': [16, 26]}
>>> parse_size("500MB"), parse_size("2KiB"), parse_size(7)
(500000000, 2048, 7)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX", "SINGLE", "FileLayout", "Slot", "index_json", "parse_size",
           "plan_files", "safetensors_dtype"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers' default for save_pretrained

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of `dtype`; TypeError for a dtype safetensors cannot hold."""
    if dtype not in _DTYPES:
        raise TypeError(f"safetensors has no dtype for {dtype}: it holds {', '.join(map(str, _DTYPES))}; "
                        f"convert the tensor first")
    return _DTYPES[dtype]


def parse_size(size: Union[int, str]) -> int:
    """Bytes in `size`: an int, or a string such as "5GB" (10**9) or "500MiB" (2**20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", size, re.IGNORECASE) if isinstance(size, str) else None
    if found is None or float(found[1]) <= 0:
        raise ValueError(f"max_shard_size must be a positive int of bytes or a size such as '5GB' or '500MiB' "
                         f"(units {', '.join(_UNITS)}), got {size!r}")
    return int(float(found[1]) * _UNITS[found[2].upper()])


@dataclass(frozen=True)
class Slot:
    """A tensor's place in its file: `begin` is the byte offset of its first element from the
    start of the file."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    nbytes: int


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its name, its first bytes (length and header), its tensors."""

    name: str
    header: bytes
    slots: tuple[Slot, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(s.nbytes for s in self.slots)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_files(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
               max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> list[FileLayout]:
    """The files of a directory holding `tensors` (name, global shape, dtype), in order."""
    limit = parse_size(max_shard_size)
    groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
    size = 0
    for name, shape, dtype in tensors:
        safetensors_dtype(dtype)
        n = _nbytes(shape, dtype)
        if not groups or size + n > limit and size > 0:
            groups.append([])
            size = 0
        groups[-1].append((name, tuple(shape), dtype))
        size += n
    if len(groups) == 1:
        return [_layout(SINGLE, groups[0])]
    return [_layout(f"model-{k:05d}-of-{len(groups):05d}.safetensors", group) for k, group in enumerate(groups, 1)]


def _layout(name: str, group: list[tuple[str, tuple[int, ...], torch.dtype]]) -> FileLayout:
    ordered = sorted(group, key=lambda t: (-t[2].itemsize, t[0]))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor, shape, dtype in ordered:
        n = _nbytes(shape, dtype)
        header[tensor] = {"dtype": safetensors_dtype(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    slots, begin = [], len(head)
    for tensor, shape, dtype in ordered:
        slots.append(Slot(tensor, shape, dtype, begin, _nbytes(shape, dtype)))
        begin += slots[-1].nbytes
    return FileLayout(name, head, tuple(slots))


def index_json(files: Sequence[FileLayout]) -> bytes:
    """`model.safetensors.index.json` for `files`: the total bytes of tensors and each one's file."""
    weight_map = {s.name: f.name for f in files for s in f.slots}
    total = sum(s.nbytes for f in files for s in f.slots)
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(body, indent=2) + "\n").encode()

