"""Small helpers for writing strategy functions."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from .._layout import ShardOrder, split_orders
from .._placement import Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy

__all__ = [
    "canonical_order",
    "input_spec",
    "order_like",
    "renamed_order",
    "replicate",
    "current",
    "expand_to_mesh",
    "map_shard_dims",
    "normalize_dim",
    "normalize_dims",
    "replicated_strategy",
]


def input_spec(schema: OpSchema) -> DTensorSpec:
    """The spec of the op's first argument, which must be a DTensor."""
    spec = schema.args_schema[0]
    if not isinstance(spec, DTensorSpec):
        raise TypeError(f"{schema.op} expects a DTensor as its first argument, got {type(spec).__name__}")
    return spec


def canonical_order(order: Sequence[tuple[int, tuple[int, ...]]]) -> ShardOrder:
    """Only non-ascending split orders, sorted by tensor dim (the form `Layout` compares by)."""
    return tuple(sorted((d, tuple(ms)) for d, ms in order if list(ms) != sorted(ms)))


def order_like(placements: Sequence[Placement], spec: DTensorSpec) -> ShardOrder:
    """`spec`'s split order for the tensor dims `placements` splits over the same mesh dims."""
    splits = split_orders(placements)
    return canonical_order([(d, ms) for d, ms in spec.shard_order if sorted(splits.get(d, ())) == sorted(ms)])


def renamed_order(order: ShardOrder, dim_map: Mapping[int, int]) -> ShardOrder:
    return canonical_order([(dim_map[d], ms) for d, ms in order])


def replicate(mesh_ndim: int) -> Layout:
    return Layout((Replicate(),) * mesh_ndim)


def current(spec: DTensorSpec) -> Layout:
    """The layout a spec has now."""
    return Layout(spec.placements, spec.shard_order)


def normalize_dim(dim: int, ndim: int) -> int:
    """A tensor dim in [0, ndim) (0-dim tensors accept 0 and -1, like torch)."""
    return dim % max(ndim, 1)


def normalize_dims(dims: Optional[Sequence[int] | int], ndim: int) -> tuple[int, ...]:
    """Reduction dims, normalized; None or [] means every dim."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        return (normalize_dim(dims, ndim),)
    if len(dims) == 0:
        return tuple(range(ndim))
    return tuple(sorted({normalize_dim(d, ndim) for d in dims}))


def map_shard_dims(layout: Layout, dim_map: Callable[[int], Optional[int]]) -> Optional[Layout]:
    """Rename the tensor dims a layout shards (`dim_map(d)`); None if a sharded dim has no image."""
    out: list[Placement] = []
    for p in layout.placements:
        if isinstance(p, Shard):
            d = dim_map(p.dim)
            if d is None:
                return None
            out.append(Shard(d))
        else:
            out.append(p)
    order = []
    for d, ms in layout.shard_order:
        nd = dim_map(d)
        if nd is None:
            return None
        order.append((nd, ms))
    return Layout(tuple(out), tuple(sorted(order)))


def expand_to_mesh(
    mesh_ndim: int,
    options: Sequence[Sequence[Placement]],
    n_outputs: int = 1,
    shape_arg: Optional[int] = None,
) -> OpStrategy:
    """Strategies from per-mesh-dim options, combined over every mesh dim.

    Each option is one way to run the op along a single mesh dim: `n_outputs` output
    placements followed by one placement per DTensor input, e.g. for `mm` the option
    `(Shard(0), Shard(0), Replicate())` (rows of the output from rows of the left input).
    The all-Replicate option is always added. Every combination of options across the
    mesh dims becomes one `PlacementStrategy`.
    """
    width = len(options[0]) if options else n_outputs + 1
    opts = [tuple(o) for o in options]
    everything_replicated = (Replicate(),) * width
    if everything_replicated not in opts:
        opts.append(everything_replicated)
    strategies = []
    for combo in itertools.product(opts, repeat=mesh_ndim):
        cols = list(zip(*combo)) if combo else [()] * width
        layouts = [Layout(tuple(c)) for c in cols]
        outs = layouts[:n_outputs]
        out_specs = outs[0] if n_outputs == 1 else tuple(outs)
        strategies.append(PlacementStrategy(out_specs, tuple(layouts[n_outputs:]), shape_arg=shape_arg))
    return OpStrategy(strategies)


def replicated_strategy(schema_specs: Sequence[DTensorSpec], mesh_ndim: int, n_outputs: int = 1) -> OpStrategy:
    """Gather every input and run replicated: the one strategy when nothing better is known."""
    r = replicate(mesh_ndim)
    out = r if n_outputs == 1 else tuple([r] * n_outputs)
    return OpStrategy([PlacementStrategy(out, tuple(r for _ in schema_specs))])



