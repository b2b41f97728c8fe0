"""The checkpoint's table of contents: what each path holds and which file pieces hold it.

A checkpoint is a directory: one data file per rank of the save (`rank_<r>.<generation>.pt`,
the generation drawn afresh by each save) and `metadata.json`, written last, by rank 0, once
every rank's data file is in place, by one atomic rename. The metadata file is what makes the
directory a checkpoint, and it names the files of its own generation only: a new save writes
beside the files the current metadata names, never over them, so until its metadata replaces
the old one the directory loads the previous checkpoint, whole, and after that the new one.
A save that fails or is killed at any moment leaves the previous checkpoint loadable; the next
save that completes removes the files no metadata names (older generations, temporary files).

Every tensor is saved as *pieces*, boxes of global indices ((start, length) per tensor dim)
that tile it exactly once, whatever layout it had; loading onto another layout is reading
the pieces that overlap each rank's new box. JSON, so people and tools can read the table
without torch, and reading it runs no pickle.

Nothing damaged loads silently. The table records the size of each data file and the
SHA-256 of each piece (of its bytes; of its `repr` for a plain value), and carries the
SHA-256 of its own contents. `read_metadata` refuses a table whose checksum, structure,
file names, dtypes or boxes are wrong (every tensor's pieces must lie inside it and tile it
exactly once); `load` checks the size of each file it opens and the checksum, shape and
dtype of each piece it reads, all before it changes anything.

>>> e = Entry(("model", "w"), "tensor", (7, 5), "float32", "(S(0),) on mesh (4,)",
...           (Piece("rank_0.pt", 0, ((0, 2), (0, 5))), Piece("rank_1.pt", 0, ((2, 5), (0, 5)))))
>>> Entry.from_json(e.to_json()) == e, tiling_problem(e)
(True, None)
>>> tiling_problem(replace(e, pieces=e.pieces[:1] * 2))
'pieces overlap: elements in box [(0, 2), (0, 5)] are held 2 times (each must be held once)'
>>> dtype_from_name(dtype_name(torch.bfloat16))
torch.bfloat16
>>> digest(torch.arange(3)) == digest(torch.arange(3).clone()) != digest(torch.arange(1, 4))
True
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path as FilePath
from typing import Any, Optional

import torch

from .._redistribute import Box
from ._files import write_atomically
from ._paths import Path, show

__all__ = [
    "FORMAT", "METADATA", "VERSION", "Entry", "Piece", "Table", "data_file", "digest", "dtype_from_name", "dtype_name",
    "is_plain_name", "read_metadata", "tiling_problem", "write_metadata",
]

METADATA = "metadata.json"
FORMAT = "shardwise.checkpoint"
VERSION = 2  # 2: file sizes, piece checksums and the table's own checksum; 1 (read too) had none


def data_file(rank: int, generation: str) -> str:
    """The name of the data file rank `rank` writes in save `generation`."""
    return f"rank_{rank}.{generation}.pt"


def is_plain_name(name: object) -> bool:
    """Whether a file name a checkpoint lists stays inside its directory (no separator, no
    `..`, not hidden): a damaged or hostile metadata file cannot point elsewhere."""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and not name.startswith(".") \
        and "/" not in name and "\\" not in name and "\0" not in name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the checkpoint names dtype {name!r}, which this torch does not have")
    return dtype


def digest(value: Any) -> str:
    """SHA-256 of a saved piece: a tensor's bytes (in row-major order), or a plain value's `repr`."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        data: Any = flat.view(torch.uint8).numpy() if flat.numel() else b""  # numpy arrays are buffers
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha256(repr(value).encode()).hexdigest()


@dataclass(frozen=True)
class Piece:
    """Item `index` of data file `file`: a tensor holding `box` of the global tensor (for a
    non-tensor value, the value itself, with an empty box); `sha256` its `digest` (None in
    checkpoints of format version 1)."""

    file: str
    index: int
    box: Box
    sha256: Optional[str] = None

    def volume(self) -> int:
        return math.prod(length for _, length in self.box)


