"""`FileSystemReader`: load a checkpoint that `torch.distributed.checkpoint.save` wrote.

torch's DCP writes a directory of data files (`__<rank>_<n>.distcp`) and a `.metadata`
pickle: per flattened key (`"model.0.weight"`, `"optim.state.0.exp_avg"`) the global shape,
dtype and chunks (boxes of global indices) of a tensor, or a mark that the key holds a
pickled value; per chunk, which file and byte range holds it (each chunk one `torch.save`);
and the key's path in the nested state dict. This reader turns that into the `Table` that
`load` matches, plans and copies from, so a checkpoint saved by torch's DTensors on one mesh
loads into shardwise DTensors on any other, or into plain tensors.

Nothing in it runs code it reads. The `.metadata` pickle is opened by an unpickler that
admits DCP's metadata classes and the few torch values they hold (dtypes, `torch.Size`,
layouts) and refuses every other global without loading it; chunks and pickled values are
read with `torch.load(weights_only=True)` on their own byte range only, and only the chunks
a rank needs. Everything a damaged checkpoint can get wrong (a table that does not tile a
tensor, a byte range past the end of a file, a missing file, a chunk that is not the tensor
the table says) is a ValueError naming the file and the key, raised before `load` changes
anything.

Keys. DCP names a leaf by its path joined with dots, every dict key made a str; a list of
plain values is one pickled leaf. `load` names leaves by paths whose dict keys keep their
type (an optimizer's state under int ids) and walks into lists, so `fit` keys the table as
the state dict does: an entry whose dotted name is a leaf's is that leaf's, and a pickled
list or tuple is opened into one entry per element.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path as FilePath
from typing import Any, Optional, Union

import torch

from ._metadata import Entry, Piece, Table, dtype_name, is_plain_name, tiling_problem
from ._paths import Path, leaves, show
from ._storage import StorageReader

__all__ = ["FileSystemReader"]

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
_ADMITTED = {  # module -> the classes a DCP .metadata pickle may name from it
    f"{_DCP}.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta"},
    f"{_DCP}.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


def _layout(name: str) -> torch.layout:
    """A torch layout by its str (how a pickled layout names itself)."""
    found = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(found, torch.layout):
        raise ValueError(f"{name!r} is not a torch layout")
    return found


class _MetadataUnpickler(pickle.Unpickler):
    """Loads a DCP `.metadata` pickle; any global it does not admit is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        raise ValueError(f"it names {module}.{name}, which is not one of DCP's metadata classes; a .metadata "
                         f"file holds nothing else, so it was replaced or tampered with (refused, not run)")


@dataclass(frozen=True)
class _Stored:
    """Where a chunk or pickled value lies: `length` bytes at `offset` of `file`."""

    key: str
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _dims(size: object) -> Optional[tuple[int, ...]]:
    return tuple(size) if isinstance(size, torch.Size) and all(_is_int(n) for n in size) else None


