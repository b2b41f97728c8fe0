"""Making DTensors: `from_local`, `distribute_tensor` and the factories."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union, cast

import torch
import torch.distributed as dist

from .. import _comm as comm
from .. import _rng
from .._describe import describe, refuse_torch
from .._layout import (
    ShardOrderLike,
    contiguous_strides,
    dense_strides_like,
    format_placements,
    global_shape_from_local,
    local_shape_and_offset,
    normalize_placements,
    normalize_shard_order,
)
from .._mesh import DeviceMesh, _find_mesh, get_current_mesh
from .._mesh import as_device_mesh
from .._placement import Partial, Placement, Replicate, Shard, _strided_shard, check_reduce_dtype
from .._spec import DTensorSpec, TensorMeta, _spec_from
from .._ops import neutral_term
from .._redistribute import scatter_routes
from . import _random
from ._traceable import from_local_node
from ._plans import empty_piece
from ._redistribute import redistribute_local
from ._wrap import DTensorBase, wrap

if TYPE_CHECKING:  # the class is defined above this module (its `from_local` calls this one)
    from ._dtensor import DTensor

__all__ = ["from_local", "distribute_tensor", "zeros", "ones", "empty", "full", "rand", "randn"]


def _resolve(
    device_mesh: Optional[DeviceMesh], placements: Optional[Sequence[Placement]], where: str
) -> tuple[DeviceMesh, Sequence[Placement]]:
    mesh = as_device_mesh(device_mesh if device_mesh is not None else get_current_mesh())
    if not isinstance(mesh, DeviceMesh):
        refuse_torch(mesh, where)
        raise TypeError(f"device_mesh must be a DeviceMesh, got {describe(mesh)}: build one with shardwise.init_device_mesh")
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    return mesh, placements


_MAX_DIMS = 16


_FIELDS = ("ndim", "dtype", "requires_grad", "placements", "stride", "device")


def _crc(value: Any) -> int:
    return zlib.crc32(repr(value).encode())


def _memory_order(local: torch.Tensor) -> Any:
    """The order of `local`'s dims in memory, outermost first; None when a dim of size 1 or 0
    makes it ambiguous (such a piece agrees with any order)."""
    if any(s < 2 for s in local.shape):
        return None
    return tuple(sorted(range(local.ndim), key=lambda d: (-local.stride()[d], d)))


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _checked_global_shape(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], order: Any) -> tuple[int, ...]:
    """Gather every rank's metadata; check the ranks agree on it (each disagreeing field named
    with every rank's value); infer the global shape and check the pieces fit it."""
    if local.ndim > _MAX_DIMS:
        raise ValueError(f"from_local(run_check=True) supports up to {_MAX_DIMS} dims, got {local.ndim}")
    memory = _memory_order(local)
    fields = {
        "ndim": local.ndim, "dtype": local.dtype, "requires_grad": local.requires_grad,
        "placements": (format_placements(placements), order), "stride": memory, "device": local.device.type,
    }
    mine = [local.ndim] + [_crc(fields[f]) if f != "stride" or memory is not None else -1 for f in _FIELDS[1:]]
    mine += list(local.shape) + [-1] * (_MAX_DIMS - local.ndim)
    rows = comm.gather_over_mesh(mine, mesh.get_all_groups(), mesh.shape)
    coords = [tuple(c) for c in torch.cartesian_prod(*[torch.arange(s) for s in mesh.shape]).view(-1, mesh.ndim).tolist()]
    ranks = mesh.mesh.flatten().tolist()
    problems = []
    for i, name in enumerate(_FIELDS):
        groups: dict[int, list[int]] = {}
        for r, row in zip(ranks, rows):
            if not (name == "stride" and row[i] == -1):  # a piece with a dim of size < 2 fits any order
                groups.setdefault(row[i], []).append(r)
        if len(groups) > 1:
            most = max(groups.values(), key=len)
            odd = sorted(r for g in groups.values() if g is not most for r in g)
            problems.append(
                f"{name}: {_ranks(odd)} differ{'s' if len(odd) == 1 else ''} from {_ranks(most)} "
                f"(rank {dist.get_rank()} has {fields[name]})"
            )
    if problems:
        raise ValueError(
            "from_local(run_check=True): ranks disagree on the local tensor's metadata, which every rank of a DTensor "
            "must share (pass the same placements and pieces of one dtype, layout and requires_grad):\n- "
            + "\n- ".join(problems)
        )
    shapes = {c: tuple(r[len(_FIELDS) : len(_FIELDS) + r[0]]) for c, r in zip(coords, rows)}
    listing = "; ".join(f"rank {r}: {tuple(s)}" for r, s in zip(ranks, shapes.values()))
    origin = (0,) * mesh.ndim
    gshape = list(shapes[origin])
    for d in range(local.ndim):
        splitters = [m for m, p in enumerate(placements) if p.is_shard(d)]
        if not splitters:
            continue
        total = 0
        for c in coords:
            if all(c[m] == 0 for m in range(mesh.ndim) if m not in splitters):
                total += shapes[c][d]
        gshape[d] = total
    bad = [
        (r, shapes[c], local_shape_and_offset(gshape, mesh.shape, placements, c, order)[0])
        for r, c in zip(ranks, coords)
        if local_shape_and_offset(gshape, mesh.shape, placements, c, order)[0] != shapes[c]
    ]
    if bad:
        detail = "; ".join(f"rank {r} has {s}, expected {e}" for r, s, e in bad)
        raise ValueError(
            f"from_local: local shapes do not form a {format_placements(placements)} layout of any global shape "
            f"(inferred {tuple(gshape)}): {detail}. All local shapes: {listing}. Pieces follow torch.chunk sizes; "
            f"pass shape= and stride= for other splits"
        )
    return tuple(gshape)


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: Optional[DeviceMesh] = None,
    placements: Optional[Sequence[Placement]] = None,
    *,
    run_check: bool = False,
    shape: Optional[Sequence[int]] = None,
    stride: Optional[Sequence[int]] = None,
    shard_order: ShardOrderLike = None,
) -> DTensor:
    """A DTensor from each rank's piece (differentiable).

    Without `shape`, the global shape assumes equal pieces (`local * mesh size` on sharded
    dims); with `run_check=True` it is inferred from every rank's actual shape (uneven pieces
    allowed), the pieces are checked to form the layout, and Replicate dims are broadcast
    from the first rank so they truly agree.
    """
    if type(local_tensor) is not torch.Tensor:
        refuse_torch(local_tensor, "from_local(local_tensor=...)")
    if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensorBase):
        raise TypeError(f"from_local takes a plain torch.Tensor, got {describe(local_tensor)}")
    mesh, placements = _resolve(device_mesh, placements, "from_local(device_mesh=...)")
    pl = normalize_placements(placements, mesh.ndim, local_tensor.ndim)
    check_reduce_dtype(pl, local_tensor.dtype, "from_local")
    order = normalize_shard_order(pl, shard_order, local_tensor.ndim)
    if (shape is None) != (stride is None):
        raise ValueError(f"from_local got shape={shape} and stride={stride}: pass both or neither")
    outside = mesh.get_coordinate() is None
    if shape is not None:
        gshape, gstride = tuple(shape), tuple(stride)  # type: ignore[arg-type]
    elif run_check and not outside:
        gshape = _checked_global_shape(local_tensor, mesh, pl, order)
        gstride = dense_strides_like(gshape, local_tensor.stride())
    else:
        # the global tensor is laid out in memory as the piece is (a transposed piece, a
        # transposed whole): torch's rule of scaling the local strides, for dense pieces
        gshape = global_shape_from_local(local_tensor.shape, mesh.shape, pl)
        gstride = dense_strides_like(gshape, local_tensor.stride())
    if run_check and not outside:
        for i, p in enumerate(pl):
            if isinstance(p, Replicate) and mesh.shape[i] > 1:
                with torch.no_grad():
                    synced = comm.broadcast(local_tensor.detach().clone(), mesh.get_group(i), mesh.shape[i], mesh.ranks_along(i)[0])
                local_tensor = local_tensor + (synced - local_tensor).detach() if local_tensor.requires_grad else synced
    spec = DTensorSpec(mesh, pl, TensorMeta(torch.Size(gshape), gstride, local_tensor.dtype), order)
    return from_local_node(local_tensor, spec)  # type: ignore[no-any-return]


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: Optional[DeviceMesh] = None,
    placements: Optional[Sequence[Placement]] = None,
    *,
    src_data_rank: Optional[int] = 0,
    shard_order: ShardOrderLike = None,
) -> DTensor:
    """Split a full tensor over the mesh by `placements` (default: replicate).

    The data of the mesh's `src_data_rank`-th rank (row-major; default its first) is used:
    that rank sends every other rank its piece, in one all_to_all (each rank receives its
    piece only, as a scatter would); with `src_data_rank=None` every rank takes its piece
    from its own copy, with no communication.
    The result is a leaf with the input's `requires_grad`.
    """
    if type(tensor) is not torch.Tensor:
        refuse_torch(tensor, "distribute_tensor(tensor=...)")
    mesh, placements = _resolve(device_mesh, placements, "distribute_tensor(device_mesh=...)")
    if isinstance(tensor, DTensorBase):
        given = cast("DTensor", tensor)
        if given.device_mesh != mesh:
            raise ValueError(f"distribute_tensor got a DTensor on {given.device_mesh!r}, not on {mesh!r}: a DTensor "
                             f"is distributed already; move it with redistribute(device_mesh=...)")
        wanted = normalize_placements(placements, mesh.ndim, given.ndim)
        if wanted != given.placements or normalize_shard_order(wanted, shard_order, given.ndim) != given.shard_order:
            raise ValueError(
                f"distribute_tensor got a DTensor laid out {given._spec.layout_str()}, not {format_placements(wanted)}: "
                f"a DTensor is distributed already; use given.redistribute(mesh, placements) to change its layout"
            )
        return given
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor takes a torch.Tensor, got {describe(tensor)}")
    if tensor.requires_grad and tensor.grad_fn is not None:
        raise ValueError(
            f"distribute_tensor takes a leaf tensor (it returns a new leaf, so the gradient would never reach "
            f"this one, made by {type(tensor.grad_fn).__name__}): distribute the leaf it comes from, or keep the "
            f"graph with DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)"
        )
    pl = normalize_placements(placements, mesh.ndim, tensor.ndim)
    check_reduce_dtype(pl, tensor.dtype, "distribute_tensor")
    order = normalize_shard_order(pl, shard_order, tensor.ndim)
    full = tensor.detach()
    meta = TensorMeta(tensor.shape, contiguous_strides(tensor.shape), tensor.dtype)
    target = DTensorSpec(mesh, pl, meta, order)
    if mesh.get_coordinate() is None:  # a rank outside the mesh holds nothing (torch's rule)
        return rebuild(empty_piece(meta, tensor.device), target, tensor.requires_grad)
    if src_data_rank is not None:
        if not 0 <= src_data_rank < mesh.size():
            raise ValueError(
                f"src_data_rank={src_data_rank} is not a position in the mesh of {mesh.size()} ranks: "
                f"use an index in [0, {mesh.size() - 1}] (row-major over {mesh.mesh.tolist()}) or None"
            )
        src_coord = tuple(int(c) for c in torch.unravel_index(torch.tensor(src_data_rank, device="cpu"), mesh.shape))
        local = _scatter(full, target, src_coord)
        if local is None:  # a layout split part by part, or a sub-mesh without one group: broadcast first
            full = full.clone()
            for i in reversed(range(mesh.ndim)):
                if mesh.shape[i] > 1:
                    full = comm.broadcast(full, mesh.get_group(i), mesh.shape[i], mesh.ranks_along(i)[src_coord[i]])
    if src_data_rank is None or local is None:
        replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta)
        local = redistribute_local(full, replicated, target)
        if local.numel() < full.numel() or local.data_ptr() == tensor.data_ptr():
            local = local.clone()
    return rebuild(local, target, tensor.requires_grad)


