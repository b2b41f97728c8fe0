"""Sharding plans as frozen values: `ShardingPlan`, `Sharder`, `ShardingPlanner`, and their validation.

A plan says, by name, how a model is sharded: a layout per parameter, a `Sharder` (a
tensor-parallel style) per submodule, a layout per module output. It is data, resolved
against a module and a mesh only when applied, and that resolution is pure: every name,
pattern, layout and style is checked against the module's structure and the mesh's shape
without talking to any process, and every problem is reported at once. So a plan for a
thousand-rank mesh is checked on a laptop, and a typo fails before the first collective.

A layout is either placements, one per mesh dim (`(Shard(0),)`, or a bare placement on a
1-D mesh), or a partition spec, one entry per tensor dim naming the mesh dims that split
it (`(None, "tp")`, `(("dp", "tp"), None)`; trailing tensor dims may be left out).
Names are matched atom by atom with shell patterns: `"blocks.*.q"` matches `blocks.0.q`.

>>> plan = ShardingPlan({"fc.weight": (None, "tp")}, return_local_tensor=["fc"])
>>> plan.plan["fc.weight"], plan.return_local_tensor
((None, 'tp'), ('fc',))
>>> plan == ShardingPlan({"fc.weight": [None, ("tp",)]}, return_local_tensor=("fc",))
True
"""

from __future__ import annotations

import abc
import difflib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union, cast

import torch
from torch import nn

from .._describe import describe
from .._layout import Layout, ShardOrder, chunk_range, format_placements, normalize_placements, split_orders
from .._mesh import AbstractMesh
from .._partition_spec import to_placements
from .._placement import Placement

if TYPE_CHECKING:
    from ._coverage import Coverage
    from .._mesh import DeviceMesh

__all__ = ["ShardingPlan", "ShardingPlanner", "Sharder"]

V = TypeVar("V")
SpecEntry = Union[None, str, tuple[str, ...]]
# A plan's entry, canonical: a tuple of placements (one per mesh dim) or a partition spec
# (one entry per tensor dim); `to_layout` turns it into the `PlanEntry` it names.
PlanEntry = tuple[Any, ...]
LayoutLike = Union[Placement, str, Sequence[Any]]


