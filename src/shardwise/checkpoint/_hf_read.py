"""Loading Hugging Face safetensors into a state dict of shards: `HuggingFaceStorageReader`, `load_pretrained`.

The reader hands `load` the same table of pieces as the native format: one entry per
tensor name (the state dict's key, a path of one key) with one piece, the whole tensor, in
the file that holds it. `load` then plans each rank's copies from the parts of each tensor
that rank holds, and only those parts are read: `value` gives a `_FileRegion`, a lazy
stand-in for the tensor that `narrow` cuts without reading, and that is read the moment
torch is asked to use it (`target.copy_(region)`, through torch's `__torch_function__`
protocol for tensor-like objects). A region reads its bytes with one `pread` per run of
contiguous elements (`runs`): a block of rows at once, otherwise row by row, so a rank
reads its pieces' bytes and no others, whatever the layout, and host memory holds at most
one region beside the state dict (the copy casts, so a bf16 file fills fp32 parameters).

Nothing is read before every header is checked (`read_header`), every file the index
names is found, and every tensor is where the index says, so a damaged checkpoint is a
ValueError naming the file and the tensor, and `load` changes nothing.

`load(state_dict, storage_reader=...)` follows `load`'s rules (those of torch's DCP): with
`strict=True` every key of the state dict must be in the files, and tensors the state dict
does not ask for are skipped. `load_pretrained(model, path, strict=True)` follows
`model.load_state_dict(strict=True)` instead: a tensor in the files that the model lacks is
an error too, except what the model's class tells transformers to ignore; a weight the
model ties to another (`lm_head.weight` to the token embedding), which `save_pretrained`
leaves out of the files, is read from the tensor it is tied to.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path as FilePath
from typing import Any, NamedTuple, Optional, Union

import torch

from .._redistribute import Box
from .._source_names import source_names
from ._agree import agree
from ._load import _load_group, load
from ._metadata import Entry, Piece, Table, dtype_name, is_plain_name
from ._paths import Path as KeyPath
from ._safetensors import Header, TensorInfo, read_header, runs
from ._storage import StorageReader

__all__ = ["HuggingFaceStorageReader", "IncompatibleKeys", "load_pretrained"]

INDEX = "model.safetensors.index.json"


class _FileRegion:
    """A box of one tensor in a safetensors file, not yet read: `narrow` cuts it, any torch
    use (a `copy_` into it) reads exactly its bytes first."""

    def __init__(self, reader: HuggingFaceStorageReader, path: FilePath, info: TensorInfo, box: Box) -> None:
        self.reader, self.path, self.info, self.box = reader, path, info, box

    @property
    def shape(self) -> torch.Size:
        return torch.Size(n for _, n in self.box)

    @property
    def dtype(self) -> torch.dtype:
        return self.info.dtype

    def narrow(self, dim: int, start: int, length: int) -> _FileRegion:
        begin, size = self.box[dim]
        if not (0 <= start and 0 <= length and start + length <= size):
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside {self!r}")
        box = self.box[:dim] + ((begin + start, length),) + self.box[dim + 1:]
        return _FileRegion(self.reader, self.path, self.info, box)

    def read(self) -> torch.Tensor:
        """The region's values, read with one pread per run of contiguous elements."""
        itemsize = self.info.dtype.itemsize
        numel = math.prod(self.shape)
        if numel == 0:
            return torch.empty(self.shape, dtype=self.info.dtype)
        data = bytearray(numel * itemsize)
        view, at = memoryview(data), 0
        where = f"safetensors file {str(self.path)!r}, tensor {self.info.name!r}"
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self.reader.sizes[self.path.name]:
                raise ValueError(f"{where}: the file changed size since its header was read: it was replaced "
                                 f"or truncated during the load")
            for offset, count in runs(self.info.shape, self.box):
                nbytes, start = count * itemsize, self.info.begin + offset * itemsize
                done = 0
                while done < nbytes:
                    got = os.preadv(f.fileno(), [view[at + done:at + nbytes]], start + done)
                    if got <= 0:
                        raise ValueError(f"{where}: the file ended at byte {start + done}, inside the tensor: "
                                         f"it was truncated during the load")
                    done += got
                self.reader.bytes_read += nbytes
                at += nbytes
        return torch.frombuffer(data, dtype=torch.uint8).view(self.info.dtype).view(self.shape)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        args = tuple(a.read() if isinstance(a, _FileRegion) else a for a in args)
        kwargs = {k: v.read() if isinstance(v, _FileRegion) else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"_FileRegion({str(self.path)!r}, {self.info.name!r}, box={self.box})"


class HuggingFaceStorageReader(StorageReader):
    """Reads a Hugging Face checkpoint: a directory of `*.safetensors` files (several named by
    `model.safetensors.index.json`, or one), or one `.safetensors` file. Use it as torch's DCP
    uses its reader: `load(model.state_dict(), storage_reader=HuggingFaceStorageReader(path))`.

    `aliases` maps a state dict key to the name of the saved tensor that fills it (a tied
    weight the files leave out); `bytes_read` counts the tensor bytes this reader has read.
    """

    casts = True

    def __init__(self, path: Union[str, os.PathLike[str]], *, aliases: Optional[Mapping[str, str]] = None) -> None:
        self.path = FilePath(path)
        self.aliases = dict(aliases or {})
        self.bytes_read = 0
        self.sizes: dict[str, int] = {}
        self.headers: dict[str, Header] = {}
        self.directory = self.path
        self._where: dict[str, tuple[str, TensorInfo]] = {}
        self._table: Optional[Table] = None

    def describe(self) -> str:
        return f"the checkpoint {str(self.path)!r}"

    def _files(self) -> tuple[FilePath, dict[str, list[str]]]:
        """The directory and, per file, the tensors the index puts in it (None: all it holds)."""
        if self.path.is_file():
            return self.path.parent, {self.path.name: []}
        if not self.path.is_dir():
            raise ValueError(f"{str(self.path)!r} is neither a safetensors file nor a directory: pass the directory "
                             f"save_pretrained wrote")
        index = self.path / INDEX
        if not index.is_file():
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not found:
                raise ValueError(f"{str(self.path)!r} has no {INDEX} and no .safetensors file: it is not a Hugging "
                                 f"Face checkpoint in safetensors format")
            return self.path, {name: [] for name in found}
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and is_plain_name(v)
                                                           for k, v in weight_map.items()):
                raise ValueError("'weight_map' is not a map of tensor names to file names in its directory")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"index file {str(index)!r} is damaged ({type(exc).__name__}: {exc})") from exc
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = [f"{str(self.path / f)!r} (holding {', '.join(repr(n) for n in names[:3])}"
                   f"{' and more' if len(names) > 3 else ''})" for f, names in files.items()
                   if not (self.path / f).is_file()]
        if missing:
            raise ValueError(f"index file {str(index)!r} names files that are not there: {', '.join(missing)}: "
                             f"copy every file of the checkpoint")
        return self.path, files

    def read_table(self) -> Table:
        if self._table is not None:
            return self._table
        directory, files = self._files()
        where: dict[str, tuple[str, TensorInfo]] = {}
        for file, names in files.items():
            header = read_header(directory / file)
            self.headers[file] = header
            self.sizes[file] = (directory / file).stat().st_size
            for name in names:
                if name not in header.tensors:
                    raise ValueError(f"safetensors file {str(directory / file)!r} does not hold tensor {name!r}, "
                                     f"which the index {INDEX!r} puts there: the checkpoint is damaged")
            for name, info in header.tensors.items():
                if names and name not in names:
                    continue  # the index puts it elsewhere (or nowhere): not read from here
                if name in where:
                    raise ValueError(f"tensor {name!r} is in both {str(directory / where[name][0])!r} and "
                                     f"{str(directory / file)!r}: the checkpoint is damaged")
                where[name] = (file, info)
        self.directory = directory
        for key, source in self.aliases.items():
            if source in where and key not in where:
                where[key] = where[source]
        entries: dict[KeyPath, Entry] = {
            (name,): Entry((name,), "tensor", info.shape, dtype_name(info.dtype), "safetensors",
                           (Piece(file, 0, tuple((0, n) for n in info.shape)),))
            for name, (file, info) in where.items()
        }
        self._where = where
        self._table = Table(entries, dict(self.sizes))
        return self._table

    def value(self, piece: Piece, entry: Entry) -> Any:
        file, info = self._where[str(entry.path[0])]
        return _FileRegion(self, self.directory / file, info, piece.box)


