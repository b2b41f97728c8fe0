"""`gradient_reducers(param)`: who reduces a parameter's gradient at the end of backward, over which ranks, and how.

Every gradient reduction that runs at the end of a backward pass is registered with one
registry (`_tensor/_end_of_backward.py`), at most one reducer per parameter and level, in
the order they apply: `layout` (within the parameter's mesh: its DTensor layout, or the
style that declared it, `ReplicateParallel`), `replicas` (over the ranks that hold copies:
a `fully_shard` unit, `data_parallel`, `ContextParallel`), `across` (over replica groups).
A composition that must not reduce twice asks the same question in code; this is the
question for people, when a gradient looks off by a factor of the mesh size.

>>> import torch
>>> gradient_reducers(torch.zeros(2, requires_grad=True))  # a plain tensor nobody reduces
()
"""

from __future__ import annotations

from typing import Union, overload

import torch
from torch import nn

from .._describe import describe
from .._tensor import LEVELS, GradientReducer, layout_reducer, reducers_at

__all__ = ["gradient_reducers"]

Reducers = tuple[GradientReducer, ...]


@overload
def gradient_reducers(target: nn.Module) -> dict[str, Reducers]: ...


@overload
def gradient_reducers(target: torch.Tensor) -> Reducers: ...


def gradient_reducers(target: Union[torch.Tensor, nn.Module]) -> Union[Reducers, dict[str, Reducers]]:
    """The reducers of a parameter's gradient, in the order they run (empty: its gradient stays
    as backward leaves it); for a module, those of each parameter, by name. `print` each for a
    line: `data_parallel: avg over mesh dim 'dp', ranks [0, 2] (replicas; registered at train.py:30)`."""
    if not isinstance(target, (torch.Tensor, nn.Module)):
        raise TypeError(f"gradient_reducers takes a parameter (a tensor) or an nn.Module, got {describe(target)}")
    by_level = {level: reducers_at(level) for level in LEVELS}
    if isinstance(target, torch.Tensor):
        return _of(target, by_level)
    return {name: _of(p, by_level) for name, p in target.named_parameters()}


def _of(p: torch.Tensor, by_level: dict[str, dict[int, tuple[str, GradientReducer]]]) -> Reducers:
    found = {level: by_level[level].get(id(p)) for level in LEVELS}
    out = [entry[1] for entry in found.values() if entry is not None]
    if found["layout"] is None and not any(r.sets_grad for r in out):  # (one that sets .grad skips the layout step)
        default = layout_reducer(p)
        if default is not None:
            out.insert(0, default)
    return tuple(out)