def _scatter(full: torch.Tensor, target: DTensorSpec, src: tuple[int, ...]) -> Optional[torch.Tensor]:
    """This rank's piece of `target`, sent from the rank at mesh coordinate `src` (which holds
    `full`) in one all_to_all over the mesh: every rank receives its piece and nothing more (a
    broadcast would give every rank the whole). None where it cannot: a `_StridedShard`
    layout, or a mesh of several dims without a group over all its ranks (a sub-mesh)."""
    mesh = cast(DeviceMesh, target.mesh)
    if mesh.size() == 1 or any(not isinstance(p, (Shard, Replicate, Partial)) for p in target.placements):
        return None
    if mesh.ndim == 1:
        group, positions = mesh.get_group(0), tuple(range(mesh.size()))
    else:
        found = mesh.get_mesh_group()
        if found is None:
            return None
        group, positions = found
    unreduced = target.with_placements(tuple(Replicate() if isinstance(p, Partial) else p for p in target.placements),
                                       target.shard_order)
    splits = unreduced.split_orders()
    orders = tuple(splits.get(d, ()) for d in range(unreduced.ndim))
    coordinate = tuple(mesh.get_coordinate() or ())
    routes = scatter_routes(tuple(mesh.shape), tuple(full.shape), orders, src, coordinate)
    record = comm.AllToAllBoxes(
        group=group, size=mesh.size(), shape=tuple(full.shape), dtype=full.dtype, out_shape=routes.out_shape,
        sends=tuple((positions[p], box) for p, box in routes.sends),
        recvs=tuple((positions[p], box) for p, box in routes.recvs),
        keep=routes.keep, mesh_dims=tuple(range(mesh.ndim)),
    )
    piece = comm.run(record, full)
    return redistribute_local(piece, unreduced, target)  # later terms of a Partial: zeros


