"""Manual sharding: run code on each rank's local piece, then make DTensors of what it returns.

`enable_manual_sharding` hands out this rank's piece of a tensor as a plain tensor, for code
that does its own communication; `disable_manual_sharding` turns the pieces that code made
back into one global DTensor (torch_xla's pair of the same names). `shard_map` wraps a
function in that boundary, for every tensor in a pytree of arguments and results (JAX's
`shard_map`), and `psum` is the collective such a function usually needs.

Gradients follow JAX's convention, which is what makes the boundary exact whatever the
function mixes (split inputs with replicated ones, concatenated outputs with equal ones):

| boundary | mesh dim | forward | backward |
|---|---|---|---|
| input (enable) | named in the spec | this rank's piece | this rank's piece of the gradient |
| input (enable) | not named | the whole (replicated) | every rank's gradient summed: `Partial(sum)` |
| output (disable) | named in the spec | pieces concatenated | this rank's piece of the gradient |
| output (disable) | not named | one copy (a promise that all are equal) | the gradient / that dim's size |
| `psum` | the axis summed | all-reduce sum | all-reduce sum |

So a computation that is the same on every rank of a mesh dim gets exactly the
single-device gradient (n shares of 1/n), and one that is not gets the sum of its parts.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from .. import _comm as comm
from .._describe import describe
from .._layout import Layout, ShardOrder, contiguous_strides, local_shape_and_offset, split_orders
from .._mesh import DeviceMesh
from .._partition_spec import MeshAxis, PartitionSpecLike
from .._placement import Partial, Placement, Replicate
from .._tensor import DTensor, scale_grad, to_local
from ._mark import device_mesh_of, layout_of, replicated

__all__ = ["enable_manual_sharding", "disable_manual_sharding", "shard_map", "psum"]

# The mesh of the shard_map whose function is running (psum's default).
_SCOPE: contextvars.ContextVar[Optional[DeviceMesh]] = contextvars.ContextVar("shardwise_shard_map_mesh", default=None)


def _mesh_or_global(mesh: Any, what: str) -> DeviceMesh:
    if mesh is None:
        from . import _mesh as spmd_mesh  # the spmd Mesh module; imported late (it imports this package)

        getter = getattr(spmd_mesh, "get_global_mesh", None)
        try:
            mesh = getter() if getter is not None else None
        except (ValueError, RuntimeError, LookupError):
            mesh = None
        if mesh is None:
            raise ValueError(
                f"{what}: no mesh given and no global mesh set: pass mesh=, or call "
                f"shardwise.spmd.set_global_mesh(mesh) first"
            )
    return device_mesh_of(mesh, what)


def _to_manual(t: torch.Tensor, mesh: DeviceMesh, layout: Layout, what: str) -> torch.Tensor:
    """This rank's piece of `t` in `layout`; the gradient on unnamed mesh dims is summed."""
    placements, order = layout.placements, layout.shard_order
    if isinstance(t, DTensor):
        if t.device_mesh != mesh:
            raise ValueError(f"{what}: a DTensor on {t.device_mesh!r} was given for {mesh!r}: use one mesh")
        laid = t.redistribute(mesh, placements, shard_order=order)
    else:
        laid = replicated(t, mesh).redistribute(mesh, placements, shard_order=order)
    grads = tuple(
        Partial("sum") if isinstance(p, Replicate) and mesh.shape[m] > 1 else p for m, p in enumerate(placements)
    )
    # the split order kept (DTensor.to_local(grad_placements=) drops it)
    return to_local(laid, laid._spec.with_placements(grads, laid._spec.shard_order))


def _from_manual(t: torch.Tensor, mesh: DeviceMesh, layout: Layout, shape: Sequence[int]) -> DTensor:
    """The DTensor whose piece here is `t`; the gradient on unnamed mesh dims is shared out."""
    placements, order = layout.placements, layout.shard_order
    copies = math.prod(mesh.shape[m] for m, p in enumerate(placements) if isinstance(p, Replicate))
    if copies > 1 and t.requires_grad and torch.is_grad_enabled():
        t = scale_grad(t, 1.0 / copies)
    shape = tuple(shape)
    return DTensor.from_local(t, mesh, placements, shape=shape, stride=contiguous_strides(shape), shard_order=order)


