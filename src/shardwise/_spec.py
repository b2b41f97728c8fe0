"""`DTensorSpec`: a tensor's layout, i.e. mesh + placements + split order + global meta.

Specs are frozen and hash in O(1) (the hash is computed once), because the dispatch
cache keys every op call on the specs of its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch

from ._layout import (
    ShardOrder,
    format_placements,
    local_shape_and_offset,
    max_local_shape,
    split_orders,
)
from ._mesh import AbstractMesh
from ._placement import Partial, Placement, Shard

__all__ = ["TensorMeta", "DTensorSpec"]


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype of a distributed tensor."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class DTensorSpec:
    """Layout of a distributed tensor; placements are already validated and normalized."""

    __slots__ = ("mesh", "placements", "tensor_meta", "shard_order", "_hash")

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensorSpec:
        return self  # immutable, and its mesh holds process groups

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        meta = self.tensor_meta
        return (_spec_from, (self.mesh, self.placements, tuple(meta.shape), tuple(meta.stride), meta.dtype, self.shard_order))

    mesh: AbstractMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta
    shard_order: ShardOrder

    def __init__(
        self,
        mesh: AbstractMesh,
        placements: tuple[Placement, ...],
        tensor_meta: TensorMeta,
        shard_order: ShardOrder = (),
    ) -> None:
        self.mesh = mesh
        self.placements = placements
        self.tensor_meta = tensor_meta
        self.shard_order = shard_order
        # hashed on first use, not here: torch.compile traces this constructor (a style's hook
        # calling from_local), and dynamo before torch 2.13 cannot trace hash() of a tuple
        self._hash: Optional[int] = None

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        return (
            type(other) is DTensorSpec
            and hash(self) == hash(other)
            and self.placements == other.placements
            and self.tensor_meta == other.tensor_meta
            and self.shard_order == other.shard_order
            and self.mesh == other.mesh
        )

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = self._hash = hash((self.mesh, self.placements, self.tensor_meta, self.shard_order))
        return h

    # -- derived -------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.tensor_meta.shape

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor_meta.dtype

    def same_layout(self, other: DTensorSpec) -> bool:
        return self.placements == other.placements and self.shard_order == other.shard_order and self.mesh == other.mesh

    def with_placements(self, placements: tuple[Placement, ...], shard_order: ShardOrder = ()) -> DTensorSpec:
        return DTensorSpec(self.mesh, placements, self.tensor_meta, shard_order)

    def with_meta(self, tensor_meta: TensorMeta) -> DTensorSpec:
        return DTensorSpec(self.mesh, self.placements, tensor_meta, self.shard_order)

    def split_orders(self) -> dict[int, tuple[int, ...]]:
        return split_orders(self.placements, self.shard_order)

    def local_shape_and_offset(self, coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return local_shape_and_offset(self.shape, self.mesh.shape, self.placements, coordinate, self.shard_order)

    def max_local_shape(self) -> tuple[int, ...]:
        return max_local_shape(self.shape, self.mesh.shape, self.placements, self.shard_order)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def is_sharded(self) -> bool:
        return any(isinstance(p, Shard) for p in self.placements)

    def layout_str(self) -> str:
        order = "".join(f" split {d}:{ms}" for d, ms in self.shard_order)
        return format_placements(self.placements) + order

    def __repr__(self) -> str:
        return f"DTensorSpec({self.layout_str()}, shape={tuple(self.shape)}, dtype={self.dtype}, mesh={self.mesh!r})"


def _spec_from(mesh: AbstractMesh, placements: tuple[Placement, ...], shape: tuple[int, ...], stride: tuple[int, ...],
               dtype: torch.dtype, shard_order: ShardOrder) -> DTensorSpec:
    """A pickled spec, rebuilt (`DTensorSpec.__reduce__`)."""
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), tuple(stride), dtype), shard_order)