def rebuild(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """A leaf DTensor of this piece and layout (made by `distribute_tensor`, the factories, and
    `torch.load` of a pickled one: `DTensor.__reduce_ex__`). One that requires grad gets its
    gradient in its own layout, as `requires_grad_()` arranges."""
    out = wrap(local, spec)
    return out.requires_grad_() if requires_grad else out  # type: ignore[no-any-return]


# `torch.load` (weights only, torch's default) may rebuild DTensors: these are the only callables
# their pickles name, and each only looks values up or builds frozen records.
torch.serialization.add_safe_globals(
    [rebuild, _spec_from, _find_mesh, Shard, Replicate, Partial, _strided_shard])


# -- factories ---------------------------------------------------------------------

def _factory(
    make: Callable[[tuple[int, ...], tuple[int, ...], TensorMeta, DeviceMesh], torch.Tensor],
    size: tuple[Any, ...],
    dtype: Optional[torch.dtype],
    requires_grad: bool,
    device_mesh: Optional[DeviceMesh],
    placements: Optional[Sequence[Placement]],
    shard_order: ShardOrderLike,
    zero_partials: bool = True,
) -> DTensor:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise ValueError(f"size {size} must be non-negative ints")
    mesh, placements = _resolve(device_mesh, placements, "zeros/ones/empty/full/rand/randn(device_mesh=...)")
    shape = tuple(size)
    pl = normalize_placements(placements, mesh.ndim, len(shape))
    order = normalize_shard_order(pl, shard_order, len(shape))
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype or torch.get_default_dtype())
    spec = DTensorSpec(mesh, pl, meta, order)
    found = mesh.get_coordinate()
    if found is None:  # a rank outside the mesh holds nothing (torch's rule)
        return rebuild(empty_piece(meta, mesh.device_type), spec, requires_grad)
    coordinate = tuple(found)
    local_shape, offset = spec.local_shape_and_offset(coordinate)
    local = make(local_shape, offset, meta, mesh)
    term = neutral_term(spec, coordinate) if zero_partials else None
    if term is not None:
        local = torch.full_like(local, term)
    return rebuild(local, spec, requires_grad)


