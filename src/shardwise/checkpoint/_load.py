"""`load`: each rank reads, from the files, the saved pieces that overlap what it holds.

A saved tensor is a set of boxes of global indices that tile it; a target DTensor's local
piece is one box too (`piece_boxes` of its layout and the rank's coordinate; one box per part
of a `_StridedShard`, a fused projection's parts side by side). So each rank copies
the overlap of every saved box with its own into its local tensor, reading only the files
that have such a box, and maps them (`mmap=True`) rather than reading them whole. No rank
talks to another: the ranks that saved and the ranks that load, their number, their meshes
and their layouts are independent, and one process with plain tensors can load a
checkpoint that 64 ranks saved.

Everything is checked before anything is copied, so a load that fails leaves the state
dict as it was, and every mismatch is reported at once: the table (its checksum, and that
every tensor's pieces tile it), the state dict against the table, and every piece this
rank will read (its file's size, its checksum, shape and dtype). Under a process group the
ranks then agree, so that a load fails on every rank or on none: a rank never goes on with
loaded values while another keeps its old ones.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any, Optional, Union

import torch

import torch.distributed as dist

from .._ops import neutral_term
from .._redistribute import Box, overlap, piece_boxes
from .._tensor import DTensor
from .._comm import all_gather_ints
from ._agree import agree
from ._async import finish_pending
from ._files import checkpoint_dir
from ._metadata import Entry, Table
from ._pieces import fingerprint
from ._paths import Path, is_stateful, leaves, put_back, show
from ._storage import NativeReader, StorageReader

__all__ = ["load"]


def load(state_dict: MutableMapping[str, Any], *, checkpoint_id: Union[str, os.PathLike[str], None] = None,
         storage_reader: Optional[StorageReader] = None, strict: bool = True, process_group: Any = None,
         no_dist: bool = False) -> None:
    """Fill `state_dict` in place from the checkpoint in directory `checkpoint_id` (or read by `storage_reader`).

    DTensors keep their mesh and placements and receive their part of the saved global
    values, whatever layout, mesh or number of ranks saved them; plain tensors are copied
    into whole; other values are replaced by the saved ones (containers are filled in place,
    tuples rebuilt). A top-level value with `state_dict()` and `load_state_dict()` (a
    module, an optimizer) is filled through them: its `state_dict()` is filled and handed
    back to its `load_state_dict()`. A top-level optimizer that has never stepped gets its
    state first (one step at learning rate 0 with zero gradients, parameters unchanged).

    Each rank reads the data files directly, so the checkpoint must be on a filesystem every
    loading rank can read (as `torch.distributed.checkpoint`'s FileSystemReader assumes).
    When a process group is initialised, every rank of `process_group` (default: the world)
    calls `load` and the ranks agree, after checking and before changing anything, that
    every one of them can load: if any cannot, all raise (that rank its error, the others a
    RuntimeError naming it) and no rank changes anything. `no_dist=True` loads on this rank
    alone, talking to no other, as without a process group.

    Global shapes and dtypes must match the saved ones. A state dict may ask for part of a
    checkpoint by its top-level keys, as with `torch.distributed.checkpoint.load`: `{"model":
    model}` loads the model alone from a `{"model": ..., "optim": ...}` checkpoint. With
    `strict=True` (the default) every path the state dict holds must be saved, and under
    each top-level key it asks for, every saved path must be in it (a renamed or dropped
    parameter is then an error, not a silent skip); `strict=False` loads the paths both have
    and leaves the others. All mismatches are reported in one ValueError, before anything is
    changed. A damaged checkpoint (a changed table, a truncated or altered data file, a
    missing one) is a ValueError naming what is wrong, and changes nothing. An `async_save`
    still writing is waited for first.
    """
    finish_pending()
    reader = _the_reader(checkpoint_id, storage_reader)
    name = reader.describe()
    group, size = _load_group(process_group, no_dist)
    made: list[torch.optim.Optimizer] = []
    error: Optional[Exception] = None
    tree: dict[str, Any] = {}
    stateful: set[str] = set()
    plans: dict[Path, _Plan] = {}
    unasked: list[Path] = []
    try:
        table = reader.read_table()
        for value in state_dict.values():
            if isinstance(value, torch.optim.Optimizer) and not value.state:
                made.append(value)
                _make_state(value)
        stateful = {key for key, value in state_dict.items() if is_stateful(value)}
        tree = {key: state_dict[key].state_dict() if key in stateful else value for key, value in state_dict.items()}
        targets = dict(leaves(tree))
        table = reader.fit(table, targets)
        unasked = _unexpected(targets, table.entries) if strict else []
        problems = _mismatches(targets, table.entries, strict, reader.casts)
        if unasked and size == 1:
            problems.append(_unexpected_problem(unasked))
        if problems:
            raise ValueError(f"cannot load {name} into this state dict; nothing was loaded:\n" + "\n".join(problems))
        plans = _plans(targets, table, reader)
    except Exception as exc:
        error = exc
    action = f"load from {name.removeprefix('the checkpoint ')}"
    try:
        counts = agree(action, "checking the checkpoint and the state dict", error, group, size,
                       "nothing was loaded, on any rank", len(unasked) if size > 1 else 0)
        if max(counts) > 0:  # saved paths some rank does not ask for: an error only if no rank asks for them
            _none_asks(action, unasked, max(counts), group, size)
    except BaseException:
        for optimizer in made:  # back to never having stepped, as it was
            optimizer.state.clear()
        raise
    with torch.no_grad():
        tree = put_back(tree, lambda path, leaf: plans[path].apply(leaf) if path in plans else leaf)
    for key, value in tree.items():
        if key in stateful:
            state_dict[key].load_state_dict(value)
        else:
            state_dict[key] = value


def _the_reader(checkpoint_id: Union[str, os.PathLike[str], None], storage_reader: Optional[StorageReader]
                ) -> StorageReader:
    if storage_reader is not None:
        if not isinstance(storage_reader, StorageReader):
            raise TypeError(f"load(storage_reader=...) takes a shardwise.checkpoint reader (FileSystemReader, "
                            f"HuggingFaceStorageReader), got {type(storage_reader).__name__}")
        return storage_reader
    if checkpoint_id is None:
        raise ValueError("load needs checkpoint_id= (the checkpoint's directory) or storage_reader=")
    return NativeReader(checkpoint_dir(checkpoint_id))


def _load_group(process_group: Any, no_dist: bool) -> tuple[Any, int]:
    """The process group whose ranks load together (None: this rank alone) and its size."""
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = dist.group.WORLD if process_group is None else process_group
    return group, dist.get_world_size(group)


def _make_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has never stepped its state, so the saved state has a place to go.

    One step with zero gradients at learning rate 0 creates every state tensor in each
    parameter's layout without moving a parameter (decoupled weight decay scales by lr too);
    the gradients and learning rates are put back as they were, and `load` then overwrites
    the state with the saved values.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr


def _listed(paths: list[Path], limit: int = 20) -> str:
    shown = ", ".join(f"'{show(p)}'" for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _mismatches(targets: dict[Path, Any], table: dict[Path, Entry], strict: bool, casts: bool = False) -> list[str]:
    """Every difference between the target leaves and the saved entries, one bullet each."""
    problems = []
    if strict:
        missing = [p for p in targets if p not in table]
        if missing:
            problems.append(f"  - missing from the checkpoint: {_listed(missing)}: load a checkpoint saved from the "
                            f"same model and optimizer configuration, or pass strict=False to leave these as they are")
    for path, leaf in targets.items():
        entry = table.get(path)
        if entry is None:
            continue
        if isinstance(leaf, torch.Tensor) != (entry.kind == "tensor"):
            saved = "a tensor" if entry.kind == "tensor" else "a plain value"
            held = "a tensor" if isinstance(leaf, torch.Tensor) else f"a plain value ({type(leaf).__name__})"
            problems.append(f"  - '{show(path)}': the checkpoint holds {saved}, the state dict {held}: "
                            f"give the state dict the saved kind of value")
        elif isinstance(leaf, torch.Tensor):
            if tuple(leaf.shape) != entry.shape:
                problems.append(f"  - '{show(path)}': the checkpoint holds shape {entry.shape}, the state dict "
                                f"{tuple(leaf.shape)}: global shapes must match (layouts may differ)")
            if not casts and str(leaf.dtype).removeprefix("torch.") != entry.dtype:
                problems.append(f"  - '{show(path)}': the checkpoint holds torch.{entry.dtype}, the state dict "
                                f"{leaf.dtype}: make the target torch.{entry.dtype}, load, then convert")
    return problems


def _unexpected(targets: dict[Path, Any], table: dict[Path, Entry]) -> list[Path]:
    """Saved paths under the top-level keys the state dict asks for (the others are not loaded) that it lacks."""
    asked = {p[0] for p in targets}
    return [p for p in table if p not in targets and p[0] in asked]


def _unexpected_problem(unexpected: list[Path]) -> str:
    return (f"  - in the checkpoint but not in the state dict: {_listed(unexpected)}: build the state dict with these "
            f"paths, or pass strict=False to skip them (a top-level key the state dict leaves out is not loaded at "
            f"all)")


def _none_asks(action: str, unasked: list[Path], width: int, group: Any, size: int) -> None:
    """Raise on every rank if a saved path this rank does not ask for is asked for by no rank
    (the ranks of a pipeline each ask for their own stages' paths): the intersection of every
    rank's unasked paths, by fingerprint, is the same on every rank."""
    prints = [fingerprint(p, ()) for p in unasked]
    rows = all_gather_ints(prints + [-1] * (width - len(prints)), group, size)
    nobody = set(prints)
    for row in rows:
        nobody &= set(row)
    if nobody:
        raise ValueError(f"{action}: cannot load it into this state dict; nothing was loaded:\n"
                         + _unexpected_problem([p for p in unasked if fingerprint(p, ()) in nobody]))


def _region(t: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The part of `t` (which holds the global box `origin`) that holds the global box `box`."""
    for d, ((start, length), (o, _)) in enumerate(zip(box, origin)):
        t = t.narrow(d, start - o, length)
    return t


class _Plan:
    """What loading one leaf does, decided (and its saved pieces read and checked) before
    anything changes: copies of saved regions into regions of the target, or a fill with a
    Partial's neutral term, or a plain value that replaces the leaf."""

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (region of the target, saved region)
        self.fill: Optional[tuple[torch.Tensor, int]] = None  # (this rank's piece, its term)
        self.replace = False
        self.value: Any = None

    def apply(self, leaf: Any) -> Any:
        if self.replace:
            return self.value
        if self.fill is not None:
            self.fill[0].fill_(self.fill[1])
        for into, saved in self.copies:
            into.copy_(saved)
        return leaf


def _plan_copies(plan: _Plan, target: torch.Tensor, box: Box, entry: Entry, reader: StorageReader) -> None:
    """Plan copies into `target` (holding the global `box`) of every overlapping saved piece."""
    for piece in entry.pieces:
        common = overlap(piece.box, box)
        if common is not None:
            saved = _region(reader.value(piece, entry), common, piece.box)
            plan.copies.append((_region(target, common, box), saved))


def _plan(leaf: Any, entry: Entry, reader: StorageReader) -> _Plan:
    plan = _Plan()
    if isinstance(leaf, DTensor):
        mesh = leaf.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return plan
        local = leaf.to_local()
        spec = leaf._spec
        term = neutral_term(spec, tuple(coordinate))
        if term is not None:  # the value lives on coordinate 0 of each Partial(sum / prod / bxor) mesh dim
            plan.fill = (local, term)
            return plan
        found = spec.split_orders()
        orders = tuple(found.get(d, ()) for d in range(spec.ndim))
        for box, at in piece_boxes(spec.shape, mesh.shape, spec.placements, orders, coordinate):
            _plan_copies(plan, _region(local, at, tuple((0, s) for s in local.shape)), box, entry, reader)
    elif isinstance(leaf, torch.Tensor):
        _plan_copies(plan, leaf, tuple((0, s) for s in leaf.shape), entry, reader)
    else:
        plan.replace, plan.value = True, reader.value(entry.pieces[0], entry)
    return plan


def _plans(targets: dict[Path, Any], table: Table, reader: StorageReader) -> dict[Path, _Plan]:
    """Every leaf's plan, by path (the leaves the checkpoint does not hold have none)."""
    return {path: _plan(leaf, table.entries[path], reader) for path, leaf in targets.items() if path in table.entries}
