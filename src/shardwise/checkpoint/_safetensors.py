"""Reading a safetensors file's header, checked, and the byte runs of a box of one of its tensors.

A safetensors file is an 8-byte little-endian header length `n`, `n` bytes of JSON, then
the data: per tensor name its `dtype` (a name such as "BF16"), `shape` and `data_offsets`
(begin and end, counted from the start of the data), and an optional `__metadata__` map of
strings. The tensors' bytes lie row-major and back to back, covering the data exactly.

Nothing here trusts the header: `read_header` checks, before any tensor is read, that it is
a JSON object of well-formed entries, that each tensor's byte count is its element count
times its element size, and that the ranges tile the data exactly (no gap, no overlap, none
past the end of the file, so a truncated file is caught here). Every problem names the file
and the tensor.

>>> import json, struct, tempfile, os
>>> body = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
>>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
>>> with open(path, "wb") as f:
...     _ = f.write(struct.pack("<Q", len(body)) + body + bytes(24))
>>> h = read_header(path)
>>> h.tensors["w"].shape, h.tensors["w"].dtype, h.data_start == 8 + len(body)
((2, 3), torch.float32, True)
>>> with open(path, "r+b") as f:
...     _ = f.truncate(8 + len(body) + 20)
>>> read_header(path)  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: safetensors file '...m.safetensors': tensor 'w' ends at data byte 24, past the end of the file's 20 data bytes: the file is truncated or its header is wrong

A box of a tensor (a (start, length) per tensor dim) is a set of runs of contiguous
elements: one run for a block of whole rows, one per row (or row of rows) otherwise.

>>> list(runs((4, 6), ((2, 2), (0, 6)))), list(runs((4, 6), ((0, 2), (3, 3))))
([(12, 12)], [(3, 3), (9, 3)])
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union

import torch

from .._redistribute import Box

__all__ = ["DTYPES", "Header", "TensorInfo", "read_header", "runs"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
MAX_HEADER = 100_000_000  # the format's own limit on the JSON's size


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: `begin`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: the file, where its data start, and its tensors by name."""

    path: str
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(name: str, raw: Any, data_start: int) -> Union[TensorInfo, str]:
    """The tensor `raw` describes, or why it is not one."""
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        return f"entry {raw!r} is not an object of exactly 'dtype', 'shape' and 'data_offsets'"
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in DTYPES:
        return f"dtype {dtype!r} is not a safetensors dtype this reader knows ({', '.join(DTYPES)})"
    if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
        return f"shape {shape!r} is not a list of non-negative ints"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(n) for n in offsets) \
            or offsets[0] > offsets[1]:
        return f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end"
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != want:
        return (f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but shape {shape} of {dtype} needs "
                f"{want}")
    return TensorInfo(name, DTYPES[dtype], tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_header(path: Union[str, os.PathLike[str]]) -> Header:
    """The checked header of the safetensors file at `path`; ValueError naming the file (and
    the tensor) when it is missing, not safetensors, or inconsistent with itself or the file size."""
    where = f"safetensors file {str(path)!r}"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(f"{where} has {size} bytes, fewer than the 8 of its header length: it is truncated")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"{where}: its header length {n} exceeds the file's {size - 8} remaining bytes "
                                 f"(or the format's limit): it is truncated or not a safetensors file")
            text = f.read(n)
    except OSError as exc:
        raise ValueError(f"{where} cannot be read ({exc}): check that every file of the checkpoint is present") from exc
    try:
        raw = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: its header is not JSON ({exc}): it is damaged or not a safetensors file") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: its header is a JSON {type(raw).__name__}, not an object")
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{where}: its __metadata__ {metadata!r} is not a map of strings")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    problems = []
    for name, value in raw.items():
        info = _entry(name, value, data_start)
        if isinstance(info, str):
            problems.append(f"tensor {name!r}: {info}")
        else:
            tensors[name] = info
    if problems:
        raise ValueError(f"{where} has a damaged header:\n  - " + "\n  - ".join(problems))
    _check_tiling(where, tensors, data_start, size - data_start)
    return Header(str(path), data_start, tensors, metadata)


def _check_tiling(where: str, tensors: dict[str, TensorInfo], data_start: int, data_bytes: int) -> None:
    """The tensors' byte ranges must cover the data exactly: in order, no gap, no overlap, none past the end."""
    at, before = 0, "the header"
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        lo, hi = info.begin - data_start, info.end - data_start
        if lo < at:
            raise ValueError(f"{where}: tensor {info.name!r} (data bytes {lo}..{hi}) overlaps tensor {before!r} "
                             f"(data bytes up to {at}): the header is damaged")
        if lo > at:
            raise ValueError(f"{where}: tensor {info.name!r} starts at data byte {lo}, leaving bytes {at}..{lo} that "
                             f"no tensor holds: the header is damaged")
        if hi > data_bytes:
            raise ValueError(f"{where}: tensor {info.name!r} ends at data byte {hi}, past the end of the file's "
                             f"{data_bytes} data bytes: the file is truncated or its header is wrong")
        if hi > lo:
            at, before = hi, info.name
    if at != data_bytes:
        raise ValueError(f"{where}: its tensors end at data byte {at} but the file holds {data_bytes} data bytes: "
                         f"bytes that no tensor holds follow them (the header is damaged)")


def runs(shape: tuple[int, ...], box: Box) -> Iterator[tuple[int, int]]:
    """The (element offset, element count) runs of `box` in a row-major tensor of `shape`, in order."""
    if any(n == 0 for _, n in box) or math.prod(shape) == 0:
        return
    if not shape:
        yield 0, 1
        return
    # the dims after `k` are whole, so each index into the dims before `k` is one run
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    length = box[k][1] * strides[k]
    for index in itertools.product(*(range(s, s + n) for s, n in box[:k])):
        yield sum(i * s for i, s in zip(index, strides)) + box[k][0] * strides[k], length
