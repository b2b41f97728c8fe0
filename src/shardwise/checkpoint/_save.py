"""`save`: every rank writes the pieces it is responsible for; rank 0 writes the table last.

Who writes what, so that every element of every global tensor is written exactly once:

| leaf of the state dict | written by | as |
|---|---|---|
| DTensor of Shard / Replicate | each rank whose coordinate is 0 on every mesh dim that does not split it | its local piece, with the piece's box |
| DTensor on a mesh smaller than the world | as above, and of the meshes holding the same piece, the lowest rank | the same |
| DTensor with Partial mesh dims | reduced first (as `redistribute` to Replicate), then as above | the pieces of the global value |
| plain tensor | rank 0 | the whole tensor |
| any other value | rank 0 | the value, if `torch.load(weights_only=True)` can read it back |

The second row is for a tensor held on several meshes, each a replica of the others (a
model parallelised on `mesh["tp"]` of a (dp, tp) mesh): no rank can tell from its own mesh
that another mesh holds the same piece, so the ranks exchange a 63-bit fingerprint of
(path, box) for each such piece (two all_gathers of ints, none when every mesh spans the
world) and the lowest rank holding a piece writes it.

The ranks agree four times (an all_gather of a flag per rank, through `_comm`): after
checking the state dict (rank 0 also draws the generation that names this save's files),
after claiming pieces, after writing the data files, and after rank 0 writes the new table.
A failure on any rank stops every rank at the next agreement with an error naming the ranks
that failed, and the table is never written, so a half-written checkpoint is never taken
for a complete one, and the directory keeps loading the checkpoint it held before.

`async_save` does the first two agreements, and takes copies of its pieces, before it
returns; a thread does the rest, agreeing over a gloo group of its own so that it never
interleaves with the training's collectives.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import concurrent.futures
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path as FilePath
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .._comm import all_gather_ints
from .._placement import Replicate, _StridedShard
from .._redistribute._exchange import Box, piece_boxes
from .._tensor import DTensor
from ._agree import agree
from ._files import checkpoint_dir, read_data, write_atomically
from ._metadata import Entry, Piece, data_file, digest, dtype_name, read_metadata, write_metadata
from ._paths import Path, is_stateful, leaves, show
from ._writer import StorageWriter

__all__ = ["save", "async_save", "SaveFuture"]


def save(state_dict: Mapping[str, Any], *, checkpoint_id: Union[str, os.PathLike[str], None] = None,
         storage_writer: Optional[StorageWriter] = None) -> None:
    """Save `state_dict` into the directory `checkpoint_id`, each rank writing only its own pieces.

    With `storage_writer` (a `HuggingFaceStorageWriter`, or a `FileSystemWriter` for torch's
    DCP format), the writer's format and guarantees
    instead of the native ones below; `checkpoint_id`, if given, overrides the writer's path.

    Call it on every rank of the world with the same directory, on a filesystem every rank
    shares (each rank writes its own data file there; rank 0 reads them all to write the
    table). The state dict may nest dicts, lists and tuples (an optimizer's `state_dict()`);
    a top-level value with `state_dict()` and `load_state_dict()` (a module, an optimizer)
    is saved as its `state_dict()`. Leaves are DTensors, plain tensors, and plain values
    (numbers, strings, None, ...); see the table in this module for who writes what.

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
    if isinstance(storage_writer, StorageWriter):
        storage_writer.write(state_dict, None if checkpoint_id is None else checkpoint_dir(checkpoint_id))
        return
    if storage_writer is not None or checkpoint_id is None:
        raise TypeError(f"save needs checkpoint_id= (a directory) or storage_writer= (a StorageWriter: "
                        f"HuggingFaceStorageWriter, FileSystemWriter); got storage_writer={type(storage_writer).__name__}")
    _prepare(state_dict, checkpoint_id, staged=False).write(dist.group.WORLD)


def async_save(state_dict: Mapping[str, Any], *, checkpoint_id: Union[str, os.PathLike[str]]) -> SaveFuture:
    """`save`, with the files written by a background thread while training goes on.

    Everything that needs the state dict or the model's process groups happens before it
    returns, on every rank: checking the state dict, reducing Partial DTensors, and copying
    each piece this rank writes to CPU memory (so the next optimizer step may change the
    parameters at once; the copy costs this rank's share of the checkpoint in host memory
    until the files are written). A thread then writes the data files and rank 0 the table,
    the ranks agreeing over a gloo process group of their own (made at the first call, on
    every rank), with the guarantees of `save`: the directory loads the checkpoint it held
    before until the new one is complete.

    Returns a `SaveFuture` (a `concurrent.futures.Future`): `result()` waits and raises what
    the save raised. Only one save runs at a time: the next `save`, `async_save` or `load`
    waits for this one, and raises its error if nobody asked for it, so a failed save is
    never silent. Wait for it before `destroy_process_group`.
    """
    finish_pending()
    group = _background_group()
    job = _prepare(state_dict, checkpoint_id, staged=True)
    future = SaveFuture(str(job.directory))
    future.set_running_or_notify_cancel()

    def write() -> None:
        try:
            job.write(group)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    thread = threading.Thread(target=write, name=f"shardwise async_save to {str(job.directory)!r}")
    _PENDING.append(future)
    thread.start()  # not a daemon: the interpreter waits for it before exiting
    return future


class SaveFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """What `async_save` returns: a Future of None that remembers whether its outcome was asked for."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self.seen = False

    def result(self, timeout: Optional[float] = None) -> None:
        self.seen = True
        return super().result(timeout)  # type: ignore[no-any-return]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self.seen = True
        return super().exception(timeout)


_PENDING: list[SaveFuture] = []  # the async save in flight, if any (at most one)
_GROUP: list[tuple[Any, Any]] = []  # (the default process group, the gloo group async saves agree over)


def finish_pending() -> None:
    """Wait for the async save in flight, if any; raise its error if nobody asked for it."""
    while _PENDING:
        future = _PENDING.pop()
        error = concurrent.futures.Future.exception(future)  # waits (without counting as asked)
        if error is not None and not future.seen:
            raise RuntimeError(
                f"the async_save to {future.directory!r} failed, and its result was never asked for: {error}. "
                f"Nothing new was started. Call .result() on what async_save returns to handle its failures"
            ) from error


def _background_group() -> Any:
    """The gloo group async saves agree over (None for one process), made once per process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if not _GROUP or _GROUP[0][0] is not world:
        _GROUP[:] = [(world, dist.new_group(backend="gloo"))]
    return _GROUP[0][1]


@dataclass
class _Job:
    """A save checked and agreed on by every rank, its pieces in hand, its files not yet written."""

    directory: FilePath
    rank: int
    world: int
    generation: str
    entries: list[Entry]
    values: list[Any]
    error: Optional[Exception]

    def write(self, group: Any) -> None:
        """Write this rank's data file; rank 0 the table (the atomic switch); agree after each."""
        directory, rank, world, generation, error = self.directory, self.rank, self.world, self.generation, self.error
        size = 0
        if error is None:
            try:
                name = data_file(rank, generation)
                payload = {"entries": [e.to_json() for e in _sealed(self.entries, self.values)], "values": self.values}
                write_atomically(directory / name, lambda f: torch.save(payload, f))
                size = (directory / name).stat().st_size
            except Exception as exc:
                error = exc
        sizes = _agree("writing the data files", error, directory, world, size, group=group)
        if rank == 0:
            try:
                files = {data_file(r, generation): n for r, n in enumerate(sizes)}
                write_metadata(directory, _merge(directory, world, generation), world, files)  # the atomic switch
                _sync_directory(directory)
            except Exception as exc:
                error = exc
        _agree("writing metadata.json", error, directory, world, group=group,
               outcome=lambda: _switch_outcome(directory, generation))
        if rank == 0:
            _remove_unnamed(directory, generation)


def _prepare(state_dict: Mapping[str, Any], checkpoint_id: Union[str, os.PathLike[str]], staged: bool) -> _Job:
    """Check the state dict and agree on it, a generation and who writes which piece; reduce
    Partial DTensors; take this rank's pieces (copied, when `staged`, so the state may change)."""
    directory = checkpoint_dir(checkpoint_id)
    rank, world = _rank_and_world()
    error: Optional[Exception] = None
    items: list[tuple[Path, Any]] = []
    claims: list[int] = []
    try:
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"checkpoint_id {str(directory)!r} is a file: pass a directory (it is created if missing)")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict of names to values, got {type(state_dict).__name__}")
        tree = {key: value.state_dict() if is_stateful(value) else value for key, value in state_dict.items()}
        items = list(leaves(tree))
        _check_values(items)
        claims = [_fingerprint(path, box) for path, leaf in items
                  if isinstance(leaf, DTensor) and leaf.device_mesh.size() < world for box, _ in _my_boxes(leaf)]
        directory.mkdir(parents=True, exist_ok=True)
    except Exception as exc:
        error = exc
    # a fresh generation for this save's file names, drawn by rank 0 (never one in use there)
    token = _fresh_generation(directory) if rank == 0 and error is None else 0
    generation = f"{_agree('checking the state dict', error, directory, world, token)[0]:08x}"
    counts = _agree("claiming pieces", error, directory, world, len(claims))
    taken = _claimed_below(rank, world, claims, counts)

    with torch.no_grad():
        items = [(path, _reduced(leaf) if isinstance(leaf, DTensor) else leaf) for path, leaf in items]
    entries: list[Entry] = []
    values: list[Any] = []
    try:
        entries, values = _pieces(items, rank, data_file(rank, generation), taken, staged)
    except Exception as exc:
        error = exc  # told to every rank at the next agreement, after the data files
    return _Job(directory, rank, world, generation, entries, values, error)


