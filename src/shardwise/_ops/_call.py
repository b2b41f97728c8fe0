"""One op call as planning sees it: its arguments described, never the tensors themselves.

The tensor layer describes a call once, on its first run (`_tensor._dispatch`): a DTensor
becomes its `DTensorSpec`, a plain tensor a `PlainTensor` (or a `ScalarTensor` when it has
no dims), a list of them a tuple; scalars stay as they are. With the modes on, this rank's
coordinate on the call's mesh and whether the call runs in the backward of a `split`, that
is everything `make_plan` reads: a plan is a function of the description alone.

>>> import torch
>>> from shardwise._mesh import AbstractMesh
>>> from shardwise._placement import Shard
>>> meta = TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32)
>>> x = DTensorSpec(AbstractMesh((2,)), (Shard(0),), meta)
>>> call = OpCall(torch.ops.aten.add.Tensor, (x, PlainTensor(meta)), (), frozenset(), (0,))
>>> call.locations()
((0, None), (1, None))
>>> call.schema().args_schema[1].placements
(Replicate(),)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from .._placement import Replicate
from .._spec import DTensorSpec, TensorMeta
from ._schema import OpSchema

__all__ = ["Location", "OpCall", "PlainTensor"]

# Where a tensor input sits: (positional index or keyword name, index in a list or None).
Location = tuple[Union[int, str], Optional[int]]


@dataclass(frozen=True)
class PlainTensor:
    """A plain tensor of one or more dims beside DTensors: it counts as replicated on their mesh."""

    meta: TensorMeta


@dataclass(frozen=True)
class OpCall:
    """An op call described: `args` / `kwargs` with every DTensor as its spec (see the module
    docstring); `coordinate`: this rank's on the call's mesh, None on a rank outside it;
    `split_backward`: the call is the `cat` of a `split`'s gradients."""

    op: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    modes: frozenset[str]
    coordinate: Optional[tuple[int, ...]]
    split_backward: bool = False

    def values(self) -> list[tuple[Union[int, str], Any]]:
        """Every argument with its position or name."""
        return list(enumerate(self.args)) + list(self.kwargs)

    def locations(self) -> tuple[Location, ...]:
        """Where every tensor input sits (a 0-dim plain tensor is a scalar, not an input)."""
        found: list[Location] = []
        for key, value in self.values():
            if _is_input(value):
                found.append((key, None))
            elif isinstance(value, tuple):
                found.extend((key, j) for j, x in enumerate(value) if _is_input(x))
        return tuple(found)

    def at(self, loc: Location) -> Any:
        key, j = loc
        value = self.args[key] if isinstance(key, int) else dict(self.kwargs)[key]
        return value if j is None else value[j]

    def mesh(self) -> Any:
        """The first DTensor's mesh (None: no DTensor in the call)."""
        for _, value in self.values():
            for x in value if isinstance(value, tuple) else (value,):
                if isinstance(x, DTensorSpec):
                    return x.mesh
        return None

    def meshes(self) -> list[Any]:
        """The distinct meshes of the call's DTensors, in argument order."""
        found: list[Any] = []
        for _, value in self.values():
            for x in value if isinstance(value, tuple) else (value,):
                if isinstance(x, DTensorSpec) and x.mesh not in found:
                    found.append(x.mesh)
        return found

    def schema(self) -> OpSchema:
        """What propagation sees: a plain tensor is a replicated spec on the call's mesh."""
        mesh = self.mesh()
        return OpSchema(self.op, tuple(_schema_arg(a, mesh) for a in self.args),
                        tuple((k, _schema_arg(v, mesh)) for k, v in self.kwargs))


def _is_input(a: Any) -> bool:
    return isinstance(a, (DTensorSpec, PlainTensor))


def _schema_arg(a: Any, mesh: Any) -> Any:
    if isinstance(a, PlainTensor):
        if mesh is None:
            raise TypeError(f"a plain tensor of shape {tuple(a.meta.shape)} reached DTensor dispatch without a DTensor "
                            f"beside it")
        return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, a.meta)
    if isinstance(a, tuple):
        return tuple(_schema_arg(x, mesh) for x in a)
    return a
