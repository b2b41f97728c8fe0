"""A naive reference interpreter for layouts: loops over split orders applying `torch.chunk`.

Deliberately independent of `shardwise._layout`: it reads placements and a split order
and literally chunks a global tensor, so the layout math is checked against torch itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

import torch

from shardwise import Placement, Shard


def split_order(placements: Sequence[Placement], shard_order: Mapping[int, Sequence[int]] | None) -> dict[int, list[int]]:
    """Tensor dim -> mesh dims that split it, outermost first (default: ascending mesh dims)."""
    order: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            order.setdefault(p.dim, []).append(m)
    order.update({d: list(ms) for d, ms in (shard_order or {}).items()})
    return order


def local_piece(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
    shard_order: Mapping[int, Sequence[int]] | None = None,
) -> torch.Tensor:
    """The piece of `full` held at `coordinate` (Shard dims non-negative; Partial = whole term)."""
    piece = full
    for d, mesh_dims in split_order(placements, shard_order).items():
        for m in mesh_dims:
            chunks = list(torch.chunk(piece, mesh_shape[m], dim=d))
            while len(chunks) < mesh_shape[m]:  # torch.chunk may return fewer pieces
                empty_shape = list(piece.shape)
                empty_shape[d] = 0
                chunks.append(piece.new_empty(empty_shape))
            piece = chunks[coordinate[m]]
    return piece


def coordinates(mesh_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in mesh_shape))


def assemble(
    pieces: Mapping[tuple[int, ...], torch.Tensor],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    shard_order: Mapping[int, Sequence[int]] | None = None,
) -> torch.Tensor:
    """Rebuild the global tensor from every coordinate's piece (Shard/Replicate layouts).

    Joins the splits with `torch.cat`, outermost split outermost, reading replicated
    (and Partial) mesh dims at index 0.
    """
    splits = [(d, m) for d, ms in split_order(placements, shard_order).items() for m in ms]

    def build(coord: dict[int, int], remaining: list[tuple[int, int]]) -> torch.Tensor:
        if not remaining:
            return pieces[tuple(coord.get(m, 0) for m in range(len(mesh_shape)))]
        (d, m), rest = remaining[0], remaining[1:]
        return torch.cat([build({**coord, m: i}, rest) for i in range(mesh_shape[m])], dim=d)

    return build({}, splits)
