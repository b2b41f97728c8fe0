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

>>> e = Entry(("model", "w"), "tensor", (7, 5), "float32", "(S(0),) on mesh (4,)",
...           (Piece("rank_0.pt", 0, ((0, 2), (0, 5))),))
>>> Entry.from_json(e.to_json()) == e
True
>>> dtype_from_name(dtype_name(torch.bfloat16))
torch.bfloat16
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Optional

import torch

from .._redistribute._exchange import Box
from ._files import write_atomically
from ._paths import Path, show

__all__ = [
    "FORMAT", "METADATA", "VERSION", "Entry", "Piece", "data_file", "dtype_from_name", "dtype_name", "is_plain_name",
    "read_metadata", "write_metadata",
]

METADATA = "metadata.json"
FORMAT = "shardwise.checkpoint"
VERSION = 1


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
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the checkpoint names dtype {name!r}, which this torch does not have")
    return dtype


@dataclass(frozen=True)
class Piece:
    """Item `index` of data file `file`: a tensor holding `box` of the global tensor (for a
    non-tensor value, the value itself, with an empty box)."""

    file: str
    index: int
    box: Box

    def volume(self) -> int:
        n = 1
        for _, length in self.box:
            n *= length
        return n


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
        n = 1
        for s in self.shape or ():
            n *= s
        return n

    def to_json(self) -> dict[str, Any]:
        return {
            "path": list(self.path), "kind": self.kind,
            "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype, "layout": self.layout,
            "pieces": [{"file": p.file, "index": p.index, "box": [list(b) for b in p.box]} for p in self.pieces],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Entry:
        shape = data["shape"]
        return Entry(
            tuple(data["path"]), data["kind"], None if shape is None else tuple(shape), data["dtype"], data["layout"],
            tuple(Piece(p["file"], p["index"], tuple((s, n) for s, n in p["box"])) for p in data["pieces"]),
        )


def write_metadata(directory: FilePath, entries: Sequence[Entry], world_size: int) -> None:
    """Write the table of contents, atomically: it appears whole or not at all."""
    table = {"format": FORMAT, "version": VERSION, "world_size": world_size, "entries": [e.to_json() for e in entries]}
    text = json.dumps(table, indent=1).encode()
    write_atomically(directory / METADATA, lambda f: f.write(text))


def read_metadata(directory: FilePath) -> dict[Path, Entry]:
    """The entries of the checkpoint in `directory` by path; ValueError if it is not one."""
    where = directory / METADATA
    if not directory.is_dir():
        raise ValueError(f"checkpoint_id {str(directory)!r} is not a directory: pass the directory a save wrote")
    if not where.is_file():
        raise ValueError(
            f"{str(directory)!r} is not a complete checkpoint: it has no {METADATA}, which save writes last, "
            f"after every rank's data; the save that wrote it failed or has not finished. Save again, or load "
            f"an earlier checkpoint"
        )
    try:
        table = json.loads(where.read_text())
        if table.get("format") != FORMAT:
            raise ValueError(f"format {table.get('format')!r}")
        if table.get("version") != VERSION:
            raise ValueError(f"version {table.get('version')!r}; this shardwise reads version {VERSION}")
        entries = [Entry.from_json(e) for e in table["entries"]]
        outside = sorted({p.file for e in entries for p in e.pieces if not is_plain_name(p.file)}, key=repr)
        if outside:
            raise ValueError(f"data file names {outside} would reach outside the checkpoint directory")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(where)!r} is not a shardwise checkpoint table ({exc}): it was not written by "
                         f"shardwise.checkpoint.save, or it was damaged") from exc
    by_path = {e.path: e for e in entries}
    if len(by_path) != len(entries):
        repeated = sorted({show(e.path) for e in entries if sum(f.path == e.path for f in entries) > 1})
        raise ValueError(f"{str(where)!r} lists {repeated} more than once: it was damaged")
    return by_path
