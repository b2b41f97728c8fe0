"""Who writes what: the pieces of a state dict each rank saves, so that every element is written once.

| leaf of the state dict | written by | as |
|---|---|---|
| DTensor of Shard / Replicate | each rank whose coordinate is 0 on every mesh dim that does not split it | its local piece, with the piece's box |
| DTensor on a mesh smaller than the world | as above, and of the meshes holding the same piece, the lowest rank | the same |
| DTensor with Partial mesh dims | reduced first (as `redistribute` to Replicate), then as above | the pieces of the global value |
| plain tensor | rank 0; the lowest rank holding it when the ranks hold different ones | the whole tensor |
| any other value | rank 0; as above | the value |

The second row is for a tensor held on several meshes, each a replica of the others (a
model parallelised on `mesh["tp"]` of a (dp, tp) mesh): no rank can tell from its own mesh
that another mesh holds the same piece, so the ranks exchange a 63-bit fingerprint of
(path, box) for each such piece (the count rides on the save's first agreement, then one
all_gather of ints, none when every mesh spans the world) and the lowest rank holding a
piece writes it. Plain leaves are rank 0's while every rank holds the same ones; when they
differ (a pipeline's stages, each rank holding its own), the ranks exchange their plain
leaves' fingerprints the same way and the lowest holder writes each. Every format follows
this table; only how the bytes are laid out differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._comm import all_gather_ints
from .._placement import Replicate, _StridedShard
from .._redistribute import Box, piece_boxes
from .._tensor import DTensor
from ._paths import Path
from ._writer import Leaf, Share

__all__ = ["ABSENT", "claimed_below", "claims", "describe", "differing_values", "fingerprint", "my_boxes", "narrowed", "plain_claims", "reduced",
           "shares", "standalone", "volume"]


ABSENT = object()  # a leaf another rank holds and this one does not (in a save over every rank's leaves)


def fingerprint(path: Path, box: Box) -> int:
    """A 63-bit digest of (path, box), the same in every process (unlike `hash` of a str)."""
    digest = hashlib.blake2b(json.dumps([list(path), box]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def volume(box: Box) -> int:
    n = 1
    for _, length in box:
        n *= length
    return n


def my_boxes(leaf: DTensor) -> list[tuple[Box, Box]]:
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
    return [(box, at) for box, at in piece_boxes(spec.shape, mesh.shape, spec.placements, orders, coordinate) if volume(box)]


def claims(named: list[tuple[str, Path, Any]], world: int) -> list[int]:
    """Fingerprints of the pieces this rank would write of DTensors on meshes smaller than the world."""
    return [fingerprint(path, box) for _, path, leaf in named
            if isinstance(leaf, DTensor) and leaf.device_mesh.size() < world for box, _ in my_boxes(leaf)]


def plain_claims(named: list[tuple[str, Path, Any]]) -> list[int]:
    """Fingerprints of the plain leaves (tensors and other values) this rank holds."""
    return [_plain_print(path, leaf) for _, path, leaf in named if not isinstance(leaf, DTensor)]


def differing_values(named: list[tuple[str, Path, Any]], world: int, counts: list[int]) -> list[str]:
    """The names of this rank's plain values (not tensors) that another rank holds under the same
    path with a different value; the same verdict on every rank (empty, or not). One all_gather
    of (path, value) fingerprint pairs; `counts` bounds each rank's number of plain leaves."""
    mine = [(name, fingerprint(path, ()), _plain_print(path, leaf)) for name, path, leaf in named
            if not isinstance(leaf, torch.Tensor) and leaf is not ABSENT]
    width = 2 * max(counts, default=0)
    if world == 1 or width == 0:
        return []
    flat = [v for _, p, q in mine for v in (p, q)]
    seen: dict[int, set[int]] = {}
    for row in all_gather_ints(flat + [-1] * (width - len(flat)), dist.group.WORLD, world):
        for p, q in zip(row[::2], row[1::2]):
            if p >= 0:
                seen.setdefault(p, set()).add(q)
    differ = {p for p, qs in seen.items() if len(qs) > 1}
    return [name for name, p, _ in mine if p in differ] or (["(held by other ranks)"] if differ else [])