_SizeArg = Union[int, Sequence[int]]


def zeros(*size: Any, dtype: Optional[torch.dtype] = None, requires_grad: bool = False,
          device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
          shard_order: ShardOrderLike = None) -> DTensor:
    """A DTensor of zeros; each rank allocates only its piece."""
    return _factory(lambda s, o, m, mesh: torch.zeros(s, dtype=m.dtype), size, dtype, requires_grad, device_mesh, placements, shard_order)


def ones(*size: Any, dtype: Optional[torch.dtype] = None, requires_grad: bool = False,
         device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
         shard_order: ShardOrderLike = None) -> DTensor:
    """A DTensor of ones; each rank allocates only its piece."""
    return _factory(lambda s, o, m, mesh: torch.ones(s, dtype=m.dtype), size, dtype, requires_grad, device_mesh, placements, shard_order)


def empty(*size: Any, dtype: Optional[torch.dtype] = None, requires_grad: bool = False,
          device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
          shard_order: ShardOrderLike = None) -> DTensor:
    """An uninitialized DTensor; each rank allocates only its piece."""
    return _factory(lambda s, o, m, mesh: torch.empty(s, dtype=m.dtype), size, dtype, requires_grad, device_mesh, placements, shard_order, zero_partials=False)


def full(size: Sequence[int], fill_value: Any, *, dtype: Optional[torch.dtype] = None, requires_grad: bool = False,
         device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
         shard_order: ShardOrderLike = None) -> DTensor:
    """A DTensor filled with `fill_value`; each rank allocates only its piece."""
    if not isinstance(size, (list, tuple, torch.Size)):
        raise TypeError(f"full(size, fill_value) takes the size as a list or tuple of ints, got {describe(size)}")
    return _factory(lambda s, o, m, mesh: torch.full(s, fill_value, dtype=m.dtype), (tuple(size),), dtype, requires_grad, device_mesh, placements, shard_order)


def rand(*size: Any, dtype: Optional[torch.dtype] = None, requires_grad: bool = False,
         device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
         shard_order: ShardOrderLike = None) -> DTensor:
    """Uniform [0, 1) DTensor; the same global values under every layout for one seed."""
    def make(s: tuple[int, ...], o: tuple[int, ...], m: TensorMeta, mesh: DeviceMesh) -> torch.Tensor:
        return _rng.uniform_local(s, o, m.shape, _random.next_seed(mesh), 0, m.dtype)
    return _factory(make, size, dtype, requires_grad, device_mesh, placements, shard_order)


def randn(*size: Any, dtype: Optional[torch.dtype] = None, requires_grad: bool = False,
          device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Placement]] = None,
          shard_order: ShardOrderLike = None) -> DTensor:
    """Standard normal DTensor; the same global values under every layout for one seed."""
    def make(s: tuple[int, ...], o: tuple[int, ...], m: TensorMeta, mesh: DeviceMesh) -> torch.Tensor:
        return _rng.normal_local(s, o, m.shape, _random.next_seed(mesh), 0, m.dtype)
    return _factory(make, size, dtype, requires_grad, device_mesh, placements, shard_order)
