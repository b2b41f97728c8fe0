"""The kit for writing strategies by parameter name: `Args`, `Option`, `combine`.

`Args` finds the DTensor arguments of a call by parameter name (with their flat input
positions); an `Option` is one way to run the op along one mesh dim; `combine` makes the
strategies from per-mesh-dim options, like `expand_to_mesh` but by name and with
per-mesh-dim options, so a Partial is kept only where an input already has it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy

__all__ = ["Args", "Option", "broadcast_shards", "combine", "linear_partial"]

R = Replicate()
_LINEAR = ("sum", "avg")  # Partials a linear op keeps

# One way to run an op along one mesh dim: output placement(s) and the placement of some
# DTensor inputs by flat position (the rest: Replicate).
Option = tuple[tuple[Placement, ...], dict[int, Placement]]


class Args:
    """The DTensor arguments of one call by parameter name, with their flat input positions
    (the order of `schema.input_specs()`)."""

    def __init__(self, schema: OpSchema) -> None:
        self.schema = schema
        self.specs = schema.input_specs()
        self.mesh_ndim = self.specs[0].mesh.ndim
        self._pos: dict[str, int] = {}
        self._lists: dict[str, list[Optional[int]]] = {}
        names = [a.name for a in schema.op._schema.arguments]
        k = 0
        for name, value in list(zip(names, schema.args_schema)) + list(schema.kwargs_schema):
            if isinstance(value, DTensorSpec):
                self._pos[name] = k
                k += 1
            elif isinstance(value, tuple) and any(isinstance(x, DTensorSpec) for x in value):
                slots: list[Optional[int]] = []
                for x in value:
                    slots.append(k if isinstance(x, DTensorSpec) else None)
                    k += isinstance(x, DTensorSpec)
                self._lists[name] = slots

    @property
    def n(self) -> int:
        return len(self.specs)

    def names(self) -> list[str]:
        """Parameter names of the (non-list) DTensor arguments, in input order."""
        return list(self._pos)

    def pos(self, name: str) -> Optional[int]:
        return self._pos.get(name)

    def spec(self, name: str) -> Optional[DTensorSpec]:
        k = self._pos.get(name)
        return None if k is None else self.specs[k]

    def need(self, name: str) -> DTensorSpec:
        """The spec of a tensor argument the op cannot run without."""
        spec = self.spec(name)
        if spec is None:
            raise TypeError(f"{self.schema.op} expects a DTensor (or non-0-dim tensor) for {name!r}: {self.schema}")
        return spec

    def list_pos(self, name: str) -> list[Optional[int]]:
        return self._lists.get(name, [])

    def opt(self, outs: Sequence[Placement], ins: Mapping[str, Placement]) -> Option:
        """An option with input placements by parameter name (absent arguments are skipped)."""
        return tuple(outs), {self._pos[k]: p for k, p in ins.items() if k in self._pos}

    def partial(self, name: str, i: int) -> Optional[Partial]:
        """The Partial argument `name` has on mesh dim i, if any."""
        spec = self.spec(name)
        p = None if spec is None else spec.placements[i]
        return p if isinstance(p, Partial) else None

    def shape_only(self, name: str, i: int) -> Placement:
        """Placement for an argument read only for its shape, on a mesh dim where it is not
        split: its Partial as it is (no reduction needed), else Replicate."""
        return self.partial(name, i) or R


def combine(
    args: Args,
    per_dim: Sequence[Sequence[Option]],
    n_outputs: int = 1,
    free: Sequence[int] = (),
    shape_arg: Optional[int] = None,
) -> OpStrategy:
    """Every combination of per-mesh-dim options (all-Replicate is always added).

    `free` lists flat input positions the op does not read (their layout is left alone)."""
    rows: list[list[tuple[Placement, ...]]] = []
    for opts in per_dim:
        seen: dict[tuple[Placement, ...], None] = {}
        for placed, given in list(opts) + [((R,) * n_outputs, {})]:
            if len(placed) != n_outputs:
                raise ValueError(f"option {placed} gives {len(placed)} output placements, expected {n_outputs}")
            seen[tuple(placed) + tuple(given.get(k, R) for k in range(args.n))] = None
        rows.append(list(seen))
    strategies = []
    for combo in itertools.product(*rows):
        cols = [Layout(tuple(c)) for c in zip(*combo)]
        outs = cols[:n_outputs]
        ins: list[Optional[Layout]] = list(cols[n_outputs:])
        for k in free:
            ins[k] = None
        out_spec: Any = outs[0] if n_outputs == 1 else tuple(outs)
        strategies.append(PlacementStrategy(out_spec, tuple(ins), shape_arg=shape_arg))
    return OpStrategy(strategies)


def broadcast_shards(out_shape: Sequence[int], inputs: Mapping[str, Optional[DTensorSpec]], args: Args) -> list[Option]:
    """Elementwise ops with broadcasting: output dim `od` split, every input that has it at
    full size split alike, the others (broadcast there) Replicate."""
    options = []
    for od in range(len(out_shape)):
        ins: dict[str, Placement] = {}
        for name, spec in inputs.items():
            if spec is None:
                continue
            d = od - (len(out_shape) - spec.ndim)
            if d >= 0 and spec.shape[d] == out_shape[od]:
                ins[name] = Shard(d)
        if ins:
            options.append(args.opt((Shard(od),), ins))
    return options


def linear_partial(a: Args, name: str, i: int) -> Optional[Partial]:
    """The P(sum) / P(avg) argument `name` has on mesh dim i (what a linear op keeps), if any."""
    p = a.partial(name, i)
    return p if p is not None and p.reduce_op in _LINEAR else None
