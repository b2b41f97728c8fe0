"""`FileSystemWriter`: `save` as a directory that `torch.distributed.checkpoint.load` reads.

The format is torch DCP's (see `_dcp_read` for the reading side): data files holding one
`torch.save` per tensor chunk or pickled value, back to back, and a `.metadata` pickle of
DCP's `Metadata`: per flattened key the global shape, dtype and chunks (boxes) of a tensor,
or a mark that the key holds a pickled value; per chunk its file and byte range; per key
its path in the nested state dict.

Keys follow DCP's flattening, so torch's default planner finds them in a nested target:
dict keys become str and are walked; a list is walked (by index) only when it holds a
tensor or a dict somewhere inside, else it is one pickled value, as is every tuple;
anything else is a leaf. A DTensor leaf becomes the chunks of its global boxes, a plain
tensor one chunk, any other leaf one pickled value.

Who writes what is `save`'s table: each rank the pieces of its DTensors it is responsible
for (one replica of each, Partial mesh dims reduced first), rank 0 plain tensors and values.
Every rank writes one data file, `__<rank>_<generation>.distcp` (a name never in use in the
directory), and tells rank 0 its records (key, box, byte range) through an all_gather of
ints; rank 0 checks that the chunks tile every tensor and writes `.metadata`.

Crash consistency. The data files of a save have names of their own, each written under a
temporary name, synced and renamed in; the ranks agree after every rank's file is in place,
and only then does rank 0 replace `.metadata` by atomic rename. A failure on any rank before
that leaves `.metadata` naming the previous save's files, untouched, so a reader loads the
previous checkpoint (every rank raises; rank 0 removes this save's files). After the switch
rank 0 removes the data files the new `.metadata` does not name.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path as FilePath
from typing import IO, Any, Optional, Union

import torch
import torch.distributed as dist

from .._comm import all_gather_ints
from .._redistribute._exchange import Box
from .._tensor import DTensor
from ._dcp_read import METADATA
from ._files import checkpoint_dir, write_atomically
from ._metadata import Entry, Piece, dtype_name, tiling_problem
from ._paths import Path, is_stateful
from ._save import (_agree, _check_values, _claimed_below, _fingerprint, _my_boxes, _narrowed, _rank_and_world,
                    _reduced, _standalone, _sync_directory)
from ._writer import StorageWriter

__all__ = ["FileSystemWriter", "dcp_items"]

_DATA = re.compile(r"__\d+_[0-9a-f]+\.distcp")
_UNCHANGED = f"no new {METADATA} was written, so the directory still loads the checkpoint it held before (if any)"
Record = tuple[str, Optional[Box], int, int]  # (key, chunk box or None for a pickled value, byte offset, length)


class FileSystemWriter(StorageWriter):
    """Writes `save(state_dict, storage_writer=FileSystemWriter(path))` as a torch DCP checkpoint
    in directory `path`, which `torch.distributed.checkpoint.load` reads into torch DTensors on
    any mesh (or, `no_dist=True`, into plain tensors), and `FileSystemReader` into shardwise's.

    Call it on every rank, with a directory every rank shares. Values that are not tensors
    must load back under `torch.load(weights_only=True)`, as with `save`. See this module for
    the keys, who writes what, and why a failed save leaves the previous checkpoint loadable.

    >>> import tempfile, torch, torch.distributed.checkpoint as dcp, warnings
    >>> from shardwise import checkpoint
    >>> path = tempfile.mkdtemp()
    >>> checkpoint.save({"w": torch.arange(6.0).view(2, 3), "opt": {"step": 4}}, storage_writer=FileSystemWriter(path))
    >>> target = {"w": torch.zeros(2, 3), "opt": {"step": 0}}
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # DCP's note that it loads in one process
    ...     dcp.load(target, checkpoint_id=path, no_dist=True)
    >>> target["w"][1].tolist(), target["opt"]
    ([3.0, 4.0, 5.0], {'step': 4})
    """

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        self.path = checkpoint_dir(path)

    def write(self, state_dict: Mapping[str, Any], checkpoint_id: Optional[FilePath] = None) -> None:
        _Save(checkpoint_id or self.path).run(state_dict)


def dcp_items(state_dict: Mapping[str, Any]) -> list[tuple[str, Path, Any]]:
    """(key, path, leaf) of every leaf, as DCP flattens the state dict.

    >>> [(k, p) for k, p, _ in dcp_items({"a": {0: 1, "b": [1, 2]}, "c": [{"d": (3, 4)}]})]
    [('a.0', ('a', '0')), ('a.b', ('a', 'b')), ('c.0.d', ('c', 0, 'd'))]
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict of names to values, got {type(state_dict).__name__}")
    found: dict[str, tuple[str, Path, Any]] = {}
    for key, value in state_dict.items():
        for path, leaf in _walk(value.state_dict() if is_stateful(value) else value, (str(key),)):
            name = ".".join(map(str, path))
            if name in found:
                raise ValueError(f"two state dict leaves flatten to the key '{name}' (paths {found[name][1]} and "
                                 f"{path}): DCP names leaves by their dotted path, so rename one")
            found[name] = (name, path, leaf)
    return list(found.values())