@dataclass(frozen=True)
class Entry:
    """One leaf of the saved state dict. `kind` is "tensor" (with global `shape`, `dtype`,
    and `layout`, how it was laid out when saved, for people) or "object" (a plain value)."""

    path: Path
    kind: str
    shape: Optional[tuple[int, ...]]
    dtype: Optional[str]
    layout: Optional[str]
    pieces: tuple[Piece, ...]

    def numel(self) -> int:
        return math.prod(self.shape or ())

    def to_json(self) -> dict[str, Any]:
        return {
            "path": list(self.path), "kind": self.kind,
            "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype, "layout": self.layout,
            "pieces": [{"file": p.file, "index": p.index, "box": [list(b) for b in p.box], "sha256": p.sha256}
                       for p in self.pieces],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Entry:
        shape = data["shape"]
        return Entry(
            tuple(data["path"]), data["kind"], None if shape is None else tuple(shape), data["dtype"], data["layout"],
            tuple(Piece(p["file"], p["index"], tuple((s, n) for s, n in p["box"]), p.get("sha256"))
                  for p in data["pieces"]),
        )


@dataclass(frozen=True)
class Table:
    """A checkpoint's table: entries by path, and the size in bytes of each data file (None
    for format version 1, which recorded none)."""

    entries: dict[Path, Entry]
    file_sizes: Optional[dict[str, int]]


def _body_digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_metadata(directory: FilePath, entries: Sequence[Entry], world_size: int, file_sizes: Mapping[str, int]) -> None:
    """Write the table of contents, atomically: it appears whole or not at all."""
    body = {"format": FORMAT, "version": VERSION, "world_size": world_size, "files": dict(sorted(file_sizes.items())),
            "entries": [e.to_json() for e in entries]}
    text = json.dumps({**body, "sha256": _body_digest(body)}, indent=1).encode()
    write_atomically(directory / METADATA, lambda f: f.write(text))


def _is_int(x: object, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _shape_problem(entry: Entry) -> Optional[str]:
    """What is wrong with an entry's own fields (not its tiling), or None."""
    if not entry.path or not all(isinstance(k, str) or _is_int(k) for k in entry.path):
        return f"path {list(entry.path)!r} is not a list of str and int keys"
    if entry.kind == "object":
        if len(entry.pieces) != 1 or entry.pieces[0].box != ():
            return f"a plain value must be held by exactly one piece with an empty box, it lists {len(entry.pieces)}"
        return None
    if entry.kind != "tensor":
        return f"kind {entry.kind!r} is neither 'tensor' nor 'object'"
    if entry.shape is None or not all(_is_int(s) for s in entry.shape):
        return f"shape {entry.shape!r} is not a list of non-negative ints"
    if not isinstance(getattr(torch, str(entry.dtype), None), torch.dtype):
        return f"dtype {entry.dtype!r} is not one this torch has"
    return None


def _piece_problem(piece: Piece, ndim: int) -> Optional[str]:
    if not is_plain_name(piece.file):
        return f"data file name {piece.file!r} would reach outside the checkpoint directory"
    if not _is_int(piece.index):
        return f"piece index {piece.index!r} is not a non-negative int"
    if piece.sha256 is not None and not (isinstance(piece.sha256, str) and len(piece.sha256) == 64):
        return f"piece checksum {piece.sha256!r} is not a SHA-256 hex digest"
    if len(piece.box) != ndim or not all(_is_int(s) and _is_int(n) for s, n in piece.box):
        return f"box {[list(b) for b in piece.box]!r} is not {ndim} (start, length) pairs of non-negative ints"
    return None


def tiling_problem(entry: Entry) -> Optional[str]:
    """Why the pieces of a tensor entry do not tile its shape exactly once (None when they do).

    Every piece must lie inside the tensor; then the boundaries of the pieces cut each dim
    into intervals, the intervals into cells, and each cell must be held by exactly one
    piece. Pieces of a saved layout fall on a grid, so there are about as many cells as
    pieces; a table whose boundaries would make too many cells is refused."""
    shape = entry.shape or ()
    boxes = [p.box for p in entry.pieces if p.volume()]
    for box in boxes:
        if any(s + n > size for (s, n), size in zip(box, shape)):
            return f"box {[list(b) for b in box]} reaches outside shape {tuple(shape)}"
    if math.prod(shape) == 0:
        return None
    cuts = [sorted({0, size} | {s for box in boxes for s in (box[d][0], box[d][0] + box[d][1])})
            for d, size in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 1 << 24:
        return f"its {len(boxes)} pieces cut it into {cells} cells, more than a saved layout makes"
    held = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for box in boxes:
        region = tuple(slice(c.index(s), c.index(s + n)) for c, (s, n) in zip(cuts, box))
        held[region] += 1
    if bool((held == 1).all()):
        return None
    cell = [int(i) for i in torch.nonzero(held != 1)[0]]
    where = [(c[i], c[i + 1] - c[i]) for c, i in zip(cuts, cell)]
    times = int(held[tuple(cell)])
    if times == 0:
        return f"elements in box {where} are held by no piece (each must be held once)"
    return f"pieces overlap: elements in box {where} are held {times} times (each must be held once)"


def _checked(entries: list[Entry]) -> list[str]:
    """Every problem of the entries, one line each."""
    problems = []
    for entry in entries:
        problem = _shape_problem(entry)
        if problem is None:
            ndim = 0 if entry.kind == "object" else len(entry.shape or ())
            problem = next((p for p in (_piece_problem(piece, ndim) for piece in entry.pieces) if p), None)
        if problem is None and entry.kind == "tensor":
            problem = tiling_problem(entry)
        if problem is not None:
            problems.append(f"'{show(entry.path)}': {problem}")
    return problems


def read_metadata(directory: FilePath) -> Table:
    """The checkpoint table in `directory`, checked; ValueError if it is not one, or damaged."""
    where = directory / METADATA
    if not directory.is_dir():
        raise ValueError(f"checkpoint_id {str(directory)!r} is not a directory: pass the directory a save wrote")
    if not where.is_file():
        raise ValueError(
            f"{str(directory)!r} is not a complete checkpoint: it has no {METADATA}, which save writes last, "
            f"after every rank's data; the save that wrote it failed or has not finished. Save again, or load "
            f"an earlier checkpoint"
        )
    damaged = f"{str(where)!r} is not a shardwise checkpoint table"
    try:
        table = json.loads(where.read_bytes())
        if not isinstance(table, dict):
            raise ValueError(f"it holds a JSON {type(table).__name__}, not an object")
        if table.get("format") != FORMAT:
            raise ValueError(f"format {table.get('format')!r}")
        version = table.get("version")
        if version not in (1, VERSION):
            raise ValueError(f"version {version!r}; this shardwise reads versions 1 and {VERSION}")
        sizes = None
        if version >= 2:
            body = {k: v for k, v in table.items() if k != "sha256"}
            if table.get("sha256") != _body_digest(body):
                damaged = f"{str(where)!r} was changed after it was saved"
                raise ValueError("its contents do not match the SHA-256 it carries")
            sizes = table["files"]
            if not isinstance(sizes, dict) or not all(_is_int(n) for n in sizes.values()):
                raise ValueError(f"'files' {sizes!r} is not a map of file names to sizes")
        entries = [Entry.from_json(e) for e in table["entries"]]
        problems = _checked(entries)
        if sizes is not None:
            unsized = sorted({p.file for e in entries for p in e.pieces} - set(sizes))
            if unsized:
                problems.append(f"pieces are in files {unsized}, whose sizes it does not record")
        if problems:
            raise ValueError("\n  - " + "\n  - ".join(problems))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        detail = f"{type(exc).__name__}: missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{damaged} ({detail}): it was not written by shardwise.checkpoint.save, or it was "
                         f"damaged; load an earlier checkpoint") from exc
    by_path = {e.path: e for e in entries}
    if len(by_path) != len(entries):
        repeated = sorted({show(e.path) for e in entries if sum(f.path == e.path for f in entries) > 1})
        raise ValueError(f"{str(where)!r} lists {repeated} more than once: it was damaged")
    return Table(by_path, sizes)