def _fresh_generation(directory: FilePath) -> int:
    """A random 31-bit generation whose rank 0 file is not in `directory` yet."""
    while True:
        token = secrets.randbits(31)
        if not (directory / data_file(0, f"{token:08x}")).exists():
            return token


def _sync_directory(directory: FilePath) -> None:
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


def _remove_unnamed(directory: FilePath, generation: str) -> None:
    """After a completed save: remove the data files of older generations and the temporary
    files of saves that were killed (none is being written now: every rank has finished)."""
    for path in directory.iterdir():
        name = path.name
        stale_data = name.startswith("rank_") and name.endswith(".pt") and not name.endswith(f".{generation}.pt")
        stale_temporary = name.startswith(".") and name.endswith(".tmp")
        if (stale_data or stale_temporary) and path.is_file():
            try:
                path.unlink()
            except OSError:
                pass  # gone already, or not ours to remove: the checkpoint is complete either way

def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_UNCHANGED = ("no new metadata.json was written, so the directory still loads the checkpoint it held before "
              "(if any)")


def _agree(step: str, error: Optional[Exception], directory: FilePath, world: int, count: int = 0,
           outcome: Union[str, Callable[[], str]] = _UNCHANGED, group: Any = None) -> list[int]:
    """Every rank's `count` once `step` succeeded on every rank of `group` (the world's group
    by default); else raise on every rank."""
    if world == 1:
        group = None
    elif group is None:
        group = dist.group.WORLD
    return agree(f"save to {str(directory)!r}", step, error, group, world, outcome, count)


