"""`AbstractMesh`: a mesh's shape and dim names, with no processes behind it.

The planning layers (placement math, the redistribute planner, op strategies) take it and
never touch a process group; `DeviceMesh` (`_mesh`) adds the ranks and their groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from ._device import DeviceMesh

__all__ = ["AbstractMesh", "DRY_TWIN", "MeshDim", "check_names"]

MeshDim = Union[int, str]
# How an AbstractMesh finds its dry twin (a DeviceMesh with no processes): set by `_dry`
DRY_TWIN: list[Any] = [None]


class AbstractMesh:
    """A mesh's shape and dim names, with no processes behind it: what planning needs.

    >>> m = AbstractMesh((2, 4), ("dp", "tp"))
    >>> m.ndim, m.size(), m.size("tp"), m.mesh_dim_index("dp")
    (2, 8, 4, 0)
    """

    __slots__ = ("shape", "mesh_dim_names", "_hash")

    shape: tuple[int, ...]
    mesh_dim_names: Optional[tuple[str, ...]]

    def __init__(self, shape: Sequence[int], mesh_dim_names: Optional[Sequence[str]] = None) -> None:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise TypeError(f"mesh shape must be a sequence of ints, one per mesh dim, got {shape!r}: e.g. (2, 4)")
        bad = [s for s in shape if isinstance(s, bool) or not hasattr(s, "__index__")]
        if bad:
            raise TypeError(f"mesh shape {tuple(shape)!r} holds {bad[0]!r} ({type(bad[0]).__name__}): every size must be "
                            f"an int (not a str, float or bool)")
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape {shape} is invalid: give at least one dim, every size >= 1")
        names = check_names(mesh_dim_names, len(shape))
        self.shape = shape
        self.mesh_dim_names = names
        self._hash = hash((shape, names))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: Optional[MeshDim] = None) -> int:
        if mesh_dim is None:
            n = 1
            for s in self.shape:
                n *= s
            return n
        return self.shape[self.mesh_dim_index(mesh_dim)]

    def mesh_dim_index(self, mesh_dim: MeshDim) -> int:
        """The index of a mesh dim given by index or name; errors list what exists."""
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise ValueError(
                    f"mesh dim {mesh_dim!r} is not a dim of this mesh (dim names: {self.mesh_dim_names}); "
                    f"name the mesh dims with mesh_dim_names= or use one of those names"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise TypeError(f"mesh dim must be an int or a dim name, got {mesh_dim!r}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-D mesh of shape {self.shape}")
        return mesh_dim % self.ndim

    def abstract(self) -> AbstractMesh:
        return self

    def __getitem__(self, names: Union[str, Sequence[str]]) -> DeviceMesh:
        """The sub-mesh over the named dims, on this mesh's dry twin (`_dry.DryMesh`), so
        that plans for a dry run name `mesh["tp"]` as they would on a real mesh."""
        twin: DeviceMesh = DRY_TWIN[0](self)
        return twin[names]

    @property
    def has_mesh_group(self) -> bool:
        """Whether collectives may span the whole mesh at once (a redistribute's exchange
        step): planned as if a real mesh of this shape had its group over every rank."""
        return True

    def _key(self) -> tuple[Any, ...]:
        return (self.shape, self.mesh_dim_names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AbstractMesh) and type(other) is type(self) and other._key() == self._key()

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"AbstractMesh({self.shape}{names})"


def check_names(names: Optional[Sequence[str]], ndim: int) -> Optional[tuple[str, ...]]:
    if names is None:
        return None
    names = (names,) if isinstance(names, str) else names
    if isinstance(names, bytes) or not isinstance(names, Sequence):
        raise TypeError(f"mesh_dim_names must be a sequence of str, one per mesh dim, got {names!r}: e.g. ('dp', 'tp')")
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {ndim}-D mesh: give one per mesh dim")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"mesh_dim_names must be strings, got {names}")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"mesh_dim_names {names} repeats {dups}: every mesh dim needs its own name")
    return names

