"""Where `load` reads a checkpoint from: a storage reader.

A reader answers two questions, and `load` does the rest (matching the state dict, planning
each rank's copies, agreeing between ranks, copying): what the checkpoint holds (a `Table`:
per path its kind, global shape, dtype and the pieces, boxes of global indices, that tile
it) and the value of one piece, checked against the table. The native format's reader is
`NativeReader`; a reader of another format (Hugging Face safetensors, torch's DCP) builds the
same table from that format's own index and hands out pieces the same way, reading only the
bytes asked for (a piece may be a lazy view of a mapped file: only the regions copied from
it are read).

| attribute / method | what it gives |
|---|---|
| `describe()` | how errors name the checkpoint, e.g. "the checkpoint '/ckpt'" |
| `read_table()` | the `Table`; ValueError naming the file when the index is damaged |
| `fit(table, targets)` | the table keyed by the state dict's leaf paths (default: as read) |
| `value(piece, entry)` | the piece's value (a tensor of the piece's box shape); ValueError when it is not what the table says |
| `casts` | True when a saved dtype may differ from the target's (the copy casts); else dtypes must match |
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path as FilePath
from typing import Any

import torch

from ._files import read_data
from ._metadata import Entry, Piece, Table, digest, dtype_name, read_metadata
from ._paths import Path, show

__all__ = ["NativeReader", "StorageReader"]


class StorageReader:
    """The interface `load(storage_reader=...)` reads through (see the module docstring)."""

    casts: bool = False

    def describe(self) -> str:
        raise NotImplementedError

    def read_table(self) -> Table:
        raise NotImplementedError

    def fit(self, table: Table, targets: Collection[Path]) -> Table:
        """`table` keyed by the state dict's leaf paths `targets`, for a format whose keys lose
        what a path says (DCP's dotted names make every dict key a str); by default `table`."""
        return table

    def value(self, piece: Piece, entry: Entry) -> Any:
        raise NotImplementedError


class NativeReader(StorageReader):
    """shardwise's own format: `metadata.json` and per-rank data files, each opened (mapped)
    at most once per load, and only when a piece is needed; each piece checked against the
    table (shape, dtype, SHA-256) before it is used."""

    def __init__(self, directory: FilePath) -> None:
        self.directory = directory
        self.sizes: dict[str, int] | None = None
        self.files: dict[str, list[Any]] = {}

    def describe(self) -> str:
        return f"the checkpoint {str(self.directory)!r}"

    def read_table(self) -> Table:
        table = read_metadata(self.directory)
        self.sizes = table.file_sizes
        return table

    def _values(self, name: str) -> list[Any]:
        values = self.files.get(name)
        if values is None:
            path = self.directory / name
            if self.sizes is not None and path.is_file() and path.stat().st_size != self.sizes[name]:
                raise ValueError(f"checkpoint data file {str(path)!r} has {path.stat().st_size} bytes, the table "
                                 f"records {self.sizes[name]}: it was truncated or replaced after saving")
            values = self.files[name] = read_data(path)[1]
        return values

    def value(self, piece: Piece, entry: Entry) -> Any:
        values = self._values(piece.file)
        where = f"'{show(entry.path)}': piece {piece.index} of {str(self.directory / piece.file)!r}"
        if piece.index >= len(values):
            raise ValueError(f"{where} does not exist (the file holds {len(values)}): the checkpoint was damaged")
        value = values[piece.index]
        if entry.kind == "tensor":
            want = tuple(n for _, n in piece.box)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want or dtype_name(value.dtype) != entry.dtype:
                got = (f"a tensor of shape {tuple(value.shape)} and dtype {dtype_name(value.dtype)}"
                       if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
                raise ValueError(f"{where} is {got}, the table says a tensor of shape {want} and dtype "
                                 f"{entry.dtype}: the checkpoint was damaged")
        if piece.sha256 is not None and digest(value) != piece.sha256:
            raise ValueError(f"{where} does not match its SHA-256 checksum: the data file was altered or damaged "
                             f"after saving; load an earlier checkpoint")
        return value
