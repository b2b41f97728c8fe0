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

torch's own mesh, placements, DTensor and parallel styles are shardwise's namesakes, but
other classes: one of them handed to shardwise is named as torch's, with what to use
instead (`torch_twin`), and `refuse_torch` turns that into the TypeError every public
entry point raises for it. torch's modules are never imported here: its objects are known
by their class's module and name.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["describe", "as_shape", "torch_twin", "refuse_torch"]

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60

_STYLES = ("ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput")


def _style(name: str) -> Callable[[Any], str]:
    return lambda _: f"shardwise.parallel.{name}"


# torch.distributed's classes that shardwise mirrors, by class name -> what to use instead
_TWINS: dict[str, Callable[[Any], str]] = {
    "DeviceMesh": lambda _: "shardwise.init_device_mesh(...) / shardwise.DeviceMesh",
    "Shard": lambda p: f"shardwise.Shard({p.dim})",
    "Replicate": lambda _: "shardwise.Replicate()",
    "Partial": lambda p: f"shardwise.Partial({p.reduce_op!r})",
    "DTensor": lambda _: "a shardwise DTensor (shardwise.distribute_tensor or shardwise.DTensor.from_local "
                         "on a shardwise mesh; torch's to_local() gives this rank's piece)",
    **{name: _style(name) for name in _STYLES},
}
_TORCH_MODULES = ("torch.distributed", "torch._C._distributed")


def torch_twin(value: object) -> Optional[tuple[str, str]]:
    """(its class path, what to use instead) for one of torch.distributed's objects that
    shardwise mirrors (a `DeviceMesh`, a placement, a `DTensor`, a parallel style); else None.

    >>> torch_twin(torch.zeros(1)) is None
    True
    """
    kind = type(value)
    for cls in kind.__mro__:
        if cls.__name__ in _TWINS and cls.__module__.startswith(_TORCH_MODULES):
            return f"{kind.__module__}.{kind.__qualname__}", _TWINS[cls.__name__](value)
    return None


def refuse_torch(value: object, where: str) -> None:
    """TypeError if `value` is torch's own namesake of a shardwise object: says so and names
    shardwise's (`where`: the entry point and argument that got it)."""
    found = torch_twin(value)
    if found is not None:
        raise TypeError(f"{where} got {found[0]} (torch's); use {found[1]}: torch's and shardwise's "
                        f"objects do not mix")


def describe(value: object) -> str:
    """`value` as an error message names it: `repr (type)`, or the type of a module or tensor;
    one of torch's namesakes as torch's, with shardwise's to use instead."""
    found = torch_twin(value)
    if isinstance(value, nn.Module):
        short = type(value).__name__
    elif isinstance(value, torch.Tensor):
        short = f"{type(value).__name__} of shape {tuple(value.shape)}"
    elif found is None:
        return f"{_SHORT.repr(value)} ({type(value).__name__})"
    else:
        short = _SHORT.repr(value)
    return short if found is None else f"{short} ({found[0]}, torch's: use {found[1]})"


def as_shape(value: object, what: str) -> tuple[int, ...]:
    """`value` as a tensor shape (a tuple of ints >= 0); else TypeError / ValueError naming it as `what`."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
        isinstance(n, bool) or not hasattr(n, "__index__") for n in value
    ):
        raise TypeError(f"{what} must be a sequence of ints, got {value!r}: e.g. (8, 4)")
    if any(n < 0 for n in value):
        raise ValueError(f"{what} {tuple(value)!r} has a negative size: every size must be >= 0")
    return tuple(int(n) for n in value)
