"""`HuggingFaceStorageWriter`: `save` as a Hugging Face safetensors directory, each rank writing its own bytes.

Every rank computes the files' layout (`_hf_layout`) from global shapes and dtypes, and
writes the bytes of the pieces it is responsible for (`_pieces`: one replica of each piece,
Partial DTensors reduced first, plain tensors by rank 0) at their offsets in files every
rank opens: no rank gathers a whole tensor. The save transaction (`_transaction`) does the
rest, as for every format: the agreements (every rank must hold the same names, shapes and
dtypes before anything is written), the generation, `async_save`.

Crash consistency. The names are fixed (`model.safetensors`, `model-0000k-of-0000n...`), so
a new save cannot sit beside the old one as the native format does; it is written under
temporary names (`.model.safetensors.<generation>.tmp`, hidden from loaders), which rank 0
creates (header written, at full size) before any rank writes, and switched in:

- A failure or kill on any rank before the switch (writing the bytes: nearly all of a save)
  leaves the previous directory byte for byte as it was; every rank raises, rank 0 removes
  this save's temporary files (a killed save's are removed by the next completed save).
- The switch, on rank 0 once every rank's bytes are synced, renames the files in behind a
  journal (`_switch`): extra files (config.json) first, the data files, and last the file a
  loader looks for first (the index, or `model.safetensors`), then removes the old files the
  new save does not name. A loader sees the previous weights until that last rename and the
  new ones after it (transformers prefers `model.safetensors` to the index: going from one
  file to several, the old `model.safetensors` is removed only after the new index is in
  place). One window remains: when the new files have the old ones' names (same number of
  shards), the old index is removed before they are renamed over, so a loader during those
  few renames finds no weights and fails, rather than mixing old and new. The new
  config.json precedes the new weights by those renames too. If rank 0 dies inside the
  switch, the journal stays and the next save to the directory finishes the switch first.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path as FilePath
from typing import Any, Optional, Union

import torch

from ._files import checkpoint_dir
from ._hf_layout import DEFAULT_MAX_SHARD_SIZE, INDEX, FileLayout, Slot, index_json, parse_size, plan_files
from ._metadata import is_plain_name
from ._paths import Path, leaves, show
from ._pieces import volume
from ._safetensors import runs
from ._switch import JOURNAL, finish_switch, switch_files
from ._writer import Box, Save, Share, StorageWriter

__all__ = ["HuggingFaceStorageWriter", "JOURNAL", "finish_switch"]

_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<generation>[0-9a-f]{8})\.tmp")


class HuggingFaceStorageWriter(StorageWriter):
    """Writes `save(state_dict, storage_writer=...)` as a Hugging Face model directory at `path`.

    Tensors go to `model.safetensors`, or to `model-0000k-of-0000n.safetensors` files of at
    most `max_shard_size` each (an int of bytes or a size such as "5GB"; a larger tensor
    gets a file of its own) with `model.safetensors.index.json`. `extra_files` (name ->
    bytes, e.g. "config.json") are written by rank 0 and switched in with the weights. The
    state dict holds tensors only (DTensors and plain tensors, nested dicts flattened with
    dots). See this module for who writes what and for the crash-consistency guarantee.
    """

    writing = "writing the tensors"

    def __init__(self, path: Union[str, os.PathLike[str]], max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                 *, extra_files: Optional[Mapping[str, bytes]] = None) -> None:
        self.path = checkpoint_dir(path)
        parse_size(max_shard_size)
        self.max_shard_size = max_shard_size
        self.extra_files = dict(extra_files or {})
        bad = [n for n in self.extra_files if not is_plain_name(n) or _WEIGHTS.fullmatch(n) or n == INDEX]
        if bad:
            raise ValueError(f"extra_files names {bad} cannot be written beside the weights: use plain file names "
                             f"(no '/', not hidden) other than the weights' and the index's")

    def leaves(self, tree: dict[str, Any]) -> list[tuple[str, Path, Any]]:
        """(name, path, tensor) of each leaf, names dotted; TypeError listing the leaves that are not tensors."""
        named = [(show(path), path, leaf) for path, leaf in leaves(tree)]
        bad = [f"  - '{name}': {type(leaf).__name__} {repr(leaf)[:60]}" for name, _, leaf in named
               if not isinstance(leaf, torch.Tensor)]
        if bad:
            raise TypeError("a safetensors file holds tensors only; these state dict values are not tensors:\n"
                            + "\n".join(bad) + "\nleave them out, or save them with the native format")
        plan_files([(name, tuple(leaf.shape), leaf.dtype) for name, _, leaf in named], self.max_shard_size)  # dtypes
        return named

    def _files(self, save: Save) -> list[FileLayout]:
        return plan_files([(leaf.name, leaf.shape, leaf.dtype) for leaf in save.leaves
                           if leaf.shape is not None and leaf.dtype is not None], self.max_shard_size)

    def prepare(self, save: Save) -> None:
        _create(save.directory, self._files(save), self.extra_files, save.generation)

    def write(self, save: Save, shares: Sequence[Share]) -> None:
        _write_pieces(save, self._files(save), shares)

    def switch(self, save: Save, records: list[Any]) -> None:
        _switch(save.directory, self._files(save), self.extra_files, save.generation)

    def switched(self, save: Save) -> bool:
        """Every temporary file of this save has been renamed into place."""
        return not any(self.generation_of(n) == save.generation for n in os.listdir(save.directory))

    def generation_of(self, name: str) -> Optional[str]:
        found = _TEMPORARY.fullmatch(name)
        return found["generation"] if found and _ours(found["name"]) else None


def _temporary(name: str, generation: str) -> str:
    return f".{name}.{generation}.tmp"


def _new_names(files: list[FileLayout]) -> list[str]:
    """The data files, then the file loaders look for first (the index, or model.safetensors)."""
    return [f.name for f in files] + ([INDEX] if len(files) > 1 else [])


def _create(directory: FilePath, files: list[FileLayout], extra: dict[str, bytes], generation: str) -> None:
    """Rank 0: each data file under its temporary name, header written and at its full size;
    the index and the extra files whole."""
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian; this machine is not")
    for f in files:
        fd = os.open(directory / _temporary(f.name, generation), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, f.header, 0)
            os.ftruncate(fd, f.size)
            os.fsync(fd)
        finally:
            os.close(fd)
    whole = dict(extra, **({INDEX: index_json(files)} if len(files) > 1 else {}))
    for name, data in whole.items():
        with open(directory / _temporary(name, generation), "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())


def _write_pieces(save: Save, files: list[FileLayout], shares: Sequence[Share]) -> None:
    """Every rank: the bytes of its pieces at their offsets, then synced."""
    where = {s.name: (f.name, s) for f in files for s in f.slots}
    opened: dict[str, int] = {}
    try:
        for share in shares:
            if not volume(share.box):
                continue  # an empty tensor: no byte to write
            file, slot = where[save.leaves[share.leaf].name]
            if file not in opened:
                opened[file] = _open_shared(save.directory / _temporary(file, save.generation), save.rank)
            _write_box(opened[file], slot, share.box, share.value)
        for fd in opened.values():
            os.fsync(fd)
    finally:
        for fd in opened.values():
            os.close(fd)


def _open_shared(path: FilePath, rank: int) -> int:
    try:
        return os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        raise ValueError(f"rank {rank} cannot see {str(path)!r}, which rank 0 created: save to a directory on a "
                         f"filesystem every rank shares") from None


def _write_box(fd: int, slot: Slot, box: Box, piece: torch.Tensor) -> None:
    """`piece`, the values of `box` of the tensor in `slot`, into the file: run by run."""
    flat = piece.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()  # the elements' bytes, row-major (numpy arrays are buffers)
    size, done = slot.dtype.itemsize, 0
    for offset, length in runs(slot.shape, box):
        _pwrite_all(fd, raw[done:done + length * size], slot.begin + offset * size)
        done += length * size


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _switch(directory: FilePath, files: list[FileLayout], extra: dict[str, bytes], generation: str) -> None:
    """Rank 0, every rank's bytes synced: the renames behind a journal (see this module)."""
    new = _new_names(files)
    present = set(os.listdir(directory))
    stale = sorted(n for n in present if _WEIGHTS.fullmatch(n) and n not in new)
    if len(files) == 1 and INDEX in present:
        stale.append(INDEX)
    retire = [INDEX] if len(files) > 1 and INDEX in present and any(f.name in present for f in files) else []
    switch_files(directory, [(_temporary(n, generation), n) for n in [*extra, *new]], retire, stale)


def _ours(name: str) -> bool:
    return bool(_WEIGHTS.fullmatch(name)) or name in (INDEX, "config.json", "generation_config.json")
