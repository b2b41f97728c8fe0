"""`fully_shard`: torch's FSDP2 entry point, on shardwise DTensors and units.

Call it bottom-up (each block, then the model): every call makes one unit of the
parameters under its module(s) that no earlier call took, stores each as a DTensor
sharded on the mesh (no communication), swaps the module's class for `FSDP<Orig>` and
hooks its forward. A 1-D mesh shards (`(Shard(0),)`); a 2-D mesh replicates over its
first dim and shards over its second (HSDP, `(Replicate(), Shard(0))`). Parameters that
tensor parallelism made DTensors on a sibling sub-mesh keep their tp placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .._describe import describe
from .._mesh import DeviceMesh, init_device_mesh
from .._mesh import DryMesh, as_device_mesh
from .._placement import Shard
from .._tensor import eager_hook
from ._module import fsdp_class
from ._param import UnitParam, place, register
from ._policy import MixedPrecisionPolicy, OffloadPolicy
from ._state import STATE_ATTR, FSDPState, state_of
from ._unit import Unit

__all__ = ["fully_shard"]


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
) -> Any:
    """Shard `module`'s parameters over `mesh` as one unit, in place; returns `module`.

    `reshard_after_forward`: True frees the gathered parameters after forward and gathers
    them again in backward; False keeps them until the end of backward; None (default) is
    True for every module but the root (the first whose forward runs), False for the root;
    an int k (1 < k < the shard dim's size, dividing it) keeps each rank's 1/k piece after
    forward, so backward gathers over groups of k consecutive ranks only. `shard_placement_fn(param)` may return
    a `Shard(dim)` to shard another tensor dim (None: dim 0). `ignored_params` stay as they
    are: not sharded, not reduced.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    where = "fully_shard"
    if not modules:
        raise ValueError("fully_shard([]): give at least one module")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{where}: module{f'[{i}]' if len(modules) > 1 else ''} must be an nn.Module, got {describe(m)}")
        if state_of(m) is not None:
            raise ValueError(
                f"{where}: {type(m).__name__} is already in a unit (fully_shard was called on it): call fully_shard "
                f"once per module, bottom-up (each block, then the model)"
            )
    mesh = _the_mesh(mesh)
    reshard, auto = _check_reshard(reshard_after_forward, mesh)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{where}(mp_policy=...): a MixedPrecisionPolicy, got {describe(mp_policy)}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"{where}(offload_policy=...): an OffloadPolicy or CPUOffloadPolicy, got {describe(offload_policy)}")
    ignored = {id(p) for p in (ignored_params or ())}
    shard_dim = mesh.ndim - 1
    params, problems = _take(modules, mesh, shard_dim, shard_placement_fn, ignored)
    if problems:
        raise ValueError(f"{where} cannot shard these parameters:\n  - " + "\n  - ".join(problems))
    name = type(modules[0]).__name__
    unit = Unit(name, params, mesh, shard_dim, 0 if mesh.ndim == 2 else None, mp_policy, offload_policy) if params else None
    if unit is not None and not isinstance(reshard, bool):
        unit.small = _small_group(mesh, shard_dim, reshard)
    attach(FSDPState(modules, unit, mp_policy, reshard, auto), modules)
    return module


def attach(state: FSDPState, modules: list[nn.Module], swap_class: bool = True) -> None:
    """Hook `state` around each module's forward (and make its class `FSDP<Orig>`)."""
    for m in modules:
        object.__setattr__(m, STATE_ATTR, state)
        # eager under torch.compile: they swap parameters and gather (`eager_hook`)
        state.handles.append(m.register_forward_pre_hook(eager_hook(state.pre_forward), prepend=True, with_kwargs=True))
        state.handles.append(m.register_forward_hook(eager_hook(state.post_forward), always_call=True))
        if swap_class:
            m.__class__ = fsdp_class(type(m))


def _the_mesh(mesh: Optional[DeviceMesh]) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            raise ValueError("fully_shard(mesh=None) needs torch.distributed initialised (torchrun), or pass mesh=")
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),))
    mesh = as_device_mesh(mesh)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(mesh=...): a shardwise DeviceMesh, got {describe(mesh)}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard(mesh={mesh!r}): a 1-D mesh (shard) or a 2-D mesh (replicate, shard) for HSDP, got "
            f"{mesh.ndim} dims: pass the data-parallel sub-mesh, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard: this rank is not part of {mesh!r}: build the mesh over the ranks that train")
    return mesh