def _walk(value: Any, where: Path) -> Iterator[tuple[Path, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, where + (str(key),))
    elif isinstance(value, list) and _opened(value):
        for i, item in enumerate(value):
            yield from _walk(item, where + (i,))
    else:
        yield where, value


def _opened(value: list[Any]) -> bool:
    """Whether DCP walks into list `value`: it holds a tensor, a dict, or such a list."""
    return any(isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and _opened(v)) for v in value)


class _Save:
    def __init__(self, directory: FilePath) -> None:
        self.directory = directory
        self.rank, self.world = _rank_and_world()

    def agree(self, step: str, error: Optional[Exception], count: int = 0, outcome: Any = _UNCHANGED) -> list[int]:
        return _agree(step, error, self.directory, self.world, count, outcome=outcome)

    def run(self, state_dict: Mapping[str, Any]) -> None:
        directory, rank, world = self.directory, self.rank, self.world
        error: Optional[Exception] = None
        items: list[tuple[str, Path, Any]] = []
        claims: list[int] = []
        digest = 0
        try:
            items = dcp_items(state_dict)
            _check_values([(path, leaf) for _, path, leaf in items])
            digest = _digest([(key, _kind(leaf)) for key, _, leaf in items])
            claims = [_fingerprint((key,), box) for key, _, leaf in items
                      if isinstance(leaf, DTensor) and leaf.device_mesh.size() < world for box, _ in _my_boxes(leaf)]
            if directory.exists() and not directory.is_dir():
                raise ValueError(f"{str(directory)!r} is a file: pass a directory (it is created if missing)")
            directory.mkdir(parents=True, exist_ok=True)
        except Exception as exc:
            error = exc
        digests = self.agree("checking the state dict", error, digest)
        if len(set(digests)) > 1:
            raise ValueError(f"save to {str(directory)!r}: the ranks' state dicts differ in keys, shapes or dtypes "
                             f"(ranks {[r for r, d in enumerate(digests) if d != digests[0]]} differ from rank 0): "
                             f"pass every rank the same state dict. {_UNCHANGED}")
        token = _fresh_generation(directory) if rank == 0 else 0
        generation = f"{self.agree('drawing a generation', None, token)[0]:08x}"
        taken = _claimed_below(rank, world, claims, self.agree("claiming pieces", None, len(claims)))
        with torch.no_grad():
            items = [(key, path, _reduced(leaf) if isinstance(leaf, DTensor) else leaf) for key, path, leaf in items]
        records: list[Record] = []
        try:
            try:
                records = _write_data(directory / _data_file(rank, generation), items, rank, taken)
            except Exception as exc:
                error = exc
            packed = _pack(records)
            widths = self.agree("writing the data files", error, len(packed))
            rows = [packed] if world == 1 else _gather(packed, max(widths), world)
            if rank == 0:
                try:
                    _write_metadata(directory, generation, items, rows)
                except Exception as exc:
                    error = exc
            self.agree(f"writing {METADATA}", error, outcome=lambda: _outcome(directory, generation))
        except BaseException:
            if rank == 0 and not _names(directory, generation):
                _remove(directory, lambda name: f"_{generation}.distcp" in name)
            raise
        if rank == 0:
            _remove(directory, lambda name: (bool(_DATA.fullmatch(name)) and not name.endswith(f"_{generation}.distcp"))
                    or (name.startswith(".") and name.endswith(".tmp")))


def _kind(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return [list(leaf.shape), str(leaf.dtype)]
    return None


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(json.dumps(value).encode(), digest_size=8).digest(), "big") >> 1


def _data_file(rank: int, generation: str) -> str:
    return f"__{rank}_{generation}.distcp"


def _fresh_generation(directory: FilePath) -> int:
    """A random 31-bit generation no data file in `directory` carries yet."""
    present = set(os.listdir(directory)) if directory.is_dir() else set()
    while True:
        token = secrets.randbits(31)
        if not any(name.endswith(f"_{token:08x}.distcp") for name in present):
            return token


def _my_chunks(key: str, leaf: Any, rank: int, taken: set[int]) -> Iterator[tuple[Optional[Box], Any]]:
    """(global box, values) of each chunk of `leaf` this rank writes; (None, value) for a pickled value."""
    if isinstance(leaf, DTensor):
        for box, at in _my_boxes(leaf):
            if not (taken and _fingerprint((key,), box) in taken):
                yield box, _standalone(_narrowed(leaf.to_local(), at))
    elif rank == 0:
        yield (tuple((0, n) for n in leaf.shape), _standalone(leaf)) if isinstance(leaf, torch.Tensor) else (None, leaf)


