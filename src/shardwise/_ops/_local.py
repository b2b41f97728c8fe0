"""Local implementations: what a rank runs on its pieces when the aten op itself would be wrong.

Most ops run as themselves on the local pieces of the layout their strategy chose. A few
cannot: a random op must draw from the placement-invariant generator at the global indices
this rank holds; a vocab-split embedding must mask the ids outside this rank's rows; a
loss-parallel log_softmax must combine row maxima over the ranks that split the row. Their
rules carry a `LocalFn`, which receives one `LocalCall`: the local arguments, the specs
the inputs have as the op runs and the output's spec, plus a `Runtime` for the little it
needs from the processes (this rank's coordinate, a seed all ranks agree on, an all_reduce
over some mesh dims). The tensor layer provides the runtime; a test can provide one that
simulates a rank. So local implementations are written here, beside their strategies,
without talking to processes themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from .._mesh import AbstractMesh
from .._placement import Shard
from .._spec import DTensorSpec

__all__ = ["LocalCall", "LocalFn", "Runtime"]


class Runtime(Protocol):
    """What a local implementation may ask of the processes (the tensor layer provides it)."""

    def coordinate(self, mesh: AbstractMesh) -> Optional[tuple[int, ...]]:
        """This rank's coordinate in `mesh`, or None when it is not part of it."""

    def seed(self, mesh: AbstractMesh, generator: Optional[torch.Generator]) -> int:
        """A fresh seed, the same on every rank of `mesh` (from `generator` when given)."""

    def all_reduce(self, t: torch.Tensor, mesh: AbstractMesh, mesh_dim: int, op: str) -> torch.Tensor:
        """`t` reduced with `op` over this rank's slice of `mesh` along `mesh_dim`."""


@dataclass
class LocalCall:
    """One op call on this rank's pieces.

    `args` / `kwargs`: the local arguments (DTensors replaced by their pieces in the layout
    the strategy chose); `input_specs`: the spec of every DTensor input as the op runs, in
    flattened argument order; `output_spec`: the output's spec (a tuple for several)."""

    func: Any
    args: list[Any]
    kwargs: dict[str, Any]
    input_specs: tuple[DTensorSpec, ...]
    output_spec: Any
    runtime: Runtime

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument `index` if given positionally, else keyword `name`, else `default`."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def run_op(self) -> Any:
        """The aten op itself on the local arguments."""
        return self.func(*self.args, **self.kwargs)

    def coordinate(self, spec: DTensorSpec, *, outside: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
        """This rank's coordinate in `spec`'s mesh; `outside` for a rank not in it (else ValueError)."""
        found = self.runtime.coordinate(spec.mesh)
        if found is not None:
            return found
        if outside is not None:
            return outside
        raise ValueError(f"this process is not part of the mesh {spec.mesh!r} of the DTensor {self.func} computes on")

    def seed(self, spec: DTensorSpec) -> int:
        """A seed for this call's draw, the same on every rank (from `generator=` when given)."""
        return self.runtime.seed(spec.mesh, self.kwargs.get("generator"))

    def all_reduce(self, t: torch.Tensor, spec: DTensorSpec, mesh_dims: Sequence[int], op: str) -> torch.Tensor:
        """`t` reduced with `op` over the mesh dims `mesh_dims` of `spec`'s mesh, one after another."""
        for i in mesh_dims:
            t = self.runtime.all_reduce(t, spec.mesh, i, op)
        return t

    @staticmethod
    def splitting(spec: DTensorSpec, tensor_dims: Sequence[int]) -> list[int]:
        """The mesh dims that split one of `tensor_dims` in `spec`."""
        return [i for i, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in tensor_dims]


LocalFn = Callable[[LocalCall], Any]
