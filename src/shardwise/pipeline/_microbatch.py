"""Micro-batches: split a mini-batch along the batch dim into `Batch`es and join them back.

A pipeline keeps its stages busy by feeding them micro-batches, so the input is cut
along tensor dim 0 with `Tensor.chunk` semantics, exactly as torchgpipe does: an uneven
batch gives a smaller last micro-batch, and a batch smaller than `chunks` (or one that
`chunk` cannot cut into `chunks` non-empty pieces) gives fewer micro-batches. A stage's
input is a tensor or a tuple; tensors in a tuple are cut together, and values that are
not tensors (flags, sizes, None) are passed whole to every micro-batch.

>>> import torch
>>> [b.tensor.tolist() for b in scatter(torch.arange(5), 2)]
[[0, 1, 2], [3, 4]]
>>> batches = scatter((torch.arange(4), "causal"), 2)
>>> [b.values for b in batches]
[(tensor([0, 1]), 'causal'), (tensor([2, 3]), 'causal')]
>>> gather(batches)
(tensor([0, 1, 2, 3]), 'causal')
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from .._describe import describe

__all__ = ["Batch", "check", "scatter", "gather"]

BatchValue = Union[Tensor, tuple[Any, ...]]


class Batch:
    """One micro-batch: a tensor (*atomic*) or a tuple of values, at least one a tensor.

    Stages call `batch.call(layer)`; the pipeline edits values in place with
    `batch[i] = ...` (an atomic batch has index 0 only) or replaces them all with
    `batch[:] = values`.

    >>> b = Batch((torch.zeros(2), 3))
    >>> b.atomic, len(b), b.find_tensor_idx(), b[1]
    (False, 2, 0, 3)
    """

    __slots__ = ("_value",)

    def __init__(self, value: BatchValue) -> None:
        if not isinstance(value, (Tensor, tuple)):
            raise TypeError(f"Batch takes a Tensor or a tuple, got {describe(value)}")
        self._value: BatchValue = value

    @property
    def atomic(self) -> bool:
        """True when the batch is a single tensor rather than a tuple."""
        return isinstance(self._value, Tensor)

    @property
    def value(self) -> BatchValue:
        """The tensor or the tuple, as a stage receives it."""
        return self._value

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch."""
        if not isinstance(self._value, Tensor):
            raise AttributeError("a tuple batch has no .tensor: use .values or .tensors")
        return self._value

    @property
    def values(self) -> tuple[Any, ...]:
        """Every value, tensors and pass-through values alike (an atomic batch: one tensor)."""
        return (self._value,) if isinstance(self._value, Tensor) else self._value

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The tensor values only, in order."""
        return tuple(v for v in self.values if isinstance(v, Tensor))

    def find_tensor_idx(self) -> int:
        """Index of the first tensor value (where a pipeline attaches its dependencies)."""
        for i, v in enumerate(self.values):
            if isinstance(v, Tensor):
                return i
        raise TypeError(f"batch holds no tensor: {_type_names(self.values)}")

    def get_device(self) -> torch.device:
        """Device of the first tensor value."""
        first: Tensor = self.values[self.find_tensor_idx()]
        return first.device

    def call(self, function: Callable[[BatchValue], BatchValue]) -> Batch:
        """Run a stage on this micro-batch and wrap what it returns."""
        return Batch(function(self._value))

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __getitem__(self, index: int) -> Any:
        if isinstance(self._value, Tensor) and index not in (0, -1):
            raise IndexError(f"an atomic batch has index 0 only, got {index}")
        return self.values[index]

    def __setitem__(self, index: int | slice, value: Any) -> None:
        if isinstance(index, slice):
            if not (index.start is None and index.stop is None and index.step is None):
                raise NotImplementedError(f"only batch[:] = values is supported, got slice {index}")
            values = tuple(value)
            if isinstance(self._value, Tensor):
                if len(values) != 1 or not isinstance(values[0], Tensor):
                    raise IndexError(f"an atomic batch is replaced by one tensor, got {_type_names(values)}")
                self._value = values[0]
            else:
                self._value = values
            return
        if isinstance(self._value, Tensor):
            if index not in (0, -1):
                raise IndexError(f"an atomic batch has index 0 only, got {index}")
            if not isinstance(value, Tensor):
                raise TypeError(f"an atomic batch holds a Tensor, got {type(value).__name__}")
            self._value = value
            return
        items = list(self._value)
        items[index] = value
        self._value = tuple(items)

    def __repr__(self) -> str:
        return f"Batch({self._value!r})"


def check(input: object) -> None:
    """Raise TypeError unless `input` is a Tensor or a tuple with at least one Tensor whose
    other values hold no tensors (a tensor nested in a list or tuple would not be split).

    >>> check((torch.zeros(2), None))
    >>> check([torch.zeros(2)])
    Traceback (most recent call last):
    ...
    TypeError: expected Tensor, but got [tensor([0., 0.])] (list): pass a Tensor or a tuple of values with at least one Tensor
    """
    if isinstance(input, Tensor):
        return
    if not isinstance(input, tuple):
        raise TypeError(f"expected Tensor, but got {describe(input)}: pass a Tensor or a tuple of values "
                        "with at least one Tensor")
    problems = [f"input[{i}] is a {type(v).__name__} holding tensors, which would not be split into "
                "micro-batches: pass those tensors as elements of the input tuple itself"
                for i, v in enumerate(input)
                if not isinstance(v, Tensor) and any(isinstance(leaf, Tensor) for leaf in tree_leaves(v))]
    if not any(isinstance(v, Tensor) for v in input):
        problems.append(f"expected Tensor, but got {describe(input)}: at least one value must be a Tensor to "
                        "split along the batch dim")
    _raise(TypeError, problems)


def scatter(input: BatchValue, chunks: int) -> list[Batch]:
    """Split `input` into at most `chunks` micro-batches along tensor dim 0 (`Tensor.chunk`
    sizes: `ceil(batch / chunks)` rows each, the last one smaller; fewer micro-batches when
    the batch is too small, one for an empty batch). Non-tensor values of a tuple go whole to
    every micro-batch."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"number of chunks must be positive integer, got {chunks!r}")
    check(input)
    # never more micro-batches than rows (Tensor.chunk makes `chunks` pieces of an empty batch,
    # and overflows past 2**63 of them): a row each, and one micro-batch of an empty batch
    if isinstance(input, Tensor):
        _raise(ValueError, _batch_dim_problems([("input", input)]))
        return [Batch(piece) for piece in input.chunk(min(chunks, max(len(input), 1)))]
    tensors = [(f"input[{i}]", v) for i, v in enumerate(input) if isinstance(v, Tensor)]
    _raise(ValueError, _batch_dim_problems(tensors))
    pieces = {name: t.chunk(min(chunks, max(len(t), 1))) for name, t in tensors}
    count = len(next(iter(pieces.values())))
    return [Batch(tuple(pieces[f"input[{i}]"][k] if isinstance(v, Tensor) else v for i, v in enumerate(input)))
            for k in range(count)]