class IncompatibleKeys(NamedTuple):
    """What `load_pretrained` did not match (as `nn.Module.load_state_dict` returns it)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _patterns(model: Any, name: str) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(model, name, None) or ())]


def load_pretrained(model: torch.nn.Module, path: Union[str, os.PathLike[str]], *, strict: bool = True
                    ) -> IncompatibleKeys:
    """Fill `model`'s parameters and buffers, in whatever layout they have, from the Hugging
    Face checkpoint at `path` (what `save_pretrained` wrote); every rank of the model calls it.

    `model` is a transformers model, or a pipeline cut from one (`hf_sequential(model)`, or a
    `DistributedPipe` of it, each rank filling the stages it holds): a pipeline's tensors are
    looked up by their names in the model it was cut from.

    Keys match as in `model.load_state_dict(strict=strict)`: with `strict=True` a key the
    model has but the files lack, or the other way round, is a ValueError listing them all,
    raised on every rank before anything is read (for a pipeline, a key in the files is
    expected when any stage of the whole model holds it). Not counted as missing: a weight the
    model ties to another (transformers' `all_tied_weights_keys`), which is read from the
    tensor it is tied to, and keys matching the model's `_keys_to_ignore_on_load_missing`; not
    counted as unexpected: keys matching `_keys_to_ignore_on_load_unexpected`. Buffers that
    are not in the state dict (rotary tables) are not in the files either: they are computed
    afresh by the model's own `_init_weights` (a transformers model's) on the modules that hold
    such buffers and no parameters, so a model materialised with `to_empty` needs nothing
    else. Returns the keys that did not match, by the model's names.
    """
    source = source_names(model)
    hf: Any = model
    names: Mapping[str, str] = {}
    if source is not None:
        hf = source.source_model()
        if hf is None:
            raise ValueError(f"{type(model).__name__} was cut from a model that no longer exists, and load_pretrained "
                             "takes that model's tied weights, ignore lists and init from it: keep the model "
                             "given to hf_sequential alive until the load is done")
        names = source.names
    state = {names.get(k, k): v for k, v in model.state_dict().items()}
    every = source.keys if source is not None else frozenset(state)
    tied = dict(getattr(hf, "all_tied_weights_keys", None) or {})
    reader = HuggingFaceStorageReader(path, aliases=tied)
    error: Optional[Exception] = None
    targets: dict[str, Any] = {}
    result = IncompatibleKeys([], [])
    try:
        saved = {str(p[0]) for p in reader.read_table().entries}
        params = {names.get(k, k): v for k, v in model.named_parameters(remove_duplicate=False)}
        # a tied weight that is still one parameter with its source is filled through it
        same = {k for k, s in tied.items() if k in params and params[k] is params.get(s)}
        targets = {k: v for k, v in state.items() if k not in same}
        ignore_missing = _patterns(hf, "_keys_to_ignore_on_load_missing")
        ignore_unexpected = _patterns(hf, "_keys_to_ignore_on_load_unexpected")
        result = IncompatibleKeys(
            [k for k in state if k not in saved and k not in same and not any(p.search(k) for p in ignore_missing)],
            sorted(k for k in saved if k not in every and k not in tied
                   and not any(p.search(k) for p in ignore_unexpected)))
        if strict and (result.missing_keys or result.unexpected_keys):
            lines = [f"  - {what}: {', '.join(repr(k) for k in keys[:20])}{' and more' if len(keys) > 20 else ''}"
                     for what, keys in (("missing from the files", result.missing_keys),
                                        ("in the files but not in the model", result.unexpected_keys)) if keys]
            raise ValueError(f"cannot load {reader.describe()} into {type(model).__name__}; nothing was loaded:\n"
                             + "\n".join(lines) + "\n  load a checkpoint of this model's configuration, or pass "
                             "strict=False to load the keys both have")
    except Exception as exc:
        error = exc
    group, size = _load_group(None, False)
    agree(f"load_pretrained from {str(reader.path)!r}", "matching the model's keys against the files", error, group,
          size, "nothing was loaded, on any rank")
    entries = reader.read_table().entries if error is None else {}
    load({k: v for k, v in targets.items() if (k,) in entries}, storage_reader=reader, strict=False)
    _recompute_buffers(model, hf)
    return result


def _recompute_buffers(model: torch.nn.Module, hf: Any) -> None:
    """Recompute the buffers no file holds (non-persistent: rotary tables) with the init of
    `hf` (the transformers model), on the modules of `model` that hold such buffers and no
    parameters (nothing loaded is touched)."""
    init = getattr(hf, "_init_weights", None)
    if not callable(init):
        return
    with torch.no_grad():
        for module in model.modules():
            if module._non_persistent_buffers_set and next(module.parameters(recurse=False), None) is None:
                init(module)
