"""Running ops on `_StridedShard` DTensors (a fused projection's output split part by part):
the runners of the plans `_ops._strided_plan` makes.

| plan (`_ops`) | runner | a call runs |
|---|---|---|
| `SplitParts` | `SplitPlan` | the local piece split at the parts' local sizes |
| `SliceParts` | `SlicePlan` | the same parts of the local piece |
| `SliceBackwardParts` | `SliceBackwardPlan` | zeros with the gradient's piece in its parts |
| `CatParts` | `CatPlan` | the local pieces side by side |
| `Unstride` | `UnstridedPlan` | the strided mesh dims gathered, the op dispatched again, written arguments written back |

Whether an op runs in the backward of a `split` (`in_split_backward`) is read here, from
autograd, and handed to planning as a mode of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._ops import Location
from .._redistribute import run_program
from ._redistribute import Move
from ._wrap import Wrapper, wrap

__all__ = ["CatPlan", "SliceBackwardPlan", "SlicePlan", "SplitPlan", "UnstridedPlan", "in_split_backward"]

_SPLIT_BACKWARD = frozenset({"SplitBackward0", "SplitWithSizesBackward0"})


def in_split_backward() -> bool:
    """Whether the op runs in the backward of a `split` (its `cat` of the pieces' gradients)."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ in _SPLIT_BACKWARD


@dataclass(frozen=True)
class SplitPlan:
    """`split` of a `_StridedShard` dim at part boundaries: the local piece split alike."""

    dim: int
    local_sizes: tuple[int, ...]
    outputs: tuple[Wrapper, ...]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        pieces = args[0]._local_tensor.split(list(self.local_sizes), self.dim)
        return [w(p) for p, w in zip(pieces, self.outputs)]


@dataclass(frozen=True)
class SlicePlan:
    """`slice` of whole parts of a `_StridedShard` dim: the same parts of the local piece."""

    dim: int
    start: int
    length: int
    output: Wrapper

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.output(args[0]._local_tensor.narrow(self.dim, self.start, self.length))


@dataclass(frozen=True)
class SliceBackwardPlan:
    """The gradient of a slice of whole parts: zeros with the slice's pieces in their parts."""

    dim: int
    start: int
    local_shape: tuple[int, ...]
    output: Wrapper

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        piece = args[0]._local_tensor
        out = piece.new_zeros(self.local_shape)
        out.narrow(self.dim, self.start, piece.shape[self.dim]).copy_(piece)
        return self.output(out)


@dataclass(frozen=True)
class CatPlan:
    """`cat` of equal `Shard(d)` pieces along `d` into a `_StridedShard(d)`: local pieces side by side."""

    dim: int
    output: Wrapper

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.output(torch.cat([t._local_tensor for t in args[0]], self.dim))


@dataclass(frozen=True)
class UnstridedPlan:
    """Gather every `_StridedShard` input's strided mesh dims (parts back in order), run the op
    as usual on those, and write a written argument back into its strided layout."""

    func: Any
    moves: tuple[tuple[Location, Move], ...]
    written: tuple[tuple[Location, Move], ...]
    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        new_args: list[Any] = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
        new_kwargs: dict[str, Any] = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
        swapped: dict[int, Any] = {}
        for (key, j), move in self.moves:
            holder: Any = new_args if isinstance(key, int) else new_kwargs
            original = holder[key] if j is None else holder[key][j]
            plain = wrap(run_program(move.program, original._local_tensor), move.dst)
            swapped[id(plain)] = original
            if j is None:
                holder[key] = plain
            else:
                holder[key][j] = plain
        call_args = tuple(tuple(a) if isinstance(args[i], tuple) else a for i, a in enumerate(new_args))
        out = self.dispatch(self.func, call_args, new_kwargs)
        for (key, j), back in self.written:
            holder = new_args if isinstance(key, int) else new_kwargs
            plain = holder[key] if j is None else holder[key][j]
            swapped[id(plain)]._local_tensor.copy_(run_program(back.program, plain._local_tensor))
        if isinstance(out, (list, tuple)):
            return type(out)(swapped.get(id(o), o) for o in out)
        return swapped.get(id(out), out)
