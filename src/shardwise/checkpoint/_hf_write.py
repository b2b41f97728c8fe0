"""`HuggingFaceStorageWriter`: `save` as a Hugging Face safetensors directory, each rank writing its own bytes.

Every rank computes the files' layout (`_hf_layout`) from global shapes and dtypes, and
writes the bytes of the pieces it is responsible for (as in `save`: one replica of each
piece, Partial DTensors reduced first, plain tensors by rank 0) at their offsets in files
every rank opens: no rank gathers a whole tensor. The ranks agree (`_agree`) after checking
the state dicts, after claiming pieces, after rank 0 created the files, after every rank
wrote and synced its bytes, and after rank 0 switched the files into place.

Crash consistency. The names are fixed (`model.safetensors`, `model-0000k-of-0000n...`), so
a new save cannot sit beside the old one as the native format does; it is written under
temporary names (`.model.safetensors.<generation>.tmp`, hidden from loaders) and switched in:

- A failure or kill on any rank before the switch (writing the bytes: nearly all of a save)
  leaves the previous directory byte for byte as it was; every rank raises, rank 0 removes
  this save's temporary files (a killed save's are removed by the next completed save).
- The switch, on rank 0 once every rank's bytes are synced, writes a journal
  (`.shardwise-switch.json`) of the renames, then renames the files in: extra files
  (config.json) first, the data files, and last the file a loader looks for first (the
  index, or `model.safetensors`), then removes the old files the new save does not name.
  A loader sees the previous weights until that last rename and the new ones after it
  (transformers prefers `model.safetensors` to the index: going from one file to several,
  the old `model.safetensors` is removed only after the new index is in place). One window
  remains: when the new files have the old ones' names (same number of shards), the old
  index is removed before they are renamed over, so a loader during those few renames finds
  no weights and fails, rather than mixing old and new. The new config.json precedes the
  new weights by those renames too. If rank 0 dies inside the switch, the journal stays and
  the next save to the directory finishes the switch first (every file it names is whole).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path as FilePath
from typing import Any, Optional, Union

import torch

from .._redistribute._exchange import Box
from .._tensor import DTensor
from ._files import checkpoint_dir, write_atomically
from ._hf_layout import DEFAULT_MAX_SHARD_SIZE, INDEX, FileLayout, Slot, index_json, parse_size, plan_files, runs
from ._metadata import is_plain_name
from ._paths import is_stateful, leaves, show
from ._save import _agree, _claimed_below, _fingerprint, _my_boxes, _narrowed, _rank_and_world, _reduced, _sync_directory
from ._writer import StorageWriter

__all__ = ["HuggingFaceStorageWriter", "JOURNAL"]

JOURNAL = ".shardwise-switch.json"
_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<generation>[0-9a-f]{8})\.tmp")
_UNCHANGED = "the directory was not changed: it holds the save it held before (if any)"


class HuggingFaceStorageWriter(StorageWriter):
    """Writes `save(state_dict, storage_writer=...)` as a Hugging Face model directory at `path`.

    Tensors go to `model.safetensors`, or to `model-0000k-of-0000n.safetensors` files of at
    most `max_shard_size` each (an int of bytes or a size such as "5GB"; a larger tensor
    gets a file of its own) with `model.safetensors.index.json`. `extra_files` (name ->
    bytes, e.g. "config.json") are written by rank 0 and switched in with the weights. The
    state dict holds tensors only (DTensors and plain tensors, nested dicts flattened with
    dots). See this module for who writes what and for the crash-consistency guarantee.
    """

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

    def write(self, state_dict: Mapping[str, Any], checkpoint_id: Optional[FilePath] = None) -> None:
        _Save(checkpoint_id or self.path, self.max_shard_size, self.extra_files).run(state_dict)


class _Save:
    def __init__(self, directory: FilePath, max_shard_size: Union[int, str], extra: dict[str, bytes]) -> None:
        self.directory, self.max_shard_size, self.extra = directory, max_shard_size, extra
        self.rank, self.world = _rank_and_world()

    def agree(self, step: str, error: Optional[Exception], count: int = 0, outcome: Any = _UNCHANGED) -> list[int]:
        return _agree(step, error, self.directory, self.world, count, outcome=outcome)

    def run(self, state_dict: Mapping[str, Any]) -> None:
        directory, rank, world = self.directory, self.rank, self.world
        error: Optional[Exception] = None
        items: list[tuple[str, Any]] = []
        files: list[FileLayout] = []
        claims: list[int] = []
        digest = 0
        try:
            items = _tensors(state_dict)
            files = plan_files([(name, tuple(leaf.shape), leaf.dtype) for name, leaf in items], self.max_shard_size)
            digest = _digest([(name, list(leaf.shape), str(leaf.dtype)) for name, leaf in items])
            claims = [_fingerprint((name,), box) for name, leaf in items
                      if isinstance(leaf, DTensor) and leaf.device_mesh.size() < world for box, _ in _my_boxes(leaf)]
            if directory.exists() and not directory.is_dir():
                raise ValueError(f"{str(directory)!r} is a file: pass a directory (it is created if missing)")
            directory.mkdir(parents=True, exist_ok=True)
            if rank == 0:
                finish_switch(directory)  # of a save whose rank 0 died while switching
        except Exception as exc:
            error = exc
        digests = self.agree("checking the state dict", error, digest)
        if len(set(digests)) > 1:
            raise ValueError(f"save to {str(directory)!r}: the ranks' state dicts differ in names, shapes or dtypes "
                             f"(ranks {[r for r, d in enumerate(digests) if d != digests[0]]} differ from rank 0): "
                             f"pass every rank the same model. {_UNCHANGED}")
        generation = f"{self.agree('drawing a generation', None, secrets.randbits(31))[0]:08x}"
        taken = _claimed_below(rank, world, claims, self.agree("claiming pieces", None, len(claims)))
        with torch.no_grad():
            items = [(name, _reduced(leaf) if isinstance(leaf, DTensor) else leaf) for name, leaf in items]
        try:
            if rank == 0:
                error = _attempt(lambda: _create(directory, files, self.extra, generation))
            self.agree("creating the files", error)
            error = _attempt(lambda: _write_pieces(directory, files, items, taken, rank, generation))
            self.agree("writing the tensors", error)
        except BaseException:
            if rank == 0:
                _remove_temporaries(directory, generation)
            raise
        if rank == 0:
            error = _attempt(lambda: _switch(directory, files, self.extra, generation))
        self.agree("switching the new files into place", error, outcome=lambda: _switch_outcome(directory, generation))


def _attempt(step: Any) -> Optional[Exception]:
    try:
        step()
    except Exception as exc:
        return exc
    return None


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(json.dumps(value).encode(), digest_size=8).digest(), "big") >> 1


def _tensors(state_dict: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, tensor) of each leaf, names dotted; TypeError listing the leaves that are not tensors."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict of names to tensors, got {type(state_dict).__name__}")
    tree = {key: value.state_dict() if is_stateful(value) else value for key, value in state_dict.items()}
    found = [(show(path), leaf) for path, leaf in leaves(tree)]
    bad = [f"  - '{name}': {type(leaf).__name__} {repr(leaf)[:60]}" for name, leaf in found
           if not isinstance(leaf, torch.Tensor)]
    if bad:
        raise TypeError("a safetensors file holds tensors only; these state dict values are not tensors:\n"
                        + "\n".join(bad) + "\nleave them out, or save them with the native format")
    return found


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


def _my_pieces(name: str, leaf: torch.Tensor, rank: int, taken: set[int]) -> Iterator[tuple[Box, torch.Tensor]]:
    """(global box, values) of each piece of `leaf` this rank writes."""
    if isinstance(leaf, DTensor):
        for box, at in _my_boxes(leaf):
            if not (taken and _fingerprint((name,), box) in taken):
                yield box, _narrowed(leaf.to_local(), at)
    elif rank == 0 and leaf.numel():
        yield tuple((0, s) for s in leaf.shape), leaf


def _write_pieces(directory: FilePath, files: list[FileLayout], items: list[tuple[str, Any]], taken: set[int],
                  rank: int, generation: str) -> None:
    """Every rank: the bytes of its pieces at their offsets, then synced."""
    where = {s.name: (f.name, s) for f in files for s in f.slots}
    opened: dict[str, int] = {}
    try:
        for name, leaf in items:
            file, slot = where[name]
            for box, piece in _my_pieces(name, leaf, rank, taken):
                if file not in opened:
                    opened[file] = _open_shared(directory / _temporary(file, generation), rank)
                _write_box(opened[file], slot, box, piece)
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
    """Rank 0, every rank's bytes synced: the journal, then the renames (see this module)."""
    new = _new_names(files)
    present = set(os.listdir(directory))
    stale = sorted(n for n in present if _WEIGHTS.fullmatch(n) and n not in new)
    if len(files) == 1 and INDEX in present:
        stale.append(INDEX)
    retire = [INDEX] if len(files) > 1 and INDEX in present and any(f.name in present for f in files) else []
    journal = {"commit": _temporary(new[-1], generation), "retire": retire, "remove": stale,
               "renames": [[_temporary(n, generation), n] for n in [*extra, *new]]}
    write_atomically(directory / JOURNAL, lambda f: f.write(json.dumps(journal, indent=1).encode()))
    _sync_directory(directory)
    _apply(directory, journal)