class FrozenMap(Mapping[str, V]):
    """A read-only, hashable mapping (plans and styles are values); its repr is a dict literal."""

    def __init__(self, items: Mapping[str, V]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


class Sharder(abc.ABC):
    """Shards one module in place (or returns its replacement): what a plan maps a module name to."""

    @abc.abstractmethod
    def shard(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Shard `module` over `device_mesh`; return it (or the module that replaces it)."""

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        """Problems applying this sharder to `module` on a mesh of this shape would hit (none: `[]`).

        Pure: called for the whole plan before anything is sharded.
        """
        return []

    def validate_at(self, path: str, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        """`validate` for the module at `path` in the model being sharded (a style may read its name). Pure."""
        return self.validate(module, device_mesh)

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        """The placements `shard` will give `module`'s parameters, by name relative to `module`, when
        known in advance; the plan checks them (tensor dims in range, no empty pieces, tied weights agree)."""
        return {}


@dataclass(frozen=True)
class ShardingPlan:
    """How to shard a module: layouts or `Sharder`s by name, output layouts, local outputs.

    - `plan`: parameter name (`"blocks.0.q.weight"`) -> layout, or submodule name or
      pattern (`"blocks.*.q"`, `""` for the root) -> `Sharder`.
    - `output_plan`: submodule name -> the layout its (DTensor) output is redistributed to.
    - `return_local_tensor`: submodules whose DTensor outputs become local tensors.
    - `coverage`: set by planners: what the plan shards and leaves replicated.

    Values are canonicalised on construction (placements and specs become tuples, mappings
    read-only), so equal plans compare and hash equal.
    """

    plan: Mapping[str, Union[LayoutLike, Sharder]]
    output_plan: Optional[Mapping[str, LayoutLike]] = None
    return_local_tensor: Optional[Sequence[str]] = None
    # what a planner's plan shards and leaves replicated (`coverage()`); not part of the plan's identity
    coverage: Optional["Coverage"] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.plan, Mapping):
            raise TypeError(
                f"ShardingPlan(plan=...) must map names to layouts or Sharders, got {describe(self.plan)}: e.g. "
                f"{{'fc': ColwiseParallel(), 'fc.bias': (Shard(0),)}}"
            )
        plan: dict[str, Union[PlanEntry, Sharder]] = {}
        for key, value in self.plan.items():
            if not isinstance(key, str):
                problems.append(f"plan key {key!r} is not a str: name a parameter or a submodule")
            elif isinstance(value, Sharder):
                plan[key] = value
            else:
                plan[key] = _canonical_layout(value, f"plan[{key!r}]", problems)
        outputs: Optional[dict[str, PlanEntry]] = None
        if self.output_plan is not None:
            if not isinstance(self.output_plan, Mapping):
                problems.append(f"output_plan must map module names to layouts, got {describe(self.output_plan)}")
            else:
                outputs = {k: _canonical_layout(v, f"output_plan[{k!r}]", problems) for k, v in self.output_plan.items()}
        local: Optional[tuple[str, ...]] = None
        if self.return_local_tensor is not None:
            names = self.return_local_tensor
            if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                problems.append(
                    f"return_local_tensor must be a list of module names, got {names!r}: write [{names!r}] for one module"
                    if isinstance(names, str) else f"return_local_tensor must be a list of module names (str), got {names!r}"
                )
            else:
                local = tuple(names)
        if problems:
            raise TypeError("invalid ShardingPlan:\n" + "\n".join(f"  - {p}" for p in problems))
        object.__setattr__(self, "plan", FrozenMap(plan))
        object.__setattr__(self, "output_plan", None if outputs is None else FrozenMap(outputs))
        object.__setattr__(self, "return_local_tensor", local)

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> None:
        """Check the whole plan against `module` and the mesh's shape; raise one ValueError listing
        every problem, each with its module path. Pure: no process is contacted."""
        resolve(self, module, device_mesh)


class ShardingPlanner(abc.ABC):
    """Derives a `ShardingPlan` for a module, e.g. from its structure (`MegatronPlanner`)."""

    @abc.abstractmethod
    def build_plan(self, module: nn.Module) -> ShardingPlan:
        """The plan for `module`."""


# -- layouts ------------------------------------------------------------------------------


def _canonical_layout(value: Any, what: str, problems: list[str]) -> PlanEntry:
    if isinstance(value, Placement):
        return (value,)
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (tuple, list)):
        problems.append(
            f"{what} = {value!r} is not a layout: give placements (e.g. (Shard(0),)), a partition spec "
            f"(e.g. (None, 'tp')) or a Sharder"
        )
        return ()
    items = tuple(value)
    if items and all(isinstance(p, Placement) for p in items):
        return items
    out: list[SpecEntry] = []
    for i, e in enumerate(items):
        if e is None or isinstance(e, str):
            out.append(e)
        elif isinstance(e, (tuple, list)) and all(isinstance(n, str) for n in e):
            names = tuple(e)
            out.append(None if not names else names[0] if len(names) == 1 else names)
        else:
            problems.append(
                f"{what}[{i}] = {e!r}: a layout is all placements (one per mesh dim) or a partition spec whose "
                f"entries are None, a mesh dim name or a tuple of names (one per tensor dim)"
            )
    return tuple(out)


def is_placements(layout: PlanEntry) -> bool:
    return bool(layout) and isinstance(layout[0], Placement)


def _mesh_dim_label(mesh: AbstractMesh, m: int) -> str:
    return f"{mesh.mesh_dim_names[m]!r}" if mesh.mesh_dim_names else f"{m}"


def to_layout(layout: PlanEntry, mesh: AbstractMesh, ndim: int) -> Layout:
    """The layout (placements normalized, split order) `layout` names for an `ndim`-D tensor; ValueError if invalid.

    A partition spec goes through `shardwise._partition_spec.to_placements`, the one
    conversion every partition-spec API uses (missing trailing entries are None).
    """
    if is_placements(layout):
        return Layout(normalize_placements(layout, mesh.ndim, ndim))
    return Layout(*to_placements(layout, mesh.shape, mesh.mesh_dim_names, ndim, exact_length=False))


def _empty_pieces(shape: Sequence[int], pl: Sequence[Placement], order: ShardOrder, mesh: AbstractMesh) -> list[str]:
    """A problem for each tensor dim whose split leaves some rank an empty piece."""
    out = []
    for d, ms in sorted(split_orders(pl, order).items()):
        size = shape[d]
        if size == 0:
            continue
        for coord in itertools.product(*(range(mesh.shape[m]) for m in ms)):
            piece = size
            for m, c in zip(ms, coord):
                piece = chunk_range(piece, mesh.shape[m], c)[1]
            if piece == 0:
                over = ", ".join(f"mesh dim {_mesh_dim_label(mesh, m)} of size {mesh.shape[m]}" for m in ms)
                at = ", ".join(f"{_mesh_dim_label(mesh, m)}={c}" for m, c in zip(ms, coord))
                out.append(
                    f"{format_placements(pl)} splits tensor dim {d} of size {size} over {over}, leaving the rank at "
                    f"{at} an empty piece: a plan may not leave a rank without data (uneven but non-empty pieces are "
                    f"fine); shard a larger tensor dim, use fewer ranks on that mesh dim, or Replicate()"
                )
                break
    return out


# -- resolution: the one place a plan is checked against a module and a mesh ---------------


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan bound to a module's names: what `shard_module` applies, in this order."""

    params: tuple[tuple[str, tuple[Placement, ...], ShardOrder], ...]  # parameter name, placements, split order
    sharders: tuple[tuple[str, Sharder], ...]  # module path, sharder
    outputs: tuple[tuple[str, PlanEntry], ...]  # module path, output layout
    local: tuple[str, ...]  # module paths


def match(pattern: str, name: str) -> bool:
    """`name` matches `pattern` atom by atom (`blocks.*.q` matches `blocks.0.q`); `""` is the root."""
    if pattern == "" or name == "":
        return pattern == name
    pa, na = pattern.split("."), name.split(".")
    return len(pa) == len(na) and all(fnmatchcase(n, p) for p, n in zip(pa, na))


def _no_match(key: str, kind: str, candidates: Sequence[str], other: Sequence[str], other_hint: str, root: nn.Module) -> str:
    msg = f"{key!r} matches no {kind} of {type(root).__name__}"
    if any(match(key, n) for n in other):
        return f"{msg}: it names a {other_hint}"
    close = difflib.get_close_matches(key, [c for c in candidates if c], n=3)
    return msg + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else "")


def resolve(plan: ShardingPlan, module: nn.Module, mesh: AbstractMesh) -> ResolvedPlan:
    """Bind `plan` to `module` and check it against the mesh shape; ValueError listing every problem."""
    for what, given, kind, hint in (("plan", plan, ShardingPlan, "e.g. ShardingPlan({'fc': ColwiseParallel()})"),
                                    ("module", module, nn.Module, "the model to shard"),
                                    ("mesh", mesh, AbstractMesh, "a DeviceMesh or e.g. AbstractMesh((2,), ('tp',))")):
        if not isinstance(given, kind):
            raise TypeError(f"{what} must be a {kind.__name__}, got {describe(given)}: pass {hint}")
    problems: list[str] = []
    modules = dict(module.named_modules())
    params = dict(module.named_parameters(remove_duplicate=False))
    claims: dict[int, list[tuple[str, str, tuple[Placement, ...], ShardOrder]]] = {}
    param_out: list[tuple[str, tuple[Placement, ...], ShardOrder]] = []
    sharder_out: list[tuple[str, Sharder]] = []

    def claim(name: str, source: str, p: torch.Tensor, layout: PlanEntry) -> Optional[tuple[tuple[Placement, ...], ShardOrder]]:
        try:
            lay = to_layout(layout, mesh, p.ndim)
            pl, order = lay.placements, lay.shard_order
        except (ValueError, TypeError) as exc:
            problems.append(f"{name} (shape {tuple(p.shape)}): {exc}")
            return None
        empty = _empty_pieces(p.shape, pl, order, mesh)
        problems.extend(f"{name} (shape {tuple(p.shape)}): {e}" for e in empty)
        claims.setdefault(id(p), []).append((name, source, pl, order))
        return None if empty else (pl, order)

    for key, value in plan.plan.items():
        if isinstance(value, Sharder):
            hits = [path for path in modules if match(key, path)]
            if not hits:
                problems.append(_no_match(key, "submodule", list(modules), list(params), "parameter: a Sharder applies "
                                          "to a module, so name the module or give the parameter a layout", module))
            for path in hits:
                sub, where = modules[path], path or "<root>"
                found = value.validate_at(path, sub, mesh)
                problems.extend(f"{where}: {msg}" for msg in found)
                if not found:
                    owned = dict(sub.named_parameters(remove_duplicate=False))
                    for attr, pl in value.param_layouts(sub, mesh).items():
                        if attr in owned:
                            claim(f"{path}.{attr}" if path else attr, f"{value!r} on {where}", owned[attr], tuple(pl))
                sharder_out.append((path, value))
        else:
            hits = [name for name in params if match(key, name)]
            if not hits:
                problems.append(_no_match(key, "parameter", list(params), list(modules), "module: a layout applies to "
                                          "one parameter, so name it (e.g. '<module>.weight') or give the module a "
                                          "Sharder such as ColwiseParallel()", module))
            for name in hits:
                got = claim(name, f"plan[{key!r}]", params[name], cast(PlanEntry, value))
                if got is not None:
                    param_out.append((name, *got))

    for entries in claims.values():
        if len({(pl, order) for _, _, pl, order in entries}) > 1:
            detail = "; ".join(f"{name} {format_placements(pl)} from {src}" for name, src, pl, _ in entries)
            problems.append(
                f"{entries[0][0]}: one parameter is given different layouts ({detail}): a tied or repeated "
                f"parameter is one tensor, so give it one layout"
            )

    outputs: list[tuple[str, PlanEntry]] = []
    for key, layout_like in (plan.output_plan or {}).items():
        layout = cast(PlanEntry, layout_like)
        hits = [path for path in modules if match(key, path)]
        if not hits:
            problems.append("output_plan: " + _no_match(key, "submodule", list(modules), [], "", module))
        problems.extend(f"output_plan[{key!r}]: {e}" for e in _output_layout_problems(layout, mesh))
        outputs.extend((path, layout) for path in hits)
    local: list[str] = []
    for key in plan.return_local_tensor or ():
        hits = [path for path in modules if match(key, path)]
        if not hits:
            problems.append("return_local_tensor: " + _no_match(key, "submodule", list(modules), [], "", module))
        local.extend(hits)

    if problems:
        raise ValueError(
            f"ShardingPlan for {type(module).__name__} on a mesh of shape {mesh.shape}"
            + (f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else "")
            + f" has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return ResolvedPlan(tuple(param_out), tuple(sharder_out), tuple(outputs), tuple(local))


def _output_layout_problems(layout: PlanEntry, mesh: AbstractMesh) -> list[str]:
    """What can be checked of an output layout before the output's rank is known."""
    if is_placements(layout):
        if len(layout) != mesh.ndim:
            return [f"{format_placements(layout)} has {len(layout)} placements but the mesh has {mesh.ndim} dims: give one per mesh dim"]
        return []
    try:
        to_layout(layout, mesh, len(layout))
    except ValueError as exc:
        return [str(exc)]
    return []