def _small_group(mesh: DeviceMesh, shard_dim: int, k: int) -> tuple[Any, int, int]:
    """The group of `k` consecutive ranks of the shard dim this rank is in (made over the whole
    mesh this one was sliced from, so every rank makes the same groups)."""
    if isinstance(mesh, DryMesh):  # a dry run: the same split of the whole dry mesh's grid
        d = mesh._dims[shard_dim]
        shape = list(mesh._root[0])
        shape[d:d + 1] = [shape[d] // k, k]
        dry = DryMesh(tuple(shape))
        return dry.get_group(d + 1), k, dry.get_local_rank(d + 1)
    root, dims = mesh._sliced_from or (mesh, tuple(range(mesh.ndim)))
    d = dims[shard_dim]
    grid = root.mesh
    shape = list(grid.shape)
    shape[d:d + 1] = [shape[d] // k, k]
    small = DeviceMesh(root.device_type, grid.reshape(shape))
    return small.get_group(d + 1), k, small.get_local_rank(d + 1)


def _check_reshard(value: Optional[Union[bool, int]], mesh: DeviceMesh) -> tuple[Union[bool, int], bool]:
    if value is None:
        return True, True
    if isinstance(value, bool):
        return value, False
    if isinstance(value, int):
        n = mesh.size(mesh.ndim - 1)
        if not (1 < value < n and n % value == 0):
            raise ValueError(
                f"fully_shard(reshard_after_forward={value}): an int must be a divisor of the shard dim's size {n} "
                f"other than 1 and {n} (the group to reshard to after forward); use True or False otherwise"
            )
        return value, False
    raise TypeError(f"fully_shard(reshard_after_forward={value!r}): True, False, None or an int")


def _take(modules: list[nn.Module], mesh: DeviceMesh, shard_dim: int,
          shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]], ignored: set[int]
          ) -> tuple[list[UnitParam], list[str]]:
    """Shard every parameter under `modules` that no unit below took and is not ignored."""
    owners: dict[int, tuple[str, torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for m in modules:
        for prefix, owner in _unclaimed(m):
            for attr, found in owner._parameters.items():
                if found is None or id(found) in ignored:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                owners.setdefault(id(found), (name, found, []))[2].append((owner, attr))
    params: list[UnitParam] = []
    placed: list[tuple[UnitParam, nn.Parameter]] = []
    problems: list[str] = []
    for name, p, where in owners.values():
        taken = getattr(p, _TAKEN, None)
        if taken is not None:  # shared with a module an earlier call took: it would be trained twice, untied
            problems.append(
                f"{name} is the parameter {taken} that an earlier fully_shard call took (a tied weight): each unit "
                f"would shard its own copy and the two would drift apart. Give the modules that share it to one "
                f"fully_shard call (a list of modules), or leave both to their parent's call"
            )
            continue
        placement = shard_placement_fn(p) if shard_placement_fn is not None else None  # type: ignore[arg-type]
        if placement is None:
            placement = Shard(0)
        if not isinstance(placement, Shard):
            problems.append(f"{name}: shard_placement_fn returned {placement!r}: return a Shard(dim) or None")
            continue
        if not -max(p.ndim, 1) <= placement.dim < max(p.ndim, 1):
            problems.append(f"{name}: shard_placement_fn returned {placement} for a {p.ndim}-D parameter: use a dim "
                            f"in [{-p.ndim}, {p.ndim - 1}]")
            continue
        made = place(name, p, mesh, shard_dim, placement, where)
        if isinstance(made, str):
            problems.append(made)
        else:
            placed.append(made)
    if not problems:  # nothing changes unless every parameter can be sharded
        for unit_param, stored in placed:
            register(unit_param, stored)
            params.append(unit_param)
        for name, p, _ in owners.values():
            setattr(p, _TAKEN, f"{type(modules[0]).__name__}.{name}")
    return params, problems


_TAKEN = "_shardwise_fsdp_taken"  # set on a parameter fully_shard replaced: where it went


def _unclaimed(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """`module` and its submodules, without those under a module already given to fully_shard."""
    out: list[tuple[str, nn.Module]] = []
    todo: list[tuple[str, nn.Module]] = [("", module)]
    while todo:
        prefix, m = todo.pop()
        out.append((prefix, m))
        for child_name, child in reversed(list(m.named_children())):
            if state_of(child) is None:
                todo.append((f"{prefix}.{child_name}" if prefix else child_name, child))
    return out
