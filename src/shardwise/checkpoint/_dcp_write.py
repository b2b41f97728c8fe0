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

Who writes what is `_pieces`' table: each rank the pieces of its DTensors it is responsible
for (one replica of each, Partial mesh dims reduced first), rank 0 plain tensors and values.
Every rank that has pieces writes one data file, `__<rank>_<generation>.distcp`, and answers
with its records (key, box, byte range); rank 0 checks that the chunks tile every tensor and
writes `.metadata`, by atomic rename: that is the switch. The save transaction
(`_transaction`) does the rest, as for every format: the agreements, the generation (a name
never in use in the directory), a failure before the switch leaving the previous `.metadata`
and its files untouched (rank 0 removes this save's files), `async_save`.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, Optional, Union

import torch

from ._dcp_read import METADATA
from ._files import checkpoint_dir, write_atomically
from ._metadata import Entry, Piece, dtype_name, tiling_problem
from ._paths import Path, is_stateful
from ._pieces import standalone as _standalone
from ._switch import sync_directory
from ._writer import Box, Save, Share, StorageWriter, check_loadable

__all__ = ["FileSystemWriter", "dcp_items"]

_DATA = re.compile(r"__\d+_(?P<generation>[0-9a-f]+)\.distcp")
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

    switching = f"writing {METADATA}"
    unchanged = f"no new {METADATA} was written, so the directory still loads the checkpoint it held before (if any)"

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        self.path = checkpoint_dir(path)

    def leaves(self, tree: dict[str, Any]) -> list[tuple[str, Path, Any]]:
        named = dcp_items(tree)
        check_loadable(named)
        return named

    def write(self, save: Save, shares: Sequence[Share]) -> list[Record]:
        """This rank's data file (none when it writes nothing), each chunk one `torch.save`, back to back; the records."""
        records: list[Record] = []

        def write(f: IO[bytes]) -> None:
            for share in shares:
                leaf = save.leaves[share.leaf]
                start = f.tell()
                torch.save(share.value if leaf.shape is None else _standalone(share.value), f)
                records.append((leaf.name, None if leaf.shape is None else share.box, start, f.tell() - start))

        if shares:
            write_atomically(save.directory / _data_file(save.rank, save.generation), write)
        return records

    def switch(self, save: Save, records: list[Any]) -> None:
        _write_metadata(save, [[(key, None if box is None else tuple((s, n) for s, n in box), start, length)
                                for key, box, start, length in rows or ()] for rows in records])

    def switched(self, save: Save) -> bool:
        """Whether `.metadata` names this save's files (it was switched in)."""
        try:
            return f"_{save.generation}.distcp" in (save.directory / METADATA).read_bytes().decode("latin-1")
        except OSError:
            return False

    def generation_of(self, name: str) -> Optional[str]:
        found = _DATA.fullmatch(name)
        if found is not None:
            return found["generation"]
        return "" if name.startswith(".") and name.endswith(".tmp") else None


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


def _data_file(rank: int, generation: str) -> str:
    return f"__{rank}_{generation}.distcp"


def _write_metadata(save: Save, rows: list[list[Record]]) -> None:
    """Rank 0: every rank's records into DCP `Metadata`, checked to tile each tensor, renamed in as `.metadata`."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                        MetadataIndex, StorageMeta, TensorProperties,
                                                        TensorStorageMetadata)

    pieces: dict[str, list[Piece]] = {leaf.name: [] for leaf in save.leaves}
    storage: dict[Any, Any] = {}
    for rank, records in enumerate(rows):
        for key, box, start, length in records:
            pieces[key].append(Piece(_data_file(rank, save.generation), len(pieces[key]), box or ()))
            offset = None if box is None else torch.Size([s for s, _ in box])
            storage[MetadataIndex(key, offset, len(pieces[key]) - 1 if box is not None else None)] = \
                _StorageInfo(_data_file(rank, save.generation), start, length)
    state: dict[str, Any] = {}
    problems: list[str] = []
    for leaf in save.leaves:
        if leaf.shape is None or leaf.dtype is None:
            state[leaf.name] = BytesStorageMetadata()
            continue
        entry = Entry(leaf.path, "tensor", leaf.shape, dtype_name(leaf.dtype), None, tuple(pieces[leaf.name]))
        problem = tiling_problem(entry)
        if problem is not None:
            problems.append(f"'{leaf.name}': {problem} (the ranks disagree on its layout: give it one layout on every "
                            f"rank)")
        chunks = [ChunkStorageMetadata(torch.Size([s for s, _ in p.box]), torch.Size([n for _, n in p.box]))
                  for p in pieces[leaf.name]]
        state[leaf.name] = TensorStorageMetadata(TensorProperties(dtype=leaf.dtype), torch.Size(leaf.shape), chunks)
    if problems:
        raise ValueError("the ranks' chunks do not describe one set of global tensors:\n  - " + "\n  - ".join(problems))
    metadata = Metadata(state, planner_data={leaf.name: leaf.path for leaf in save.leaves}, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=str(save.directory), save_id=save.generation),
                        version=CURRENT_DCP_VERSION)
    write_atomically(save.directory / METADATA, lambda f: pickle.dump(metadata, f))  # the atomic switch
    sync_directory(save.directory)
