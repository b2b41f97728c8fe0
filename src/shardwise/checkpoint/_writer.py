"""`StorageWriter`: what `save(storage_writer=...)` writes through, for a format other than the native one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path as FilePath
from typing import Any, Optional

__all__ = ["StorageWriter"]


class StorageWriter:
    """A checkpoint format `save` can write (`HuggingFaceStorageWriter`): `write` is called on
    every rank with the state dict, and with the directory when `save` was given a
    `checkpoint_id` too (else the writer writes where it was told when made)."""

    def write(self, state_dict: Mapping[str, Any], checkpoint_id: Optional[FilePath] = None) -> None:
        raise NotImplementedError
