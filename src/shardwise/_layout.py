"""Layout math: which piece of a global tensor each rank holds, for any placements.

Pure functions over shapes, placements and mesh coordinates; nothing here talks to
processes, so a mesh of thousands of ranks is planned on one machine.

Sizes follow `torch.chunk`: a tensor dim of size `s` split `n` ways gives pieces of
`ceil(s / n)`, earlier ranks get the larger pieces and trailing ranks may be empty.

When several mesh dims shard one tensor dim, the tensor dim is split by them one after
another, outermost first: the *split order*. By default it is mesh-dim order; a layout
may name another (`shard_order={0: (1, 0)}`: split tensor dim 0 by mesh dim 1 first, then
each piece by mesh dim 0). The order is part of the layout, so both `(("dp", "tp"),)` and
`(("tp", "dp"),)` partition specs are representable.

A *layout* is exactly that: placements per mesh dim plus the split order (`Layout`). A
`DTensorSpec` is a layout on a mesh with the global shape, stride and dtype; everything
else that says "layout" means one of these two.

>>> local_shape_and_offset((10,), (4,), (Shard(0),), (3,))
((1,), (9,))
>>> local_shape_and_offset((3, 8), (4,), (Shard(0),), (3,))  # dim smaller than the mesh
((0, 8), (3, 0))
>>> local_shape_and_offset((8,), (2, 2), (Shard(0), Shard(0)), (0, 1), {0: (1, 0)})
((2,), (4,))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from ._describe import describe, refuse_torch
from ._placement import Placement, Shard, _StridedShard

__all__ = [
    "Layout",
    "ShardOrder",
    "ShardOrderLike",
    "chunk_range",
    "dense_strides_like",
    "normalize_placements",
    "normalize_shard_order",
    "split_orders",
    "local_shape_and_offset",
    "max_local_shape",
    "global_shape_from_local",
    "contiguous_strides",
    "format_placements",
    "check_strided",
]

# The one representation of a split order, stored in specs and layouts, returned by
# `DTensor.shard_order` and `ShardingSpec.shard_order`, made from any user form by
# `normalize_shard_order`: ((tensor_dim, (mesh_dim, ...)), ...) for the tensor dims whose
# split order is not ascending mesh-dim order, sorted by tensor dim; () when every order is
# the default. The full map (every split tensor dim) is derived from it: `split_orders`.
ShardOrder = tuple[tuple[int, tuple[int, ...]], ...]
ShardOrderLike = Union[ShardOrder, Mapping[int, Sequence[int]], None]


@dataclass(frozen=True)
class Layout:
    """Placements plus split order: how a tensor lies on a mesh, without the mesh or the
    shape (what a strategy asks of an input or promises of an output).

    >>> str(Layout((Shard(0), Shard(0)), ((0, (1, 0)),)))
    '(S(0), S(0)) split 0:(1, 0)'
    """

    placements: tuple[Placement, ...]
    shard_order: ShardOrder = ()

    def __str__(self) -> str:
        order = "".join(f" split {d}:{ms}" for d, ms in self.shard_order)
        return format_placements(self.placements) + order


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece `index` when `size` is split into `parts` like `torch.chunk`."""
    per = -(-size // parts)
    start = min(index * per, size)
    return start, min(per, size - start)


def format_placements(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def normalize_placements(
    placements: Sequence[Placement], mesh_ndim: int, tensor_ndim: int, *, what: str = "placements"
) -> tuple[Placement, ...]:
    """Validate placements against a mesh and a tensor rank; make Shard dims non-negative."""
    if isinstance(placements, Placement):
        placements = (placements,)
    if not isinstance(placements, (tuple, list)):
        raise TypeError(f"{what} must be a sequence of Placement, one per mesh dim, got {describe(placements)}")
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            refuse_torch(p, f"{what}[{i}]")
            raise TypeError(
                f"{what}[{i}] is {p!r} of type {type(p).__name__}: use Shard(dim), Replicate() or Partial()"
            )
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what} {format_placements(placements)} has {len(placements)} entries but the mesh has "
            f"{mesh_ndim} dims: give one placement per mesh dim"
        )
    out: list[Placement] = []
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            d = p.dim
            if not -tensor_ndim <= d < tensor_ndim:
                lo = -tensor_ndim if tensor_ndim else 0
                hint = f"use a dim in [{lo}, {tensor_ndim - 1}]" if tensor_ndim else "a 0-dim tensor cannot be sharded"
                raise ValueError(
                    f"{what}[{i}] = {p} is out of range for a {tensor_ndim}-D tensor: {hint}"
                )
            if d < 0:
                p = Shard(d + tensor_ndim) if isinstance(p, Shard) else _StridedShard(d + tensor_ndim, split_factor=p.split_factor)
        out.append(p)
    return tuple(out)


def split_orders(placements: Sequence[Placement], shard_order: ShardOrder = ()) -> dict[int, tuple[int, ...]]:
    """Every split tensor dim -> the mesh dims that split it, outermost first (the full map a
    `ShardOrder` and the placements describe).

    >>> split_orders((Shard(0), Shard(0), Shard(1)), ((0, (1, 0)),))
    {0: (1, 0), 1: (2,)}
    """
    orders: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            orders.setdefault(p.dim, []).append(m)
    result = {d: tuple(ms) for d, ms in orders.items()}
    for d, ms in shard_order:
        result[d] = ms
    return result


