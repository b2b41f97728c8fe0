"""`mark_sharding` and its kin: lay out a tensor, a parameter or a whole module by partition specs.

torch_xla's `mark_sharding` annotates a tensor in place and lets the compiler move data
later. Run eagerly, a new layout means moving data now, so here it returns the laid-out
`DTensor`: a plain tensor is split (every rank passes the same tensor, rank 0's data is
used, like `distribute_tensor`), a DTensor is redistributed. For an `nn.Parameter` the
work is done in place: the DTensor is swapped into the very Parameter object
(`torch.utils.swap_tensors`), so the module that owns it, and anything else holding it,
sees the sharded parameter; `mark_sharding(model.fc.weight, mesh, (None, "model"))` shards
`model.fc`. Do it before building the optimizer (its state is made from the parameters).

A mesh is a shardwise `DeviceMesh` or an spmd `Mesh` (anything with `to_device_mesh()`).

| call | plain tensor | DTensor | nn.Parameter |
|---|---|---|---|
| `mark_sharding` | new DTensor (leaf) | redistributed (differentiable) | same object, now a DTensor |
| `mark_sharding_with_gradients` | DTensor; whole gradient | DTensor; gradient in the new layout | as a tensor |
| `clear_sharding` | unchanged | full tensor (differentiable) | same object, now plain |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .._describe import describe
from .._layout import Layout, ShardOrder, contiguous_strides
from .._mesh import DeviceMesh
from .._partition_spec import PartitionSpecLike, to_placements
from .._placement import Placement, Replicate
from .._spec import DTensorSpec, TensorMeta
from .._tensor import DTensor, distribute_tensor, redistribute_local

__all__ = ["mark_sharding", "mark_sharding_with_gradients", "mark_sharding_module", "clear_sharding"]

# Keys of a tensor's __dict__ that belong to its kind (DTensor / Parameter), not to the user.
_OWN_KEYS = frozenset({"_local_tensor", "_spec", "_is_param"})


def device_mesh_of(mesh: object, what: str) -> DeviceMesh:
    """The DeviceMesh behind `mesh` (a DeviceMesh, or an spmd Mesh via `to_device_mesh()`)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    convert = getattr(mesh, "to_device_mesh", None)
    if callable(convert):
        dm = convert()
        if isinstance(dm, DeviceMesh):
            return dm
    raise TypeError(
        f"{what}: mesh must be a shardwise DeviceMesh or a shardwise.spmd Mesh, got {describe(mesh)}: "
        f"build one with shardwise.init_device_mesh(...) or shardwise.spmd.Mesh(...)"
    )


def layout_of(
    spec: PartitionSpecLike, mesh: DeviceMesh, ndim: int, what: str, *, exact_length: bool = True
) -> Layout:
    """The layout a partition spec names, errors prefixed with `what`."""
    try:
        return Layout(*to_placements(spec, mesh.shape, mesh.mesh_dim_names, ndim, exact_length=exact_length))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None


def replicated(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor (the same on every rank) as a replicated DTensor, differentiably: its
    gradient comes back whole on every rank."""
    shape = tuple(t.shape)
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, shape=shape, stride=contiguous_strides(shape))


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor (plain, DTensor or nn.Parameter), got {describe(t)}")
    return t


def _check_mesh(t: DTensor, mesh: DeviceMesh, what: str) -> None:
    if t.device_mesh != mesh:
        raise ValueError(
            f"{what}: the tensor is a DTensor on {t.device_mesh!r}, not on {mesh!r}: pass its own mesh, or "
            f"full_tensor() it and lay it out on the new mesh"
        )


def _laid_out(t: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], order: ShardOrder) -> DTensor:
    if isinstance(t, DTensor):
        _check_mesh(t, mesh, "mark_sharding")
        return t.redistribute(mesh, placements, shard_order=order)
    if t.requires_grad and t.grad_fn is not None:  # an activation: keep its graph
        return replicated(t, mesh).redistribute(mesh, placements, shard_order=order)
    return distribute_tensor(t, mesh, placements, shard_order=order)


def _swap_into(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """Make `param` (same object) hold `data`, keeping requires_grad and user attributes."""
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    for key, value in param.__dict__.items():
        if key not in _OWN_KEYS and key not in new.__dict__:
            new.__dict__[key] = value
    try:
        torch.utils.swap_tensors(param, new)  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        raise RuntimeError(
            f"could not change the parameter of shape {tuple(param.shape)} in place ({exc}): mark parameters "
            f"before anything else holds their storage (views, weak references), e.g. before building the optimizer"
        ) from exc
    return param


def mark_sharding(t: torch.Tensor, mesh: Any, partition_spec: PartitionSpecLike) -> DTensor:
    """Lay `t` out by `partition_spec`: one entry per tensor dim, each None (not split), a mesh
    dim (index or name), or a tuple of mesh dims (split by the first, each piece by the next).

    A plain tensor becomes a new DTensor (every rank must pass the same tensor; rank 0's data is
    used). A DTensor is redistributed. An `nn.Parameter` is changed in place and returned: the
    same object, now a DTensor parameter (requires_grad kept), so its module is sharded too.
    Like `distribute_tensor`, a plain leaf's result is a new leaf; a tensor with a graph (an
    activation that requires grad) keeps it, its gradient coming back whole on every rank
    (`mark_sharding_with_gradients` is the explicit form).

    >>> # mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    >>> # w = mark_sharding(model.fc.weight, mesh, (None, "model"))  # model.fc.weight is w
    """
    t = _check_tensor(t, "mark_sharding")
    dm = device_mesh_of(mesh, "mark_sharding")
    lay = layout_of(partition_spec, dm, t.ndim, "mark_sharding")
    placements, order = lay.placements, lay.shard_order
    if isinstance(t, nn.Parameter):
        if isinstance(t, DTensor) and t._spec.placements == placements and t._spec.shard_order == order:
            _check_mesh(t, dm, "mark_sharding")
            return t
        with torch.no_grad():
            laid = _laid_out(t, dm, placements, order)
        return _swap_into(t, laid)  # type: ignore[return-value]
    return _laid_out(t, dm, placements, order)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor back as a plain tensor (differentiable); an `nn.Parameter` DTensor is
    changed in place into a plain Parameter and returned. A plain tensor is returned as is."""
    t = _check_tensor(t, "clear_sharding")
    if not isinstance(t, DTensor):
        return t
    if isinstance(t, nn.Parameter):
        with torch.no_grad():
            full = t.full_tensor()
        return _swap_into(t, full)
    return t.full_tensor()


