"""How an error message names a value it rejects: its repr, kept short; a module or a tensor by its kind.

Errors at the public boundary name the value they reject (STYLE.md, point 6). A wrong
argument is usually small (an int, a name, a tuple) and its repr says what went wrong;
a module or a tensor handed to the wrong parameter would print pages, so it is named by
its type (and a tensor by its shape).

>>> describe(5), describe("tp"), describe(list(range(100)))
('5 (int)', "'tp' (str)", '[0, 1, 2, 3, 4, 5, ...] (list)')
>>> import torch
>>> describe(torch.nn.Linear(2, 2)), describe(torch.zeros(3, 2))
('Linear', 'Tensor of shape (3, 2)')
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["describe", "as_shape"]

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60


def describe(value: object) -> str:
    """`value` as an error message names it: `repr (type)`, or the type of a module or tensor."""
    if isinstance(value, nn.Module):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


def as_shape(value: object, what: str) -> tuple[int, ...]:
    """`value` as a tensor shape (a tuple of ints >= 0); else TypeError / ValueError naming it as `what`."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
        isinstance(n, bool) or not hasattr(n, "__index__") for n in value
    ):
        raise TypeError(f"{what} must be a sequence of ints, got {value!r}: e.g. (8, 4)")
    if any(n < 0 for n in value):
        raise ValueError(f"{what} {tuple(value)!r} has a negative size: every size must be >= 0")
    return tuple(int(n) for n in value)