def normalize_shard_order(
    placements: Sequence[Placement], shard_order: ShardOrderLike, tensor_ndim: int
) -> ShardOrder:
    """Validate a split order against placements and return its canonical form."""
    if shard_order is None or (isinstance(shard_order, (Mapping, tuple, list)) and not shard_order):
        return ()
    pairs = isinstance(shard_order, (tuple, list)) and all(
        isinstance(item, (tuple, list)) and len(item) == 2 for item in shard_order
    )
    if not isinstance(shard_order, Mapping) and not pairs:
        raise TypeError(
            f"shard_order must map tensor dims to the mesh dims that split them, outermost first, got "
            f"{shard_order!r}: e.g. {{0: (1, 0)}}"
        )
    items = shard_order.items() if isinstance(shard_order, Mapping) else shard_order
    default = split_orders(placements)
    out: list[tuple[int, tuple[int, ...]]] = []
    seen: set[int] = set()
    for d, ms in items:
        if isinstance(d, bool) or not isinstance(d, int) or not -tensor_ndim <= d < tensor_ndim:
            raise ValueError(f"shard_order names tensor dim {d!r}, out of range for a {tensor_ndim}-D tensor")
        d = d % tensor_ndim
        if d in seen:
            raise ValueError(f"shard_order gives tensor dim {d} more than one split order: give each tensor dim once")
        seen.add(d)
        if not isinstance(ms, (tuple, list)) or not all(isinstance(m, int) and not isinstance(m, bool) for m in ms):
            raise TypeError(
                f"shard_order gives tensor dim {d} {ms!r}: list the mesh dims (ints) that split it, outermost first"
            )
        ms = tuple(ms)
        want = default.get(d, ())
        if sorted(ms) != list(want):
            raise ValueError(
                f"shard_order gives tensor dim {d} the mesh dims {ms}, but placements "
                f"{format_placements(placements)} shard it over mesh dims {want}: list exactly those, in split order"
            )
        if ms != want:
            out.append((d, ms))
    return tuple(sorted(out))


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
    shard_order: ShardOrderLike = (),
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the piece held at `coordinate` (placements normalized)."""
    if isinstance(shard_order, Mapping):
        shard_order = normalize_shard_order(placements, shard_order, len(global_shape))
    shape = list(global_shape)
    offset = [0] * len(shape)
    for d, ms in split_orders(placements, shard_order or ()).items():
        size, off = shape[d], 0
        for m in ms:
            start, size = chunk_range(size, mesh_shape[m], coordinate[m])
            off += start
        shape[d], offset[d] = size, off
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            size, n = check_strided(global_shape, mesh_shape, placements, m)
            part = size // p.split_factor
            start, length = chunk_range(part, n, coordinate[m])
            # the offset is the piece's place in the parts' pieces laid rank after rank
            shape[p.dim], offset[p.dim] = length * p.split_factor, start * p.split_factor
    return tuple(shape), tuple(offset)


def check_strided(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], m: int) -> tuple[int, int]:
    """(dim size, mesh dim size) of the `_StridedShard` on mesh dim `m`, checked: its parts
    split evenly over the mesh dim and no other mesh dim splits its tensor dim."""
    p = placements[m]
    assert isinstance(p, _StridedShard)
    size, n = global_shape[p.dim], mesh_shape[m]
    if size % (p.split_factor * n):
        raise ValueError(
            f"{p} on mesh dim {m} needs tensor dim {p.dim} (size {size}) to hold {p.split_factor} equal parts that "
            f"each split evenly {n} ways: use a size divisible by {p.split_factor * n}, or Shard({p.dim})")
    others = [k for k, q in enumerate(placements) if k != m and isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim]
    if others:
        raise ValueError(
            f"{format_placements(placements)}: tensor dim {p.dim} is split by {p} on mesh dim {m} and by mesh "
            f"dim(s) {others}; a _StridedShard dim cannot be split further: shard another tensor dim")
    return size, n


def max_local_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], shard_order: ShardOrder = ()
) -> tuple[int, ...]:
    """The largest piece any rank holds: the first piece at every split (torch.chunk)."""
    return local_shape_and_offset(global_shape, mesh_shape, placements, (0,) * len(mesh_shape), shard_order)[0]


def global_shape_from_local(
    local_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Global shape assuming every rank holds an equal piece (what `from_local` infers)."""
    shape = list(local_shape)
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            shape[p.dim] *= mesh_shape[m]
    return tuple(shape)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def dense_strides_like(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for `shape` in the memory order `stride` describes (innermost: the
    smallest stride; ties: the later dim). A piece's strides give its global tensor's:

    >>> dense_strides_like((32, 4), (1, 8))  # a transposed (8, 4) piece, 4 of them stacked
    (1, 32)
    >>> dense_strides_like((8, 3), (3, 1))
    (3, 1)
    """
    dense = [0] * len(shape)
    step = 1
    for d in sorted(range(len(shape)), key=lambda d: (stride[d], -d)):
        dense[d] = step
        step *= max(shape[d], 1)
    return tuple(dense)

