"""Switching a save's new files into place: one atomic rename, or several behind a journal.

A format whose index is one file (`metadata.json`, DCP's `.metadata`) switches by writing it
under a temporary name and renaming it over the old one: a reader sees the old checkpoint or
the new one. A format whose files have fixed names (safetensors' `model.safetensors`,
`model-0000k-of-0000n...`) must rename several; `switch_files` first writes a journal
(`.shardwise-switch.json`) of the renames, then does them, the file a loader looks for
first renamed last. If rank 0 dies in between, the journal stays and the next save to the
directory finishes the switch before anything else (`finish_switch`): every file the journal
names is whole, so finishing is only renaming and removing.

| journal field | what it lists | when it is applied |
|---|---|---|
| `commit` | the temporary whose rename makes the save current | while it exists, the switch has not committed |
| `retire` | old files to remove before the renames (an index the new files replace under the same names) | before committing |
| `renames` | (temporary, final name) pairs, in order, the commit last | before committing |
| `remove` | old files the new save does not name | always |
"""

from __future__ import annotations

import json
import os
from pathlib import Path as FilePath
from typing import Any

from ._files import write_atomically

__all__ = ["JOURNAL", "finish_switch", "switch_files", "sync_directory"]

JOURNAL = ".shardwise-switch.json"


def sync_directory(directory: FilePath) -> None:
    """Make the directory's entries (a rename into it) durable, where the system allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not sync directories; the rename is atomic all the same
    finally:
        os.close(fd)


def switch_files(directory: FilePath, renames: list[tuple[str, str]], retire: list[str], remove: list[str]) -> None:
    """Rename each (temporary, final) pair, the last one committing the save, behind a journal (see above)."""
    journal = {"commit": renames[-1][0], "retire": retire, "remove": remove, "renames": [list(r) for r in renames]}
    write_atomically(directory / JOURNAL, lambda f: f.write(json.dumps(journal, indent=1).encode()))
    sync_directory(directory)
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
        sync_directory(directory)
    for name in journal["remove"]:
        (directory / name).unlink(missing_ok=True)
    sync_directory(directory)
    (directory / JOURNAL).unlink(missing_ok=True)
