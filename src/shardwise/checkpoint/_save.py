"""The native format's writer: a `torch.save` data file per rank, and `metadata.json`, the table, switched in last.

Each rank writes one data file, `rank_<r>.<generation>.pt`, pieces or not: `torch.save` of
`{"entries": [...], "values": [...]}`, the entries being what this rank knows of every leaf
(kind, global shape, dtype, layout) with its pieces (index in `values`, box, SHA-256). It
answers with those entries and the file's size; rank 0 merges every rank's entries into the
table, checking that they describe one set of global tensors (each tiled exactly once by
the pieces) and naming every difference between ranks, then writes `metadata.json` by one
atomic rename: that is the switch (see `_metadata`). The generation is new to the directory,
so a save never writes over the files the current table names.

The module keeps the name it had when it held all of `save`; the transaction every format
shares, and `save` itself, are in `_transaction`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path as FilePath
from typing import Any, Optional

import torch

from ._files import write_atomically
from ._metadata import METADATA, Entry, Piece, data_file, digest, dtype_name, read_metadata, write_metadata
from ._paths import Path, leaves, show
from ._pieces import standalone as _standalone
from ._pieces import volume
from ._switch import sync_directory as _sync_directory
from ._writer import Leaf, Save, Share, StorageWriter, check_loadable

__all__ = ["NativeWriter"]

_DATA = re.compile(r"rank_\d+(?:\.(?P<generation>[0-9a-f]+))?\.pt")


class NativeWriter(StorageWriter):
    """shardwise's own format in `directory` (what `save(checkpoint_id=...)` writes)."""

    agree_first = False  # rank 0 compares every rank's entries when it merges them, naming each difference
    switching = f"writing {METADATA}"
    unchanged = f"no new {METADATA} was written, so the directory still loads the checkpoint it held before (if any)"

    def __init__(self, directory: FilePath) -> None:
        self.path = directory

    def leaves(self, tree: dict[str, Any]) -> list[tuple[str, Path, Any]]:
        named = [(show(path), path, leaf) for path, leaf in leaves(tree)]
        check_loadable(named)
        return named

    def write(self, save: Save, shares: Sequence[Share]) -> Any:
        name = data_file(save.rank, save.generation)
        entries, values = _pieces(save.leaves, shares, name)
        payload = {"entries": [e.to_json() for e in _sealed(entries, values)], "values": values}
        write_atomically(save.directory / name, lambda f: torch.save(payload, f))
        return {"size": (save.directory / name).stat().st_size, "entries": payload["entries"]}

    def switch(self, save: Save, records: list[Any]) -> None:
        files = {data_file(r, save.generation): record["size"] for r, record in enumerate(records)}
        table = _merge([[Entry.from_json(e) for e in record["entries"]] for record in records])
        _check_present(save.directory, files)
        write_metadata(save.directory, table, save.world, files)  # the atomic switch
        _sync_directory(save.directory)

    def switched(self, save: Save) -> bool:
        if not (save.directory / METADATA).exists():
            return False
        return data_file(0, save.generation) in (read_metadata(save.directory).file_sizes or {})

    def generation_of(self, name: str) -> Optional[str]:
        found = _DATA.fullmatch(name)
        if found is not None:
            return found["generation"] or ""
        return "" if name.startswith(".") and name.endswith(".tmp") else None


def _pieces(leaves: Sequence[Leaf], shares: Sequence[Share], name: str) -> tuple[list[Entry], list[Any]]:
    """What this rank knows of each leaf (entries, not yet `_sealed`) and what it writes into
    data file `name` (values, by index)."""
    mine: dict[int, list[Share]] = {}
    for share in shares:
        mine.setdefault(share.leaf, []).append(share)
    entries: list[Entry] = []
    values: list[Any] = []
    for i, leaf in enumerate(leaves):
        pieces: list[Piece] = []
        for share in mine.get(i, ()):
            if leaf.shape is not None and not volume(share.box):
                continue  # an empty plain tensor: no element to hold
            values.append(share.value if leaf.shape is None else _standalone(share.value))
            pieces.append(Piece(name, len(values) - 1, share.box))
        dtype = None if leaf.dtype is None else dtype_name(leaf.dtype)
        entries.append(Entry(leaf.path, "object" if leaf.shape is None else "tensor", leaf.shape, dtype, leaf.layout,
                             tuple(pieces)))
    return entries, values


def _sealed(entries: list[Entry], values: list[Any]) -> list[Entry]:
    """`entries` with each piece's SHA-256 (of the value it will be read back as)."""
    return [replace(e, pieces=tuple(replace(p, sha256=digest(values[p.index])) for p in e.pieces)) for e in entries]


def _check_present(directory: FilePath, files: dict[str, int]) -> None:
    """Every rank's data file, as rank 0 sees it, has the size that rank wrote."""
    for name, size in files.items():
        path = directory / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            seen = "does not see it" if found is None else f"sees {found} bytes"
            raise ValueError(f"a rank wrote {size} bytes to {str(path)!r} but rank 0 {seen}: save to a directory on "
                             f"a filesystem every rank shares")


def _describe(entry: Entry) -> str:
    if entry.kind == "object":
        return "a plain value"
    kind = "a plain tensor" if entry.layout is None else f"a DTensor {entry.layout}"
    return f"{kind} of shape {entry.shape} and dtype {entry.dtype}"


def _merge(per_rank: list[list[Entry]]) -> list[Entry]:
    """The table: every rank's entries, the pieces of one path together, checked to tile each
    tensor exactly once."""
    merged: dict[Path, Entry] = {}
    holders: dict[Path, list[int]] = {}
    problems: list[str] = []
    disagreed: set[Path] = set()
    for r, entries in enumerate(per_rank):
        for entry in entries:
            first = merged.get(entry.path)
            holders.setdefault(entry.path, []).append(r)
            if first is None:
                merged[entry.path] = entry
            elif (first.kind, first.shape, first.dtype) != (entry.kind, entry.shape, entry.dtype):
                disagreed.add(entry.path)
                problems.append(f"'{show(entry.path)}' is {_describe(first)} on rank {holders[entry.path][0]} "
                                f"but {_describe(entry)} on rank {r}")
            else:
                merged[entry.path] = replace(first, pieces=first.pieces + entry.pieces)
    for path, entry in merged.items():
        ranks = holders[path]
        if entry.kind == "tensor" and path not in disagreed:
            covered = sum(p.volume() for p in entry.pieces)
            if covered != entry.numel():
                problems.append(f"'{show(path)}': the ranks' pieces hold {covered} of its {entry.numel()} elements "
                                f"(ranks {ranks} disagree on its layout): give it one layout on every rank")
    if problems:
        raise ValueError("the ranks' state dicts do not describe one set of global tensors:\n  - "
                         + "\n  - ".join(problems))
    return list(merged.values())