def enable_manual_sharding(t: torch.Tensor, partition_spec: PartitionSpecLike, *, mesh: Any = None) -> torch.Tensor:
    """This rank's piece of `t` laid out by `partition_spec`, as a plain tensor (differentiable).

    `t` is a DTensor (redistributed first) or a plain tensor that is the same on every rank.
    Code on the piece issues its own collectives (`psum`, or DTensor.from_local/redistribute);
    `disable_manual_sharding` makes the result global again. `mesh=None` uses the global mesh.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"enable_manual_sharding takes a torch.Tensor, got {describe(t)}")
    dm = _mesh_or_global(mesh, "enable_manual_sharding")
    layout = layout_of(partition_spec, dm, t.ndim, "enable_manual_sharding")
    return _to_manual(t, dm, layout, "enable_manual_sharding")


def disable_manual_sharding(
    t: torch.Tensor, partition_spec: PartitionSpecLike, full_shape: Sequence[int], *, mesh: Any = None
) -> DTensor:
    """The global DTensor of shape `full_shape` whose piece on this rank is `t` (differentiable).

    Mesh dims named in `partition_spec` concatenate the ranks' pieces; on the others every
    rank must hold the same values (nothing checks it). `t` must have the piece's shape that
    the layout gives this rank (torch.chunk sizes). `mesh=None` uses the global mesh.
    """
    if isinstance(t, DTensor) or not isinstance(t, torch.Tensor):
        raise TypeError(f"disable_manual_sharding takes this rank's piece as a plain tensor, got {describe(t)}")
    dm = _mesh_or_global(mesh, "disable_manual_sharding")
    shape = tuple(int(s) for s in full_shape)
    layout = layout_of(partition_spec, dm, len(shape), "disable_manual_sharding")
    coordinate = dm.get_coordinate()
    if coordinate is None:
        raise ValueError(f"disable_manual_sharding: this rank is not in the mesh {dm!r}: call it on the mesh's ranks")
    want = local_shape_and_offset(shape, dm.shape, layout.placements, coordinate, layout.shard_order)[0]
    if tuple(t.shape) != want:
        raise ValueError(
            f"disable_manual_sharding: the piece at mesh coordinate {tuple(coordinate)} has shape {tuple(t.shape)}, "
            f"but full_shape {shape} laid out by {tuple(partition_spec)} gives it {want} (torch.chunk sizes)"
        )
    return _from_manual(t, dm, layout, shape)


# -- shard_map ----------------------------------------------------------------------

def _specs_for(tree: Any, specs: Any, what: str, of: str) -> list[Any]:
    try:
        return list(tree.flatten_up_to(specs))
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"shard_map: {what} does not match the structure of {of} ({exc}): give a partition spec for each "
            f"tensor, a list/tuple/dict of the same shape for each container and None for anything else; "
            f"in_specs has one entry per positional argument, so one argument takes in_specs=(spec,)"
        ) from None


Leaf = tuple[Any, Any, Any]  # (pytree key path, leaf, its spec)


def _leaves(tree_value: Any, specs: Any, what: str, of: str) -> tuple[list[Leaf], Any]:
    flat, tree = tree_flatten_with_path(tree_value)
    return [(path, x, s) for (path, x), s in zip(flat, _specs_for(tree, specs, what, of))], tree


def _layouts(leaves: list[Leaf], mesh: DeviceMesh, what: str) -> list[Optional[Layout]]:
    """Layout per leaf (None for non-tensors); every problem collected and raised at once."""
    problems: list[str] = []
    out: list[Optional[Layout]] = []
    for path, leaf, spec in leaves:
        where = f"{what}{keystr(path)}"
        out.append(None)
        if not isinstance(leaf, torch.Tensor):
            if spec is not None:
                kind = type(leaf).__name__
                problems.append(f"{where} is {spec!r}, but there is a {kind} there, not a tensor: use None")
        elif spec is None:
            problems.append(
                f"{where} is None for a tensor of shape {tuple(leaf.shape)}: give a partition spec (() = replicated)"
            )
        elif what == "out_specs" and isinstance(leaf, DTensor):
            problems.append(f"{where}: the function returned a DTensor; return this rank's piece as a plain tensor")
        elif isinstance(leaf, DTensor) and leaf.device_mesh != mesh:
            problems.append(f"{where}: a DTensor on {leaf.device_mesh!r}, not on the shard_map's mesh {mesh!r}")
        else:
            try:
                out[-1] = layout_of(spec, mesh, leaf.ndim, where, exact_length=False)
            except (ValueError, TypeError) as exc:
                problems.append(str(exc))
    if problems:
        listed = "\n".join(f"- {p}" for p in problems)
        raise ValueError(f"shard_map: {len(problems)} problem(s) with {what}:\n{listed}")
    return out


def _global_shapes(pieces: list[tuple[torch.Tensor, Layout]], mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Global shape of each output from every rank's piece: one small all-gather of the piece
    shapes when any output is split (pieces may be uneven, so sizes cannot be inferred locally)."""
    if not any(split_orders(lay.placements) for _, lay in pieces):
        return [tuple(t.shape) for t, _ in pieces]
    rows = comm.gather_over_mesh([s for t, _ in pieces for s in t.shape], mesh.get_all_groups(), mesh.shape)
    coords = list(itertools.product(*(range(n) for n in mesh.shape)))  # row-major, as gathered
    ranks = mesh.mesh.flatten().tolist()
    shapes: list[tuple[int, ...]] = []
    problems: list[str] = []
    start = 0
    for i, (t, lay) in enumerate(pieces):
        placements, order = lay.placements, lay.shard_order
        held = {c: tuple(r[start : start + t.ndim]) for c, r in zip(coords, rows)}
        start += t.ndim
        gshape = list(t.shape)
        for d, ms in split_orders(placements, order).items():
            # the pieces along d: every coordinate of the splitting mesh dims, the others at 0
            gshape[d] = sum(s[d] for c, s in held.items() if all(c[m] == 0 for m in range(mesh.ndim) if m not in ms))
        bad = []
        for r, c in zip(ranks, coords):
            want = local_shape_and_offset(gshape, mesh.shape, placements, c, order)[0]
            if held[c] != want:
                bad.append(f"rank {r} has {held[c]}, expected {want}")
        if bad:
            problems.append(f"output {i}: the pieces form no torch.chunk split (of {tuple(gshape)}): {'; '.join(bad)}")
        shapes.append(tuple(gshape))
    if problems:
        listed = "\n".join(f"- {p}" for p in problems)
        raise ValueError(f"shard_map: the function's outputs cannot be assembled:\n{listed}")
    return shapes


