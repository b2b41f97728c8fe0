"""torch's distributed checkpoint (DCP) on shardwise DTensors: the three hooks it asks a tensor for.

`torch.distributed.checkpoint` knows torch's own DTensor; any other tensor it takes for a
whole tensor of its global shape, so a shardwise DTensor was saved as one rank's piece
labelled as the whole, and a load copied into it with ops that talk to other ranks (on some
ranks, a different number of times: a hang). DCP lets a tensor subclass describe itself
instead, and a DTensor does, from its layout:

| DCP asks | at | a DTensor answers |
|---|---|---|
| `__create_write_items__(fqn, obj)` | save planning | one write item per global box this rank holds |
| `__create_chunk_list__()` | load planning | the same boxes, to read into |
| `__get_tensor_shard__(index)` | writing, reading | the view of the local piece holding the box at `index.offset` |

The boxes are `piece_boxes` of the layout at this rank's coordinate: one box, or one per
part of a `_StridedShard` (a fused projection's parts lie side by side in the piece, so
the piece is several boxes of the global tensor). Why the answers are what they are:

- Replicas write the same boxes under the same index (name and global offset); DCP's
  save-plan dedup keeps one of each, so every element is written once.
- Empty boxes (the trailing ranks of an uneven split) are left out: an empty box may start
  where a non-empty one does, and the dedup, which goes by start, could keep the empty one.
- A tensor with no elements is written as one empty box at the origin, so it has an entry.
- A rank outside the tensor's mesh writes and reads nothing.
- A `Partial` layout is refused at once, on every rank (each holds a term of a pending
  reduction, not a value): the TypeError names the redistribute that fixes it.

`async_save` first stages a copy of the state dict (torch's `StateDictStager`): it makes each
tensor's copy with `new_empty` and copies its attributes, so a DTensor's copy is a DTensor
with a CPU copy of its piece and the same layout, made without a collective (the factories
keep a `_StridedShard` layout, see `_strided`), and the hooks then answer for the copy.

Nothing here talks to another process. `torch.distributed.checkpoint` is imported only when
DCP itself calls a hook.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._placement import Partial
from .._redistribute import Box, piece_boxes
from ._async import resolve
from ._wrap import DTensorBase

__all__ = ["chunk_list", "tensor_shard", "write_items"]

Chunk = tuple[Box, Box]  # a global box this rank holds, and where it lies in the local piece


def _refuse_partial(t: DTensorBase, doing: str) -> None:
    spec = t._spec
    partial = [i for i, p in enumerate(spec.placements) if isinstance(p, Partial)]
    if partial:
        # a TypeError: DCP's load planning turns a ValueError from `__create_chunk_list__` into
        # "Invalid checkpoint metadata", which would hide the fix
        fixed = ", ".join("Replicate()" if isinstance(p, Partial) else repr(p) for p in spec.placements)
        raise TypeError(
            f"torch.distributed.checkpoint cannot {doing}: it is a {list(spec.shape)} DTensor of layout {spec.layout_str()}, whose "
            f"mesh dim{'s' if len(partial) > 1 else ''} {', '.join(map(str, partial))} "
            f"{'are' if len(partial) > 1 else 'is'} Partial, so each rank holds one term of a pending reduction, "
            f"not a value; reduce it first: `t = t.redistribute(placements=[{fixed}])` (or use shardwise.checkpoint, "
            f"which saves Partial layouts)"
        )


def _chunks(t: DTensorBase, doing: str) -> Optional[list[Chunk]]:
    """The non-empty global boxes this rank holds, each with its place in the local piece;
    None when this rank is not in the tensor's mesh."""
    _refuse_partial(t, doing)
    spec = t._spec
    coordinate = spec.mesh.get_coordinate()  # type: ignore[attr-defined]
    if coordinate is None:
        return None
    found = spec.split_orders()
    orders = tuple(found.get(d, ()) for d in range(spec.ndim))
    boxes = piece_boxes(spec.shape, spec.mesh.shape, spec.placements, orders, coordinate)
    return [(box, at) for box, at in boxes if all(length for _, length in box)]


def _local(t: DTensorBase) -> torch.Tensor:
    return resolve(t._local_tensor)


def _offsets(box: Box) -> torch.Size:
    return torch.Size(start for start, _ in box)


def _sizes(box: Box) -> torch.Size:
    return torch.Size(length for _, length in box)


def _origin(t: DTensorBase) -> Box:
    """The whole global tensor as one box."""
    return tuple((0, n) for n in t._spec.shape)


def write_items(t: DTensorBase, fqn: str) -> list[Any]:
    """DCP's `__create_write_items__`: one SHARD write item per global box this rank holds."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    chunks = _chunks(t, f"save {fqn!r}")
    if chunks is None:
        return []
    boxes = [box for box, _ in chunks] if t._spec.shape.numel() else [_origin(t)]
    properties = TensorProperties.create_from_tensor(_local(t))
    return [
        WriteItem(
            index=MetadataIndex(fqn, _offsets(box)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=_offsets(box), sizes=_sizes(box)),
                properties=properties,
                size=torch.Size(t._spec.shape),
            ),
        )
        for box in boxes
    ]


def chunk_list(t: DTensorBase) -> list[Any]:
    """DCP's `__create_chunk_list__`: the global boxes this rank holds, to load into."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunks = _chunks(t, "load into a DTensor")
    return [ChunkStorageMetadata(offsets=_offsets(box), sizes=_sizes(box)) for box, _ in chunks or ()]


def tensor_shard(t: DTensorBase, index: Any) -> torch.Tensor:
    """DCP's `__get_tensor_shard__`: the view of this rank's piece that holds the global box
    starting at `index.offset` (written by a save, filled by a load)."""
    chunks = _chunks(t, f"read or write {index.fqn!r}")
    local = _local(t)
    shape = t._spec.shape
    offset = torch.Size(index.offset) if index.offset is not None else torch.Size([0] * len(shape))
    if not shape.numel():
        return local.new_empty(shape)
    for box, at in chunks or ():
        if _offsets(box) == offset:
            return local[tuple(slice(start, start + length) for start, length in at)]
    held = [tuple(_offsets(box)) for box, _ in chunks or ()]
    raise ValueError(
        f"torch.distributed.checkpoint asked this rank for the piece of {index.fqn!r} at global offset "
        f"{tuple(offset)}, but under layout {t._spec.layout_str()} of its {list(shape)} DTensor this rank holds "
        f"pieces at {held}: pass DCP the same state dict it planned with"
    )

