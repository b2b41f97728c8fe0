"""Placements: how a tensor lives along one mesh dim (`Shard`, `Replicate`, `Partial`).

A layout holds one placement per mesh dim. Placements are frozen, hashable values with
a `repr` that round-trips (`Shard(dim=0)`) and a short `str` used in explanations and
error messages (`S(0)`, `R`, `P(sum)`).

>>> [str(p) for p in (Shard(0), Replicate(), Partial(), Partial("max"))]
['S(0)', 'R', 'P(sum)', 'P(max)']
>>> Shard(1) == Shard(1), hash(Replicate()) == hash(Replicate())
(True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

__all__ = ["Placement", "Shard", "Replicate", "Partial", "ReduceOp", "REDUCE_OPS", "BITWISE_OPS", "check_reduce_dtype",
           "_StridedShard"]

ReduceOp = Literal["sum", "avg", "max", "min", "prod", "band", "bor", "bxor"]
REDUCE_OPS: Final = ("sum", "avg", "max", "min", "prod", "band", "bor", "bxor")
BITWISE_OPS: Final = ("band", "bor", "bxor")  # integer and bool tensors only


class Placement:
    """Base class of the three placements; never instantiated itself."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Shard(Placement):
    """The tensor is split along tensor dim `dim` across this mesh dim (`torch.chunk` sizes)."""

    __slots__ = ("dim",)
    dim: int

    def __init__(self, dim: int) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Shard(dim) takes an int tensor dim, got {dim!r} of type {type(dim).__name__}")
        object.__setattr__(self, "dim", dim)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self!r} is frozen")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("S", self.dim))

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __reduce__(self) -> tuple[type[Shard], tuple[int]]:
        return (Shard, (self.dim,))


class _StridedShard(Placement):
    """Tensor dim `dim` holds `split_factor` equal parts side by side (a fused q|k|v or
    gate|up projection); each part is split across this mesh dim, and a rank holds its
    piece of every part, in part order (torch's `_StridedShard`).

    Each part must split evenly over the mesh dim, and no other mesh dim may split `dim`.
    Splitting the parts apart (`split`, `chunk` at part boundaries) needs no communication:
    each part comes out `Shard(dim)`.

    >>> str(_StridedShard(2, split_factor=3)), _StridedShard(2, split_factor=3) == Shard(2)
    ('_S(2, 3)', False)
    """

    __slots__ = ("dim", "split_factor")
    dim: int
    split_factor: int

    def __init__(self, dim: int, *, split_factor: int) -> None:
        for name, v in (("dim", dim), ("split_factor", split_factor)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"_StridedShard({name}=) takes an int, got {v!r} of type {type(v).__name__}")
        if split_factor < 1:
            raise ValueError(f"_StridedShard(split_factor={split_factor}) must be at least 1")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self!r} is frozen")

    def __eq__(self, other: object) -> bool:
        return type(other) is _StridedShard and other.dim == self.dim and other.split_factor == self.split_factor

    def __hash__(self) -> int:
        return hash(("SS", self.dim, self.split_factor))

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_strided_shard, (self.dim, self.split_factor))


def _strided_shard(dim: int, split_factor: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=split_factor)


class Replicate(Placement):
    """Every rank along this mesh dim holds the same full data."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is Replicate

    def __hash__(self) -> int:
        return hash("R")

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"

    def __reduce__(self) -> tuple[type[Replicate], tuple[()]]:
        return (Replicate, ())


class Partial(Placement):
    """Each rank holds a term; the global value is their reduction: `sum`, `avg`, `max`, `min`,
    `prod` (torch's `"product"` too), or, for integer and bool tensors, `band`, `bor`, `bxor`."""

    __slots__ = ("reduce_op",)
    reduce_op: ReduceOp

    def __init__(self, reduce_op: str = "sum") -> None:
        if reduce_op == "product":  # torch's spelling (c10d's ReduceOp.PRODUCT)
            reduce_op = "prod"
        if reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce_op={reduce_op!r}) is not supported: use one of {', '.join(REDUCE_OPS)}"
            )
        object.__setattr__(self, "reduce_op", reduce_op)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self!r} is frozen")

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self) -> int:
        return hash(("P", self.reduce_op))

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op!r})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __reduce__(self) -> tuple[type[Partial], tuple[str]]:
        return (Partial, (self.reduce_op,))


def check_reduce_dtype(placements: Sequence[Placement], dtype: Any, where: str) -> None:
    """ValueError if a bitwise Partial in `placements` would reduce a tensor of `dtype` that has
    no bits to combine (floating point or complex); `where` names the call."""
    for i, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op in BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(
                f"{where}: placements[{i}] = {p} reduces bit by bit, which a {dtype} tensor cannot: use an integer "
                f"or bool tensor, or Partial('sum' / 'max' / 'min' / 'prod' / 'avg') for {dtype}"
            )