def mark_sharding_module(module: nn.Module, mesh: Any, partition_specs: Mapping[str, PartitionSpecLike]) -> nn.Module:
    """`mark_sharding` on several parameters of `module`, named as `module.named_parameters()`
    names them (`{"fc.weight": (None, "model"), "fc.bias": ("model",)}`), in place; returns
    `module`. Every name and spec is checked first, and all problems are raised together in one
    ValueError, before any parameter changes. Parameters it does not name stay as they are
    (a plain parameter mixed with DTensors in an op is an error there, so name them all or
    replicate the rest with `(None,) * ndim`).
    """
    dm = device_mesh_of(mesh, "mark_sharding_module")
    params = dict(module.named_parameters(remove_duplicate=False))
    problems: list[str] = []
    unknown = [name for name in partition_specs if name not in params]
    if unknown:
        known = ", ".join(params) or "none"
        problems.append(f"no parameter named {', '.join(map(repr, unknown))} (the module's parameters: {known})")
    chosen: dict[int, tuple[str, tuple[Placement, ...], ShardOrder]] = {}
    for name, spec in partition_specs.items():
        if name not in params:
            continue
        param = params[name]
        try:
            lay = layout_of(spec, dm, param.ndim, f"partition_specs[{name!r}]")
            placements, order = lay.placements, lay.shard_order
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
            continue
        other = chosen.setdefault(id(param), (name, placements, order))
        if other[1:] != (placements, order):
            problems.append(
                f"{other[0]!r} and {name!r} are one tied parameter given two layouts: give them the same partition spec"
            )
    if problems:
        raise ValueError(
            "mark_sharding_module found " + (f"{len(problems)} problems" if len(problems) > 1 else "a problem")
            + " (nothing was changed):\n" + "\n".join(f"- {p}" for p in problems)
        )
    for name, spec in partition_specs.items():
        mark_sharding(params[name], dm, spec)
    return module


class _MarkWithGradients(torch.autograd.Function):
    """Forward: the input in layout `target`. Backward: the gradient moved to `target` too (not
    back to the input's layout), then whole for a plain input."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, source: DTensorSpec, target: DTensorSpec) -> DTensor:
        ctx.target, ctx.plain = target, not isinstance(t, DTensor)
        local = t._local_tensor if isinstance(t, DTensor) else t
        out = redistribute_local(local, source, target)
        if out is local:
            out = out.view_as(out)
        return DTensor(out, target, requires_grad=t.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        target: DTensorSpec = ctx.target
        if not isinstance(grad, DTensor):  # a plain gradient: this rank's piece of the target layout
            grad = DTensor(grad, target, requires_grad=False)
        local = redistribute_local(grad._local_tensor, grad._spec, target)
        if ctx.plain:
            whole = target.with_placements((Replicate(),) * len(target.placements))
            return redistribute_local(local, target, whole), None, None
        return DTensor(local, target, requires_grad=False), None, None


def mark_sharding_with_gradients(t: torch.Tensor, mesh: Any, partition_spec: PartitionSpecLike) -> DTensor:
    """`t` laid out by `partition_spec`, differentiably, with its gradient given the same layout.

    Not in place (a parameter is treated as a tensor). For an activation in the middle of a
    model: the gradient flowing back through this point is moved into the marked layout and
    handed on in it (a plain `t` gets its gradient whole). Every rank must pass the same plain
    tensor; no data is sent in the forward pass.
    """
    t = _check_tensor(t, "mark_sharding_with_gradients")
    dm = device_mesh_of(mesh, "mark_sharding_with_gradients")
    lay = layout_of(partition_spec, dm, t.ndim, "mark_sharding_with_gradients")
    placements, order = lay.placements, lay.shard_order
    if isinstance(t, DTensor):
        _check_mesh(t, dm, "mark_sharding_with_gradients")
        source = t._spec
    else:
        shape = torch.Size(t.shape)
        source = DTensorSpec(dm, (Replicate(),) * dm.ndim, TensorMeta(shape, contiguous_strides(shape), t.dtype))
    target = source.with_placements(placements, order)
    return _MarkWithGradients.apply(t, source, target)  # type: ignore[no-untyped-call,no-any-return]
