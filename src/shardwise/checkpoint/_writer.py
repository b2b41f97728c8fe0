"""What `save` writes through: a storage writer, one per checkpoint format.

A writer answers where its bytes go and writes them; the save transaction (`_transaction`)
does the rest, the same for every format: checking the state dict, the ranks agreeing after
every step, who writes which piece (`_pieces`), copying the pieces for `async_save`, drawing
the generation that names this save's new files, rank 0 switching the new checkpoint in
atomically (never destroying the last complete one), finishing a switch a killed save left
half done, and removing what no checkpoint names. So a format is a small writer, as loading
has a small reader per format (`_storage`), and every format saves asynchronously too.

| attribute / method | what it answers |
|---|---|
| `path` | the directory it writes (`save`'s `checkpoint_id` overrides it) |
| `leaves(tree)` | the leaves of the state dict as (name, path, value), under this format's names; TypeError / ValueError for what it cannot hold |
| `agree_first` | True when every rank must hold the same names, shapes and dtypes before anything is written (files planned from them, or an index built from rank 0's names) |
| `prepare(save)` | rank 0, before any rank writes: the files every rank writes into (default: none) |
| `write(save, shares)` | every rank: write the bytes of its pieces; answer where they lie (a JSON value, or None), for rank 0's index |
| `switch(save, records)` | rank 0, every rank's bytes on disk: build the index from every rank's answer and switch it in atomically |
| `switched(save)` | whether the directory now holds this save (asked to tell the truth after a failure) |
| `generation_of(name)` | the generation that wrote file `name` ("" for a temporary of any save, None for a file not this format's) |
| `writing`, `switching`, `unchanged` | how errors name the write step, the switch step, and what a failure before the switch leaves |
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Optional

import torch

from .._redistribute import Box
from ._paths import Path, show

__all__ = ["Box", "Leaf", "Save", "Share", "StorageWriter", "check_loadable"]


@dataclass(frozen=True)
class Leaf:
    """A leaf of the state dict as every rank describes it: its name in the format, its path,
    and for a tensor its global shape, dtype and layout (None for a plain tensor); shape None
    for a plain value. Never the values: those travel as `Share`s."""

    name: str
    path: Path
    shape: Optional[tuple[int, ...]]
    dtype: Optional[torch.dtype]
    layout: Optional[str]


@dataclass(frozen=True)
class Share:
    """A piece this rank writes: of leaf number `leaf`, the global `box` (() for a plain value), and its value."""

    leaf: int
    box: Box
    value: Any


@dataclass(frozen=True)
class Save:
    """One save as a writer sees it: the directory, the generation naming its new files, this rank, the world, the leaves."""

    directory: FilePath
    generation: str
    rank: int
    world: int
    leaves: tuple[Leaf, ...]


class StorageWriter:
    """A checkpoint format `save(storage_writer=...)` writes (see the module docstring)."""

    path: FilePath
    agree_first: bool = True
    writing: str = "writing the data files"
    switching: str = "switching the new files into place"
    unchanged: str = "the directory was not changed: it holds the checkpoint it held before (if any)"

    def leaves(self, tree: dict[str, Any]) -> list[tuple[str, Path, Any]]:
        raise NotImplementedError

    def prepare(self, save: Save) -> None:
        """Rank 0, before any rank writes; by default nothing (each rank makes its own files)."""

    def write(self, save: Save, shares: Sequence[Share]) -> Any:
        raise NotImplementedError

    def switch(self, save: Save, records: list[Any]) -> None:
        raise NotImplementedError

    def switched(self, save: Save) -> bool:
        raise NotImplementedError

    def generation_of(self, name: str) -> Optional[str]:
        raise NotImplementedError


def _round_trip(value: Any) -> None:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)


def check_loadable(named: list[tuple[str, Path, Any]]) -> None:
    """Every non-tensor leaf must load back under `weights_only=True` (for formats that pickle values)."""
    plain = [(path, leaf) for _, path, leaf in named if not isinstance(leaf, torch.Tensor)]
    try:
        _round_trip([leaf for _, leaf in plain])
        return
    except Exception:
        pass
    bad = []
    for path, leaf in plain:
        try:
            _round_trip(leaf)
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            bad.append(f"  - '{show(path)}': {type(leaf).__name__} {repr(leaf)[:80]} ({reason})")
    raise TypeError(
        "these state dict values cannot be saved so that load can read them back with "
        "torch.load(weights_only=True):\n" + "\n".join(bad) + "\nA checkpoint holds tensors and plain values "
        "(None, bool, int, float, str, torch.dtype, and dicts, lists and tuples of them): convert these, or "
        "leave them out of the state dict"
    )