def finish_switch(directory: FilePath) -> None:
    """Finish the switch a journal in `directory` describes, if any (rank 0 died inside it)."""
    try:
        journal = json.loads((directory / JOURNAL).read_text())
    except FileNotFoundError:
        return
    except ValueError:
        (directory / JOURNAL).unlink()  # a journal is renamed in whole: a damaged one is not ours
        return
    _apply(directory, journal)


def _apply(directory: FilePath, journal: dict[str, Any]) -> None:
    if (directory / journal["commit"]).exists():  # not committed yet: nothing of this save is visible to loaders
        for name in journal["retire"]:
            (directory / name).unlink(missing_ok=True)
        for temporary, final in journal["renames"]:
            if (directory / temporary).exists():
                os.replace(directory / temporary, directory / final)
        _sync_directory(directory)
    for name in journal["remove"]:
        (directory / name).unlink(missing_ok=True)
    _sync_directory(directory)
    (directory / JOURNAL).unlink(missing_ok=True)
    _remove_temporaries(directory)


def _remove_temporaries(directory: FilePath, generation: Optional[str] = None) -> None:
    """The temporary files of save `generation` (or, None, of every save: none is running)."""
    for name in os.listdir(directory):
        found = _TEMPORARY.fullmatch(name)
        if found and (generation is None or found["generation"] == generation) and _ours(found["name"]):
            (directory / name).unlink(missing_ok=True)


def _ours(name: str) -> bool:
    return bool(_WEIGHTS.fullmatch(name)) or name in (INDEX, "config.json", "generation_config.json")


def _switch_outcome(directory: FilePath, generation: str) -> str:
    """What a failure in or after the switch left, looked up in the directory."""
    if not any(_TEMPORARY.fullmatch(n) and n.endswith(f".{generation}.tmp") for n in os.listdir(directory)):
        return "the directory holds this save: every file was switched into place"
    if (directory / JOURNAL).exists():
        return (f"the switch did not finish: the next save to this directory finishes it (its journal {JOURNAL} "
                "names whole files); until then the directory may load nothing")
    return _UNCHANGED