def gather(outputs: Sequence[Batch]) -> BatchValue:
    """Join micro-batches back into one value of the same structure: tensors are
    concatenated along tensor dim 0; a non-tensor value comes back once when every
    micro-batch holds the same value, else as a list of the per-micro-batch values."""
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence) or not all(
        isinstance(b, Batch) for b in outputs
    ):
        raise TypeError(f"gather takes a list of Batch (the micro-batches scatter made), got {describe(outputs)}")
    if not outputs:
        raise ValueError(f"gather needs at least one micro-batch, got {outputs!r}")
    first = outputs[0]
    kinds = {(b.atomic, len(b)) for b in outputs}
    if len(kinds) != 1:
        raise ValueError("micro-batches have different structures: "
                         + ", ".join(f"#{i}: {_type_names(b.values)}" for i, b in enumerate(outputs)))
    if first.atomic:
        return torch.cat([b.tensor for b in outputs])
    joined: list[Any] = []
    for position, column in enumerate(zip(*(b.values for b in outputs))):
        n_tensors = sum(isinstance(v, Tensor) for v in column)
        if n_tensors == len(column):
            joined.append(torch.cat(column))
        elif n_tensors:
            raise ValueError(f"value {position} is a tensor in some micro-batches only: {_type_names(column)}")
        else:
            joined.append(column[0] if all(_same(column[0], v) for v in column) else list(column))
    return tuple(joined)


def _batch_dim_problems(tensors: Sequence[tuple[str, Tensor]]) -> list[str]:
    problems = [f"{name} is a 0-d tensor, which has no batch dim to split: give it a batch dim or pass it "
                "as a Python number" for name, t in tensors if t.dim() == 0]
    sizes = {name: t.shape[0] for name, t in tensors if t.dim() > 0}
    if len(set(sizes.values())) > 1:
        problems.append("tensors of one input must have the same batch size (tensor dim 0), got "
                        + ", ".join(f"{name}: {n}" for name, n in sizes.items()))
    return problems


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        equal = a == b
    except Exception:
        return False
    return equal if isinstance(equal, bool) else False


def _type_names(values: Sequence[Any]) -> str:
    return "(" + ", ".join(type(v).__name__ for v in values) + ")"


def _raise(kind: type[Exception], problems: list[str]) -> None:
    if len(problems) == 1:
        raise kind(problems[0])
    if problems:
        raise kind(f"{len(problems)} problems with the pipeline input:\n" + "\n".join(f"  - {p}" for p in problems))