def _switch_outcome(directory: FilePath, generation: str) -> str:
    """What a failure around the atomic switch left behind, looked up in the directory: rank 0
    may have renamed the new metadata.json into place before it (or a peer) failed."""
    try:
        named = data_file(0, generation) in (read_metadata(directory).file_sizes or {})
    except Exception as exc:  # any unreadable table is reported as such
        return f"metadata.json could not be read back to tell whether this save completed ({exc})"
    if named:
        return (f"the checkpoint itself is complete: metadata.json already names this save's files (generation "
                f"{generation}), so the directory loads the state just saved; only the cleanup of older files "
                "was not run")
    return (f"metadata.json did not name this save's files (generation {generation}) when this rank looked, so "
            "the directory still loads the checkpoint it held before (if any)")


def _fingerprint(path: Path, box: Box) -> int:
    """A 63-bit digest of (path, box), the same in every process (unlike `hash` of a str)."""
    digest = hashlib.blake2b(json.dumps([list(path), box]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _claimed_below(rank: int, world: int, claims: list[int], counts: list[int]) -> set[int]:
    """The fingerprints of this rank's `claims` that a lower rank claims too (it writes them)."""
    width = max(counts, default=0)
    if world == 1 or width == 0:
        return set()
    rows = all_gather_ints(claims + [-1] * (width - len(claims)), dist.group.WORLD, world)
    return {c for row in rows[:rank] for c in row if c >= 0} & set(claims)


def _round_trip(value: Any) -> None:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)


def _check_values(items: list[tuple[Path, Any]]) -> None:
    """Every non-tensor leaf must load back under `weights_only=True` (checked on every rank)."""
    plain = [(path, leaf) for path, leaf in items if not isinstance(leaf, torch.Tensor)]
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


def _reduced(leaf: DTensor) -> DTensor:
    """`leaf` with its Partial mesh dims reduced (Replicate), its Shards as they are."""
    if not leaf._spec.has_partial() or leaf.device_mesh.get_coordinate() is None:
        return leaf
    placements = [Replicate() if p.is_partial() else p for p in leaf.placements]
    return leaf.redistribute(placements=placements, shard_order=leaf.shard_order)


def _standalone(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """`t` on the CPU owning exactly its elements (torch.save writes a view's whole storage);
    with `copy`, never sharing memory with `t`."""
    copy = copy and t.device.type == "cpu"  # .cpu() of another device's tensor is a copy already
    t = t.detach().cpu()
    if copy or not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def _volume(box: Box) -> int:
    n = 1
    for _, length in box:
        n *= length
    return n


def _my_boxes(leaf: DTensor) -> list[tuple[Box, Box]]:
    """The boxes of `leaf` this rank writes (global box, where it lies in the piece): its
    piece when nonempty (one box per part of a `_StridedShard`) and its coordinate is 0 on
    every mesh dim that does not split the tensor (one replica; a Partial mesh dim counts as
    replicating, since it is reduced first)."""
    spec, mesh = leaf._spec, leaf.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    found = spec.split_orders()
    orders = tuple(found.get(d, ()) for d in range(spec.ndim))
    splitting = {m for ms in orders for m in ms} | {m for m, p in enumerate(spec.placements) if isinstance(p, _StridedShard)}
    if any(c for m, c in enumerate(coordinate) if m not in splitting):
        return []
    return [(box, at) for box, at in piece_boxes(spec.shape, mesh.shape, spec.placements, orders, coordinate) if _volume(box)]


def _narrowed(t: torch.Tensor, at: Box) -> torch.Tensor:
    if all(start == 0 and length == size for (start, length), size in zip(at, t.shape)):
        return t
    for d, (start, length) in enumerate(at):
        t = t.narrow(d, start, length)
    return t


def _pieces(items: list[tuple[Path, Any]], rank: int, name: str, taken: set[int],
            copy: bool = False) -> tuple[list[Entry], list[Any]]:
    """What this rank knows of each leaf (entries, not yet `_sealed`) and what it writes
    (values, by index; with `copy`, sharing no memory with the state dict); pieces whose
    fingerprint is in `taken` are written by a lower rank."""
    entries: list[Entry] = []
    values: list[Any] = []

    def piece(value: Any, box: Box) -> tuple[Piece, ...]:
        values.append(value)
        return (Piece(name, len(values) - 1, box),)

    for path, leaf in items:
        if isinstance(leaf, DTensor):
            spec = leaf._spec
            pieces: tuple[Piece, ...] = ()
            for box, at in _my_boxes(leaf):
                if not (taken and _fingerprint(path, box) in taken):
                    pieces += piece(_standalone(_narrowed(leaf.to_local(), at), copy), box)
            layout = f"{spec.layout_str()} on mesh {leaf.device_mesh.shape}"
            entries.append(Entry(path, "tensor", tuple(spec.shape), dtype_name(spec.dtype), layout, pieces))
        elif isinstance(leaf, torch.Tensor):
            whole = tuple((0, s) for s in leaf.shape)
            pieces = piece(_standalone(leaf, copy), whole) if rank == 0 and leaf.numel() else ()
            entries.append(Entry(path, "tensor", tuple(leaf.shape), dtype_name(leaf.dtype), None, pieces))
        else:
            entries.append(Entry(path, "object", None, None, None, piece(leaf, ()) if rank == 0 else ()))
    return entries, values


def _sealed(entries: list[Entry], values: list[Any]) -> list[Entry]:
    """`entries` with each piece's SHA-256 (of the value it will be read back as)."""
    return [replace(e, pieces=tuple(replace(p, sha256=digest(values[p.index])) for p in e.pieces)) for e in entries]


def _describe(entry: Entry) -> str:
    if entry.kind == "object":
        return "a plain value"
    kind = "a plain tensor" if entry.layout is None else f"a DTensor {entry.layout}"
    return f"{kind} of shape {entry.shape} and dtype {entry.dtype}"


def _merge(directory: FilePath, world: int, generation: str) -> list[Entry]:
    """The table: every rank's entries, the pieces of one path together, checked to tile each
    tensor exactly once."""
    merged: dict[Path, Entry] = {}
    holders: dict[Path, list[int]] = {}
    problems: list[str] = []
    disagreed: set[Path] = set()
    for r in range(world):
        for entry in map(Entry.from_json, read_data(directory / data_file(r, generation))[0]):
            first = merged.get(entry.path)
            holders.setdefault(entry.path, []).append(r)
            if first is None:
                merged[entry.path] = entry
            elif (first.kind, first.shape, first.dtype) != (entry.kind, entry.shape, entry.dtype):
                disagreed.add(entry.path)
                problems.append(f"'{show(entry.path)}' is {_describe(first)} on rank {holders[entry.path][0]} "
                                f"but {_describe(entry)} on rank {r}")
            else:
                merged[entry.path] = replace(first, pieces=first.pieces + entry.pieces)
    for path, entry in merged.items():
        ranks = holders[path]
        if 0 not in ranks and (entry.kind == "object" or entry.layout is None):
            problems.append(f"'{show(path)}' is {_describe(entry)} on ranks {ranks} but rank 0 has no such key, and "
                            f"rank 0 writes plain tensors and values: give every rank the same keys, or make it a DTensor")
        elif entry.kind == "tensor" and path not in disagreed:
            covered = sum(p.volume() for p in entry.pieces)
            if covered != entry.numel():
                problems.append(f"'{show(path)}': the ranks' pieces hold {covered} of its {entry.numel()} elements "
                                f"(ranks {ranks} disagree on its layout): give it one layout on every rank")
    if problems:
        raise ValueError("the ranks' state dicts do not describe one set of global tensors:\n  - "
                         + "\n  - ".join(problems))
    return list(merged.values())