Fn = Callable[..., Any]


def shard_map(
    fn: Optional[Fn] = None, mesh: Any = None, in_specs: Any = None, out_specs: Any = None
) -> Union[Fn, Callable[[Fn], Fn]]:
    """`fn` run on each rank's local pieces, its results assembled into DTensors.

    `in_specs` has one entry per positional argument: a partition spec for a tensor (entries
    as in `mark_sharding`; a shorter spec leaves the trailing dims unsplit, `()` replicates),
    a list/tuple/dict of the same shape for a container, None for anything else. Each DTensor
    argument is redistributed to its spec, each plain tensor (the same on every rank) split by
    it, and `fn` gets the pieces as plain tensors. `out_specs` describes what `fn` returns the
    same way: on a mesh dim a spec names, the ranks' pieces are concatenated; on one it does
    not, they are promised equal and one copy is the result. Differentiable, with the
    gradient convention in the module docstring. `fn` may combine pieces across ranks with
    `psum`. Assembling a split output costs one small all-gather of piece shapes (pieces may
    be uneven). `mesh=None` uses the global mesh. Also a decorator:
    `@shard_map(mesh=mesh, in_specs=(("x", None),), out_specs=("x", None))`.
    """
    if fn is None:
        return lambda f: shard_map(f, mesh, in_specs, out_specs)
    if in_specs is None or out_specs is None:
        raise TypeError("shard_map needs in_specs= (one entry per positional argument) and out_specs=")
    if not callable(fn):
        raise TypeError(f"shard_map wraps a function, got {describe(fn)}")
    body = fn
    arg_specs = tuple(in_specs) if isinstance(in_specs, list) else in_specs

    @functools.wraps(body)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"a shard_map function takes positional arguments only (in_specs follow them): {list(kwargs)}")
        dm = _mesh_or_global(mesh, "shard_map")
        leaves, tree = _leaves(args, arg_specs, "in_specs", "the arguments")
        layouts = _layouts(leaves, dm, "in_specs")
        local = [x if lay is None else _to_manual(x, dm, lay, "shard_map") for (_, x, _), lay in zip(leaves, layouts)]
        token = _SCOPE.set(dm)
        try:
            result = body(*tree_unflatten(local, tree))
        finally:
            _SCOPE.reset(token)
        wanted = tuple(out_specs) if isinstance(result, tuple) and isinstance(out_specs, list) else out_specs
        leaves, tree = _leaves(result, wanted, "out_specs", "the function's outputs")
        layouts = _layouts(leaves, dm, "out_specs")
        shapes = iter(_global_shapes([(x, lay) for (_, x, _), lay in zip(leaves, layouts) if lay is not None], dm))
        outs = [x if lay is None else _from_manual(x, dm, lay, next(shapes)) for (_, x, _), lay in zip(leaves, layouts)]
        return tree_unflatten(outs, tree)

    return mapped


def psum(t: torch.Tensor, axis: Union[MeshAxis, tuple[MeshAxis, ...]], *, mesh: Any = None) -> torch.Tensor:
    """Sum `t` (a local piece) over the ranks along mesh dim(s) `axis`; every rank gets the sum.

    Differentiable as in JAX: the gradient is summed the same way. `mesh=None` uses the mesh
    of the enclosing `shard_map`, else the global mesh.
    """
    if mesh is None:
        mesh = _SCOPE.get()
    dm = _mesh_or_global(mesh, "psum")
    axes = axis if isinstance(axis, tuple) else (axis,)
    dims = {dm.mesh_dim_index(a) for a in axes}
    summed = tuple(Partial("sum") if m in dims else Replicate() for m in range(dm.ndim))
    shape = tuple(t.shape)
    partial = DTensor.from_local(t, dm, summed, shape=shape, stride=contiguous_strides(shape))
    return partial.redistribute(dm, [Replicate()] * dm.ndim).to_local(grad_placements=summed)