def _write_data(target: FilePath, items: list[tuple[str, Path, Any]], rank: int, taken: set[int]) -> list[Record]:
    """This rank's data file (none when it writes nothing), each chunk one torch.save; its records."""
    records: list[Record] = []

    def write(f: IO[bytes]) -> None:
        for key, _, leaf in items:
            for box, value in _my_chunks(key, leaf, rank, taken):
                start = f.tell()
                torch.save(value, f)
                records.append((key, box, start, f.tell() - start))

    if any(True for key, _, leaf in items for _ in _my_chunks(key, leaf, rank, taken)):
        write_atomically(target, write)
    return records


def _pack(records: list[Record]) -> list[int]:
    """`records` as non-negative ints for an all_gather: the JSON's length, then 7 bytes per int."""
    data = json.dumps(records).encode()
    padded = data.ljust(-(-len(data) // 7) * 7, b" ")
    return [len(data)] + [int.from_bytes(padded[i:i + 7], "big") for i in range(0, len(padded), 7)]


def _unpack(row: list[int]) -> list[Record]:
    n = row[0]
    data = b"".join(v.to_bytes(7, "big") for v in row[1:1 + -(-n // 7)])[:n]
    return [(key, None if box is None else tuple((s, k) for s, k in box), start, length)
            for key, box, start, length in json.loads(data)]


def _gather(packed: list[int], width: int, world: int) -> list[list[int]]:
    """Every rank's packed records (padded to `width`), by rank."""
    return all_gather_ints(packed + [0] * (width - len(packed)), dist.group.WORLD, world)


def _write_metadata(directory: FilePath, generation: str, items: list[tuple[str, Path, Any]],
                    rows: list[list[int]]) -> None:
    """Rank 0: every rank's records into DCP `Metadata`, checked to tile each tensor, renamed in as `.metadata`."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                        MetadataIndex, StorageMeta, TensorProperties,
                                                        TensorStorageMetadata)

    pieces: dict[str, list[Piece]] = {key: [] for key, _, _ in items}
    storage: dict[Any, Any] = {}
    for rank, row in enumerate(rows):
        for key, box, start, length in _unpack(row):
            pieces[key].append(Piece(_data_file(rank, generation), len(pieces[key]), box or ()))
            offset = None if box is None else torch.Size([s for s, _ in box])
            storage[MetadataIndex(key, offset, len(pieces[key]) - 1 if box is not None else None)] = \
                _StorageInfo(_data_file(rank, generation), start, length)
    state: dict[str, Any] = {}
    problems: list[str] = []
    for key, path, leaf in items:
        if not isinstance(leaf, torch.Tensor):
            state[key] = BytesStorageMetadata()
            continue
        entry = Entry(path, "tensor", tuple(leaf.shape), dtype_name(leaf.dtype), None, tuple(pieces[key]))
        problem = tiling_problem(entry)
        if problem is not None:
            problems.append(f"'{key}': {problem} (the ranks disagree on its layout: give it one layout on every rank)")
        chunks = [ChunkStorageMetadata(torch.Size([s for s, _ in p.box]), torch.Size([n for _, n in p.box]))
                  for p in pieces[key]]
        state[key] = TensorStorageMetadata(TensorProperties(dtype=leaf.dtype), torch.Size(leaf.shape), chunks)
    if problems:
        raise ValueError("the ranks' chunks do not describe one set of global tensors:\n  - " + "\n  - ".join(problems))
    metadata = Metadata(state, planner_data={key: path for key, path, _ in items}, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=str(directory), save_id=generation),
                        version=CURRENT_DCP_VERSION)
    write_atomically(directory / METADATA, lambda f: pickle.dump(metadata, f))  # the atomic switch
    _sync_directory(directory)


def _names(directory: FilePath, generation: str) -> bool:
    """Whether `.metadata` names this save's files (it was switched in)."""
    try:
        return f"_{generation}.distcp" in (directory / METADATA).read_bytes().decode("latin-1")
    except OSError:
        return False


def _outcome(directory: FilePath, generation: str) -> str:
    if _names(directory, generation):
        return (f"the checkpoint itself is complete: {METADATA} already names this save's files (generation "
                f"{generation}); only the removal of older files was not run")
    return _UNCHANGED


def _remove(directory: FilePath, chosen: Any) -> None:
    for name in os.listdir(directory):
        if chosen(name) and (directory / name).is_file():
            try:
                (directory / name).unlink()
            except OSError:
                pass  # gone already: nothing to do
