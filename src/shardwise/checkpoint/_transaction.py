"""`save` and `async_save`: one save transaction, whatever the format, that never destroys the last checkpoint.

A format is a `StorageWriter` (`_writer`): it says where its bytes go and writes them. The
transaction does the rest, in the same steps for every format, the ranks agreeing after each
(`_agree`: one all_gather of a flag and a few ints, through `_comm`):

| step | who | what | then the ranks agree that every rank finished |
|---|---|---|---|
| check | every rank | the state dict by the writer's rules; claims on pieces other meshes hold too (`_pieces`); rank 0 finishes a switch a killed save left, draws the generation naming this save's files, and readies the writer's shared files | "checking the state dict" (with rank 0's generation, each rank's names and shapes, its number of claims) |
| take | every rank | reduce Partial DTensors, take this rank's pieces (copies, for `async_save`) | - |
| write | every rank | the writer writes the bytes of its pieces, beside the files of the current checkpoint, never over them | the writer's write step ("writing the data files"); then rank 0 gathers where every rank's pieces lie |
| switch | rank 0 | the writer builds the index and switches it in: one atomic rename (or several behind a journal, `_switch`) | the writer's switch step ("writing metadata.json") |
| clean | rank 0 | remove the files no checkpoint names: older generations, temporaries of killed saves | - |

The ranks may hold different leaves (a pipeline's stages, each rank its own): each leaf is
written by its holders as the table of `_pieces` says, and a format that plans its files from
the leaves (safetensors, DCP's table) plans them from every rank's, gathered once after the
check (`_planned_from_all`).

A failure on any rank stops every rank at the next agreement, with an error naming the
operation (`save to '<directory>'`), the step and the ranks that failed, and saying what the
directory holds: before the switch, the checkpoint it held before, whole (rank 0 removes
this save's files); after it, this save. A rank killed anywhere leaves one or the other.

`async_save` runs check and take before it returns, then write, switch and clean on a
thread, agreeing over a gloo group of its own (`_groups.side_group`) so that the thread's
collectives never interleave with the training's. So every format saves asynchronously.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .._mesh import side_group
from .._tensor import DTensor
from ._agree import agree, agree_rows, gather_json, pack
from ._async import SaveFuture, finish_pending, in_background
from ._files import checkpoint_dir
from ._paths import Path, is_stateful
from ._pieces import ABSENT, claimed_below, claims, describe, differing_values, plain_claims, reduced, shares
from ._save import NativeWriter
from ._switch import JOURNAL, finish_switch
from ._writer import Leaf, Save, Share, StorageWriter

__all__ = ["save", "async_save"]


def save(state_dict: Mapping[str, Any], *, checkpoint_id: Union[str, os.PathLike[str], None] = None,
         storage_writer: Optional[StorageWriter] = None) -> None:
    """Save `state_dict` into the directory `checkpoint_id`, each rank writing only its own pieces.

    With `storage_writer` (a `HuggingFaceStorageWriter`, or a `FileSystemWriter` for torch's
    DCP format), the checkpoint is in the writer's format, with the same guarantees;
    `checkpoint_id`, if given, overrides the writer's path.

    Call it on every rank of the world with the same directory, on a filesystem every rank
    shares (each rank writes its own pieces there; rank 0 writes the index). The state dict
    may nest dicts, lists and tuples (an optimizer's `state_dict()`); a top-level value with
    `state_dict()` and `load_state_dict()` (a module, an optimizer) is saved as its
    `state_dict()`. Leaves are DTensors, plain tensors, and plain values (numbers, strings,
    None, ...); see `_pieces` for who writes what.

    A DTensor with Partial placements is reduced before saving (one all_reduce over those
    mesh dims, as `redistribute` to Replicate would do), so the checkpoint holds its global
    value; the DTensor in the state dict is not changed. The checkpoint records no mesh:
    `load` puts the global values onto whatever meshes and layouts the target has.

    When `save` returns on any rank, the checkpoint is complete. If it fails on any rank,
    every rank raises (the failed rank its own error, the others a RuntimeError naming it),
    and the directory still loads the checkpoint it held before, if any: the new files are
    written beside the ones its `metadata.json` names and become current only when the new
    `metadata.json` replaces it, in one atomic rename (see `_metadata`). A rank that fails
    after that rename (rank 0 dying before the others heard it finished) still makes every
    rank raise, but the errors say the checkpoint is complete, as the directory is then
    looked at. A completed save removes the files no metadata names (older generations,
    temporary files of killed saves).
    """
    finish_pending()
    job = _prepare(state_dict, *_the_writer(checkpoint_id, storage_writer), staged=False)
    job.finish(dist.group.WORLD if job.save.world > 1 else None)


def async_save(state_dict: Mapping[str, Any], *, checkpoint_id: Union[str, os.PathLike[str], None] = None,
               storage_writer: Optional[StorageWriter] = None) -> SaveFuture:
    """`save`, with the files written by a background thread while training goes on; any format.

    Everything that needs the state dict or the model's process groups happens before it
    returns, on every rank: checking the state dict, reducing Partial DTensors, and copying
    each piece this rank writes to CPU memory (so the next optimizer step may change the
    parameters at once; the copy costs this rank's share of the checkpoint in host memory
    until the files are written). A thread then writes the files and rank 0 switches them
    in, the ranks agreeing over a gloo process group of their own (made at the first call,
    on every rank), with the guarantees of `save`: the directory loads the checkpoint it held
    before until the new one is complete.

    Returns a `SaveFuture` (a `concurrent.futures.Future`): `result()` waits and raises what
    the save raised. Only one save runs at a time: the next `save`, `async_save` or `load`
    waits for this one, and raises its error if nobody asked for it, so a failed save is
    never silent. Wait for it before `destroy_process_group`.
    """
    finish_pending()
    writer, directory = _the_writer(checkpoint_id, storage_writer)
    group = side_group("checkpoint async_save", "gloo") if _rank_and_world()[1] > 1 else None
    job = _prepare(state_dict, writer, directory, staged=True)
    return in_background(lambda: job.finish(group), str(directory))


def _the_writer(checkpoint_id: Union[str, os.PathLike[str], None], storage_writer: Optional[StorageWriter]
                ) -> tuple[StorageWriter, FilePath]:
    if storage_writer is None and checkpoint_id is not None:
        directory = checkpoint_dir(checkpoint_id)
        return NativeWriter(directory), directory
    if isinstance(storage_writer, StorageWriter):
        return storage_writer, storage_writer.path if checkpoint_id is None else checkpoint_dir(checkpoint_id)
    raise TypeError(f"save needs checkpoint_id= (a directory) or storage_writer= (a StorageWriter: "
                    f"HuggingFaceStorageWriter, FileSystemWriter); got storage_writer={type(storage_writer).__name__}")


@dataclass
class _Job:
    """A save checked and agreed on by every rank, this rank's pieces in hand, nothing written yet."""

    writer: StorageWriter
    save: Save
    shares: list[Share]
    error: Optional[Exception]

    def finish(self, group: Any) -> None:
        """The write, switch and clean steps (see the module), agreeing over `group`."""
        writer, save, error = self.writer, self.save, self.error
        action, packed = _action(save.directory), []
        with _abandoned_on_failure(writer, save.directory, save.generation if save.rank == 0 else None):
            if error is None:
                try:
                    answer = writer.write(save, self.shares)
                    packed = [] if answer is None else pack(answer)
                except Exception as exc:
                    error = exc
            self.shares = []  # written: the copies of async_save are freed
            widths = agree(action, writer.writing, error, group, save.world, writer.unchanged, len(packed))
            records = gather_json(action, "where every rank's pieces lie", packed, max(widths), group, save.world,
                                  writer.unchanged)
        if save.rank == 0:
            try:
                writer.switch(save, records)
            except Exception as exc:
                error = exc
        agree(action, writer.switching, error, group, save.world, lambda: _outcome(writer, save))
        if save.rank == 0:
            _remove(writer, save.directory, lambda generation: generation != save.generation)


def _prepare(state_dict: Mapping[str, Any], writer: StorageWriter, directory: FilePath, staged: bool) -> _Job:
    """The check and take steps (see the module): every rank's pieces in hand, nothing written."""
    rank, world = _rank_and_world()
    error: Optional[Exception] = None
    named: list[tuple[str, Path, Any]] = []
    mine: list[int] = []
    leaves: tuple[Leaf, ...] = ()
    drawn: Optional[str] = None
    signature = 0
    plain: list[int] = []
    try:
        named = _leaves(state_dict, writer, directory)
        mine, plain = claims(named, world), plain_claims(named)
        leaves = tuple(describe(*item) for item in named)
        signature = _signature(leaves) if writer.agree_first else 0
        if rank == 0:
            finish_switch(directory)  # of a save whose rank 0 died while switching
            drawn = _fresh_generation(directory)
            writer.prepare(Save(directory, drawn, rank, world, leaves))
    except Exception as exc:
        error = exc
    with _abandoned_on_failure(writer, directory, drawn):
        rows = agree_rows(_action(directory), "checking the state dict", error, _world_group(world), world,
                          writer.unchanged, [int(drawn or "0", 16), signature, len(mine), _digest(plain), len(plain)])
        save = Save(directory, f"{rows[0][0]:08x}", rank, world, leaves)
        if any(row[1] != rows[0][1] for row in rows):  # the ranks hold different leaves (a pipeline's stages)
            save, named = _planned_from_all(writer, save, named, drawn)
        taken = claimed_below(rank, world, mine, [row[2] for row in rows])
        plain_taken = None
        if any(row[3] != rows[0][3] for row in rows):  # different plain leaves (a pipeline's stages): the lowest
            plain_taken = claimed_below(rank, world, plain, [row[4] for row in rows])  # holder writes each
            differ = differing_values(named, world, [row[4] for row in rows])
            if differ:
                raise ValueError(
                    f"{_action(directory)}: plain values that differ between the ranks holding them under one name: "
                    f"{', '.join(repr(n) for n in differ[:10])}; a checkpoint holds one: give every rank the same "
                    "value, or a name of its own (a pipeline's optimizer: get_optimizer_state_dict(..., options="
                    "StateDictOptions(flatten_optimizer_state_dict=True)) names each group's settings by parameter). "
                    f"{writer.unchanged}")
        with torch.no_grad():
            named = [(name, path, reduced(leaf) if isinstance(leaf, DTensor) else leaf) for name, path, leaf in named]
    pieces: list[Share] = []
    try:
        pieces = shares(named, rank, taken, staged, plain_taken)
    except Exception as exc:
        error = exc  # told to every rank at the next agreement, after the write step
    return _Job(writer, save, pieces, error)


def _planned_from_all(writer: StorageWriter, save: Save, named: list[tuple[str, Path, Any]], drawn: Optional[str]
                      ) -> tuple[Save, list[tuple[str, Path, Any]]]:
    """For a writer that plans its files from the leaves, when the ranks hold different ones: the
    save over every rank's leaves, each name once (rank 0's, then each rank's new ones in rank
    order), and this rank's leaves in that order (`ABSENT` where it holds none); rank 0 plans
    the files anew from them. A name held with different shapes, dtypes or layouts is a
    ValueError on every rank naming each."""
    action, group = _action(save.directory), _world_group(save.world)
    described = [[leaf.name, list(leaf.path), None if leaf.shape is None else list(leaf.shape),
                  None if leaf.dtype is None else str(leaf.dtype).removeprefix("torch."), leaf.layout]
                 for leaf in save.leaves]
    packed = pack(described)
    widths = agree(action, "describing each rank's leaves", None, group, save.world, writer.unchanged, len(packed))
    union: dict[str, tuple[Leaf, int]] = {}
    problems = []
    for r, row in enumerate(gather_json(action, "every rank's leaves", packed, max(widths), group, save.world,
                                        writer.unchanged)):
        for name, path, shape, dtype, layout in row or []:
            leaf = Leaf(name, tuple(path), None if shape is None else tuple(shape),
                        None if dtype is None else getattr(torch, dtype), layout)
            first = union.setdefault(name, (leaf, r))
            if first[0] != leaf:
                problems.append(f"'{name}' is {_shown(first[0])} on rank {first[1]} but {_shown(leaf)} on rank {r}")
    if problems:
        raise ValueError(f"{action}: the ranks' state dicts hold one name with different shapes, dtypes or layouts:\n"
                         "  - " + "\n  - ".join(problems) + f"\n{writer.unchanged}")
    whole = Save(save.directory, save.generation, save.rank, save.world, tuple(leaf for leaf, _ in union.values()))
    mine = {name: (name, path, value) for name, path, value in named}
    error: Optional[Exception] = None
    if save.rank == 0:
        try:
            _remove(writer, save.directory, lambda generation: generation == drawn)  # planned from rank 0's alone
            writer.prepare(whole)
        except Exception as exc:
            error = exc
    agree(action, "planning the files from every rank's leaves", error, group, save.world, writer.unchanged)
    return whole, [mine.get(leaf.name, (leaf.name, leaf.path, ABSENT)) for leaf in whole.leaves]


def _shown(leaf: Leaf) -> str:
    if leaf.shape is None:
        return "a plain value"
    return f"{'a plain tensor' if leaf.layout is None else f'a DTensor {leaf.layout}'} of shape {leaf.shape} and " \
           f"dtype {leaf.dtype}"


def _leaves(state_dict: Mapping[str, Any], writer: StorageWriter, directory: FilePath) -> list[tuple[str, Path, Any]]:
    """The writer's leaves of `state_dict`, checked, once the directory is known to be one."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"checkpoint_id {str(directory)!r} is a file: pass a directory (it is created if missing)")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict of names to values, got {type(state_dict).__name__}")
    named = writer.leaves({key: value.state_dict() if is_stateful(value) else value for key, value in state_dict.items()})
    directory.mkdir(parents=True, exist_ok=True)
    return named


def _action(directory: FilePath) -> str:
    return f"save to {str(directory)!r}"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _world_group(world: int) -> Any:
    return dist.group.WORLD if world > 1 else None


def _signature(leaves: tuple[Leaf, ...]) -> int:
    """A 63-bit digest of every leaf's name, shape and dtype: equal on every rank that holds the same state."""
    described = [[leaf.name, leaf.shape and list(leaf.shape), str(leaf.dtype)] for leaf in leaves]
    return int.from_bytes(hashlib.blake2b(json.dumps(described).encode(), digest_size=8).digest(), "big") >> 1


def _digest(fingerprints: list[int]) -> int:
    """A 63-bit digest of a list of fingerprints, in order."""
    return int.from_bytes(hashlib.blake2b(json.dumps(fingerprints).encode(), digest_size=8).digest(), "big") >> 1


def _fresh_generation(directory: FilePath) -> str:
    """A random 31-bit generation, as 8 hex digits that no file name in `directory` contains yet."""
    names = os.listdir(directory)
    while True:
        generation = f"{secrets.randbits(31):08x}"
        if not any(generation in name for name in names):
            return generation


def _outcome(writer: StorageWriter, save: Save) -> str:
    """What a failure around the switch left behind, looked up in the directory: rank 0 may
    have switched the new files in before it (or a peer) failed."""
    if (save.directory / JOURNAL).exists():
        return (f"the switch did not finish: the next save to this directory finishes it (its journal {JOURNAL} "
                "names whole files); until then the directory may load nothing")
    try:
        done = writer.switched(save)
    except Exception as exc:  # any unreadable index is reported as such
        return f"the directory could not be read back to tell whether this save completed ({exc})"
    if done:
        return (f"the checkpoint itself is complete: the directory already names this save's files (generation "
                f"{save.generation}), so it loads the state just saved; only the cleanup of older files was not run")
    return writer.unchanged


@contextmanager
def _abandoned_on_failure(writer: StorageWriter, directory: FilePath, generation: Optional[str]) -> Iterator[None]:
    """On any failure inside, rank 0 (the one given the `generation` it drew) removes that
    save's files: nothing names them, and the directory keeps the checkpoint it held."""
    try:
        yield
    except BaseException:
        if generation is not None:
            _remove(writer, directory, lambda found: found == generation)
        raise


def _remove(writer: StorageWriter, directory: FilePath, chosen: Callable[[str], bool]) -> None:
    """Remove the writer's files in `directory` whose generation is `chosen` (every rank has finished with them)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return  # no directory: nothing to remove
    for name in names:
        generation = writer.generation_of(name)
        if generation is not None and chosen(generation):
            try:
                (directory / name).unlink()
            except OSError:
                pass  # gone already, or not a file: the checkpoint is what it is either way
