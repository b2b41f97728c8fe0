"""Files on disk: atomic writes, and reading a data file back without pickle's trust.

Every file of a checkpoint is written under a temporary name, flushed to disk and renamed
into place, so a reader sees a whole file or none (a crash mid-write leaves only a temporary
file, never a truncated data file under the real name). Data files are read with
`torch.load(mmap=True, weights_only=True)`: tensors are mapped, not read, so a rank that
needs a corner of a piece reads those pages only, and a checkpoint cannot run code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path as FilePath
from typing import IO, Any

import torch

__all__ = ["checkpoint_dir", "read_data", "write_atomically"]


def checkpoint_dir(checkpoint_id: object) -> FilePath:
    """`checkpoint_id` as a directory path; TypeError if it is not a path."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_id must be the checkpoint's directory as a str or os.PathLike, got {checkpoint_id!r} "
            f"of type {type(checkpoint_id).__name__}"
        )
    return FilePath(checkpoint_id)


def write_atomically(target: FilePath, write: Callable[[IO[bytes]], Any]) -> None:
    """Call `write(f)` on a temporary file beside `target`, sync it, rename it to `target`."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()


def read_data(path: FilePath) -> tuple[list[Any], list[Any]]:
    """(entries, values) of data file `path`: what it says it holds, and the pieces and plain values."""
    if not path.is_file():
        raise ValueError(
            f"the checkpoint lists {path.name}, but {str(path)!r} does not exist: the directory was changed after "
            f"saving, or not every rank sees the same directory (put checkpoints on a filesystem every rank shares)"
        )
    try:
        payload = torch.load(path, mmap=True, weights_only=True)
        entries, values = payload["entries"], payload["values"]
    except Exception as exc:
        raise ValueError(f"cannot read checkpoint data file {str(path)!r} ({exc}): it was damaged") from exc
    if not isinstance(entries, list) or not isinstance(values, list):
        raise ValueError(f"checkpoint data file {str(path)!r} holds no list of entries and values: it was damaged")
    return entries, values