def _plain_print(path: Path, leaf: Any) -> int:
    """A plain tensor's (path, whole box); a plain value's path and value, so that two ranks holding
    one path with different values both write it and the writer names the difference."""
    if isinstance(leaf, torch.Tensor):
        return fingerprint(path, tuple((0, n) for n in leaf.shape))
    return fingerprint((*path, hashlib.blake2b(repr(leaf).encode(), digest_size=8).hexdigest()), ())


def claimed_below(rank: int, world: int, mine: list[int], counts: list[int]) -> set[int]:
    """The fingerprints of this rank's claims `mine` that a lower rank claims too (it writes them)."""
    width = max(counts, default=0)
    if world == 1 or width == 0:
        return set()
    rows = all_gather_ints(mine + [-1] * (width - len(mine)), dist.group.WORLD, world)
    return {c for row in rows[:rank] for c in row if c >= 0} & set(mine)


def reduced(leaf: DTensor) -> DTensor:
    """`leaf` with its Partial mesh dims reduced (Replicate), its Shards as they are."""
    if not leaf._spec.has_partial() or leaf.device_mesh.get_coordinate() is None:
        return leaf
    placements = [Replicate() if p.is_partial() else p for p in leaf.placements]
    return leaf.redistribute(placements=placements, shard_order=leaf.shard_order)


def describe(name: str, path: Path, leaf: Any) -> Leaf:
    """What `leaf` is, as every writer and rank 0's index see it (a DTensor's layout as saved: Partial reduced)."""
    if isinstance(leaf, DTensor):
        spec = leaf._spec
        saved = spec.with_placements(tuple(Replicate() if p.is_partial() else p for p in spec.placements),
                                     spec.shard_order) if spec.has_partial() else spec
        return Leaf(name, path, tuple(spec.shape), spec.dtype, f"{saved.layout_str()} on mesh {leaf.device_mesh.shape}")
    if isinstance(leaf, torch.Tensor):
        return Leaf(name, path, tuple(leaf.shape), leaf.dtype, None)
    return Leaf(name, path, None, None, None)


def standalone(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """`t` on the CPU owning exactly its elements (torch.save writes a view's whole storage);
    with `copy`, never sharing memory with `t`."""
    copy = copy and t.device.type == "cpu"  # .cpu() of another device's tensor is a copy already
    t = t.detach().cpu()
    if copy or not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def narrowed(t: torch.Tensor, at: Box) -> torch.Tensor:
    if all(start == 0 and length == size for (start, length), size in zip(at, t.shape)):
        return t
    for d, (start, length) in enumerate(at):
        t = t.narrow(d, start, length)
    return t


def shares(named: list[tuple[str, Path, Any]], rank: int, taken: set[int], copy: bool,
           plain_taken: Optional[set[int]] = None) -> list[Share]:
    """This rank's pieces of `named` (the leaves with Partial DTensors reduced), by the table
    above; pieces whose fingerprint is in `taken` are written by a lower rank. Plain leaves
    are rank 0's, or, with `plain_taken` (the ranks hold different ones), this rank's but
    those a lower rank holds too. With `copy`, standalone CPU copies (the state dict may
    change at once); else views of the leaves."""
    out: list[Share] = []
    for i, (_, path, leaf) in enumerate(named):
        if leaf is ABSENT:
            continue
        if isinstance(leaf, DTensor):
            local = leaf.to_local()
            for box, at in my_boxes(leaf):
                if not (taken and fingerprint(path, box) in taken):
                    piece = narrowed(local, at)
                    out.append(Share(i, box, standalone(piece, True) if copy else piece))
            continue
        if rank != 0 if plain_taken is None else _plain_print(path, leaf) in plain_taken:
            continue
        if isinstance(leaf, torch.Tensor):
            out.append(Share(i, tuple((0, n) for n in leaf.shape), standalone(leaf, True) if copy else leaf))
        else:
            out.append(Share(i, (), leaf))
    return out