class FileSystemReader(StorageReader):
    """Reads the checkpoint `torch.distributed.checkpoint.save` wrote in directory `path`:
    `load(state_dict, storage_reader=FileSystemReader(path))`, on any mesh and layout.

    >>> import tempfile, torch, torch.distributed.checkpoint as dcp, warnings
    >>> from shardwise import checkpoint
    >>> path = tempfile.mkdtemp()
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # DCP's note that it saves in one process
    ...     _ = dcp.save({"w": torch.arange(6.0).view(2, 3), "opt": {"state": {0: {"step": 4}}}}, checkpoint_id=path)
    >>> target = {"w": torch.zeros(2, 3), "opt": {"state": {0: {"step": 0}}}}
    >>> checkpoint.load(target, storage_reader=FileSystemReader(path))
    >>> target["w"][1].tolist(), target["opt"]
    ([3.0, 4.0, 5.0], {'state': {0: {'step': 4}}})
    """

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"FileSystemReader(path) takes the checkpoint's directory as a str or os.PathLike, "
                            f"got {type(path).__name__}")
        self.path = FilePath(path)
        self.stored: list[Union[_Stored, Any]] = []  # a Piece's index: where it lies, or its value once opened
        self.sizes: dict[str, Optional[int]] = {}

    def describe(self) -> str:
        return f"the checkpoint {str(self.path)!r}"

    def read_table(self) -> Table:
        where = self.path / METADATA
        if not where.is_file():
            raise ValueError(f"{str(self.path)!r} is not a torch DCP checkpoint: it has no {METADATA}, which "
                             f"torch.distributed.checkpoint.save writes last; the save failed or has not finished")
        self.stored, self.sizes = [], {}
        try:
            metadata = _MetadataUnpickler(io.BytesIO(where.read_bytes())).load()
        except Exception as exc:  # a damaged pickle fails in many ways; each is a damaged table
            raise ValueError(f"cannot read {str(where)!r}: {exc}") from exc
        problems: list[str] = []
        entries = self._entries(metadata, problems)
        if problems:
            raise ValueError(f"{str(where)!r} is not a checkpoint table torch.distributed.checkpoint.save wrote, or "
                             f"it was damaged; nothing was loaded:\n  - " + "\n  - ".join(problems))
        return Table({e.path: e for e in entries}, None)

    def _entries(self, metadata: Any, problems: list[str]) -> list[Entry]:
        """The table's entries (one per DCP key, under its path); every problem appended to `problems`."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex,
                                                            TensorStorageMetadata)

        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
                or not isinstance(metadata.storage_data, dict):
            problems.append(f"it holds a {type(metadata).__name__}, not DCP Metadata with a state dict and storage map")
            return []
        where: dict[tuple[str, Optional[tuple[int, ...]]], _Stored] = {}
        for index, info in metadata.storage_data.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
                problems.append(f"its storage map holds {type(index).__name__} -> {type(info).__name__}")
                continue
            transforms = info.transform_descriptors or ()
            if not is_plain_name(info.relative_path) or not _is_int(info.offset) or not _is_int(info.length) \
                    or not all(isinstance(t, str) for t in transforms):
                problems.append(f"'{index.fqn}': storage {info!r} is not a file in the directory and a byte range")
                continue
            offset = None if index.offset is None else tuple(index.offset)
            where[(str(index.fqn), offset)] = _Stored(str(index.fqn), info.relative_path, info.offset, info.length,
                                                       tuple(transforms))
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        entries = []
        for key, meta in metadata.state_dict_metadata.items():
            path = paths.get(key, (key,))
            if not isinstance(key, str) or not isinstance(path, tuple) or ".".join(map(str, path)) != key \
                    or not all(isinstance(k, str) or _is_int(k) for k in path):
                problems.append(f"'{key}': its path {path!r} is not the key's parts")
                continue
            if isinstance(meta, BytesStorageMetadata):
                stored = where.get((key, None))
                if stored is None:
                    problems.append(f"'{key}': a pickled value with no place in any data file")
                    continue
                entries.append(Entry(path, "object", None, None, "torch DCP: a pickled value",
                                     (Piece(stored.file, self._keep(stored), ()),)))
            elif isinstance(meta, TensorStorageMetadata):
                entry = self._tensor(key, path, meta, where, problems)
                if entry is not None:
                    entries.append(entry)
            else:
                problems.append(f"'{key}': {type(meta).__name__} is neither tensor nor pickled-value metadata")
        return entries

    def _tensor(self, key: str, path: Path, meta: Any, where: dict[Any, _Stored], problems: list[str]
                ) -> Optional[Entry]:
        """The entry of tensor `key`, its chunks its pieces (None, with a problem, when it is damaged)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        shape = _dims(meta.size)
        dtype = getattr(meta.properties, "dtype", None)
        if shape is None or not isinstance(dtype, torch.dtype) or not isinstance(meta.chunks, list):
            problems.append(f"'{key}': size {meta.size!r} or dtype {dtype!r} is not a tensor's")
            return None
        pieces = []
        for chunk in meta.chunks:
            offsets = _dims(getattr(chunk, "offsets", None))
            sizes = _dims(getattr(chunk, "sizes", None))
            if not isinstance(chunk, ChunkStorageMetadata) or offsets is None or sizes is None \
                    or not len(offsets) == len(sizes) == len(shape):
                problems.append(f"'{key}': chunk {chunk!r} is not {len(shape)} offsets and sizes")
                return None
            stored = where.get((key, offsets))
            if stored is None:
                problems.append(f"'{key}': the chunk at offsets {list(offsets)} has no place in any data file")
                return None
            pieces.append(Piece(stored.file, self._keep(stored), tuple(zip(offsets, sizes))))
        entry = Entry(path, "tensor", shape, dtype_name(dtype), f"torch DCP: {len(pieces)} chunks", tuple(pieces))
        problem = tiling_problem(entry)
        if problem is not None:
            problems.append(f"'{key}': {problem}")
            return None
        return entry

    def _keep(self, stored: _Stored) -> int:
        self.stored.append(stored)
        return len(self.stored) - 1

    def fit(self, table: Table, targets: Collection[Path]) -> Table:
        """The table keyed by the targets' paths: the entry of dotted name `show(path)` is
        `path`'s, and a pickled value under a top-level key the targets ask for is opened
        into one entry per leaf (a list of plain values becomes one entry per element)."""
        asked = {str(p[0]) for p in targets if p}
        opened: dict[str, Entry] = {}
        for entry in table.entries.values():
            if entry.kind == "object" and str(entry.path[0]) in asked:
                piece = entry.pieces[0]
                value = self.value(piece, entry)
                try:
                    parts = list(leaves(value))
                except TypeError as exc:
                    raise ValueError(f"'{show(entry.path)}' in {str(self.path / piece.file)!r}: {exc}") from exc
                for sub, leaf in parts:  # a tensor inside (a save that did not flatten) is one whole piece
                    box = tuple((0, n) for n in leaf.shape) if isinstance(leaf, torch.Tensor) else ()
                    kept = (Piece(piece.file, len(self.stored), box),)
                    self.stored.append(leaf)
                    opened[show(entry.path + sub)] = (
                        Entry(entry.path + sub, "tensor", tuple(leaf.shape), dtype_name(leaf.dtype), entry.layout, kept)
                        if isinstance(leaf, torch.Tensor) else Entry(entry.path + sub, "object", None, None, entry.layout, kept))
            else:
                opened[show(entry.path)] = entry
        for path in targets:
            found = opened.get(show(path))
            if found is not None:
                opened[show(path)] = replace(found, path=path)
        return Table({e.path: e for e in opened.values()}, None)

    def value(self, piece: Piece, entry: Entry) -> Any:
        stored = self.stored[piece.index]
        if not isinstance(stored, _Stored):
            return stored  # a leaf of an opened pickled value
        data = self._read(stored)
        where = f"'{stored.key}' (bytes {stored.offset}..{stored.offset + stored.length} of {str(self.path / stored.file)!r})"
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{where} is not a value torch.save wrote ({type(exc).__name__}: {exc}): the data "
                             f"file was damaged, or it holds an object torch.load(weights_only=True) refuses to "
                             f"build (this reader runs no other pickle)") from exc
        if entry.kind == "tensor":
            want = tuple(n for _, n in piece.box)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != want or dtype_name(value.dtype) != entry.dtype:
                got = (f"a tensor of shape {tuple(value.shape)} and dtype {dtype_name(value.dtype)}"
                       if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
                raise ValueError(f"{where} is {got}, the table says a chunk of shape {want} and dtype "
                                 f"{entry.dtype}: the checkpoint was damaged")
        return value

    def _read(self, stored: _Stored) -> bytes:
        """The bytes of one chunk or pickled value; ValueError naming the file and key when they are not there."""
        path = self.path / stored.file
        if stored.file not in self.sizes:
            self.sizes[stored.file] = path.stat().st_size if path.is_file() else None
        size = self.sizes[stored.file]
        if size is None:
            raise ValueError(f"'{stored.key}' is in data file {str(path)!r}, which does not exist: the directory was "
                             f"changed after saving, or not every rank sees it (use a filesystem every rank shares)")
        if stored.offset + stored.length > size:
            raise ValueError(f"'{stored.key}' lies at bytes {stored.offset}..{stored.offset + stored.length} of "
                             f"{str(path)!r}, which has {size}: the file was truncated or the table damaged")
        if stored.transforms:
            raise ValueError(f"'{stored.key}' in {str(path)!r} was written through DCP stream transforms "
                             f"{list(stored.transforms)}, which this reader does not decode: load it with "
                             f"torch.distributed.checkpoint, or save without _extensions")
        with open(path, "rb") as f:
            f.seek(stored.offset)
            data = f.read(stored.length)
        if len(data) != stored.length:
            raise ValueError(f"'{stored.key}': {str(path)!r} ended inside bytes {stored.offset}.."
                             f"{stored.offset + stored.length}: the file was truncated")
        return data
