"""Applying plans: `shard_module` (any `ShardingPlan`) and `parallelize_module` (tensor-parallel styles).

There is one mechanism. `parallelize_module`'s dict of module patterns -> styles is a
`ShardingPlan` like any other, so it gets the same all-at-once validation before any
communication and the same tied-weight handling. Applying goes: check the whole plan
(pure), place the parameters the plan names, run the sharders in plan order, replicate
the rest when asked, then hook outputs.

What is left out of the plan is the one difference between the two entry points:
`shard_module` replicates every parameter and buffer the plan does not mention (the whole
model then computes on DTensors), while `parallelize_module` leaves them as they are, plain
tensors, as `torch.distributed.tensor.parallel.parallelize_module` does: with torch's
styles (local outputs by default) the model between the parallelized layers runs on
plain local tensors, exactly as under torch. `replicate_rest=` chooses either way.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any, Optional, Union

import torch
from torch import nn

from .. import _comm as comm
from .._describe import describe, refuse_torch
from .._mesh import DeviceMesh, get_current_mesh
from .._mesh import as_device_mesh
from .._tensor import DTensor, check_plain_afresh, watch_plain_leaf
from ._distribute import Ties, distribute_module, place_parameter
from ._experts import experts_split_by_layout, run_own_experts
from ._grad_check import PlainGradientCheck
from ._pretrained import adopt_save_pretrained
from ._plan import PlanEntry, ResolvedPlan, Sharder, ShardingPlan, ShardingPlanner, resolve, to_layout
from ._style import ParallelStyle

__all__ = ["shard_module", "parallelize_module"]


def _mesh(device_mesh: Optional[DeviceMesh], what: str) -> DeviceMesh:
    mesh = as_device_mesh(device_mesh if device_mesh is not None else get_current_mesh())
    if not isinstance(mesh, DeviceMesh):
        refuse_torch(mesh, f"{what}(device_mesh=...)")
        raise TypeError(f"{what} needs a DeviceMesh, got {describe(mesh)}: build one with shardwise.init_device_mesh")
    return mesh


def _split(name: str) -> tuple[str, str]:
    path, _, attr = name.rpartition(".")
    return path, attr


def shard_module(
    module: nn.Module,
    plan: Union[ShardingPlan, ShardingPlanner],
    device_mesh: Optional[DeviceMesh] = None,
    *,
    src_data_rank: Optional[int] = 0,
    replicate_rest: bool = True,
) -> nn.Module:
    """Shard `module` in place by `plan` (or by the plan a `ShardingPlanner` builds for it); returns it.

    The whole plan is checked first against the module and the mesh shape, with no
    communication; every problem is raised in one ValueError. Then: parameters named in
    the plan are distributed to their layouts, each `Sharder` shards the submodules its
    pattern matches, every parameter and buffer still plain is replicated (as
    `distribute_module` does; `replicate_rest=False` leaves them plain), and `output_plan` /
    `return_local_tensor` hooks are installed. A tied parameter is distributed once and stays one parameter.
    An experts module whose stacked expert parameters the plan splits by whole experts
    (`Shard(0)` along one mesh dim) runs as under `ExpertParallel`.
    `src_data_rank` is the rank whose values are distributed (None: each rank's own).
    """
    mesh = _mesh(device_mesh, "shard_module")
    if isinstance(plan, ShardingPlanner):
        plan = plan.build_plan(module)
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"shard_module takes a ShardingPlan or a ShardingPlanner, got {type(plan).__name__}")
    resolved = resolve(plan, module, mesh)
    _agree_on(resolved, mesh)
    check_plain_afresh(mesh)  # a new model: its first step checks plain tensors meeting DTensors

    ties = Ties(module)
    for name, placements, order in resolved.params:
        path, attr = _split(name)
        place_parameter(
            module.get_submodule(path), attr, placements, mesh, shard_order=order, src_data_rank=src_data_rank, where=name
        )
        ties.retie()
    styled = {path for path, _ in resolved.sharders}
    laid_out = {name: placements for name, placements, _ in resolved.params}
    for path, mesh_dim in experts_split_by_layout(module, laid_out):
        if path not in styled:  # whole experts per rank: run them as ExpertParallel does
            run_own_experts(module.get_submodule(path), mesh, mesh_dim)
    for path, sharder in resolved.sharders:
        sub = module.get_submodule(path)
        new = sharder.shard(sub, mesh)
        if new is not sub:
            if not path:
                module = new
            else:
                parent, attr = _split(path)
                setattr(module.get_submodule(parent), attr, new)
        ties.retie()
    if replicate_rest:
        distribute_module(module, mesh)
    elif resolved.sharders:  # plain parameters beside parallel layers: checked at the first backward
        PlainGradientCheck.install(module, mesh)
        for p in module.parameters():  # a DTensor gradient they get (they count as replicated) is made plain
            if p.requires_grad and not isinstance(p, DTensor):
                watch_plain_leaf(p)

    for path, layout in resolved.outputs:
        module.get_submodule(path).register_forward_hook(_output_layout_hook(path, layout, mesh))
    for path in resolved.local:
        module.get_submodule(path).register_forward_hook(_local_output_hook(path))
    adopt_save_pretrained(module)  # a Hugging Face model's save_pretrained gathers its DTensors
    return module


def _agree_on(resolved: ResolvedPlan, mesh: DeviceMesh) -> None:
    """Raise on every rank when the ranks of `mesh` were given different plans (one all_gather of
    a digest): each would place and move its parameters its own way, and the first collective
    would mismatch (gloo aborts the process). A plan built on each rank from a time-limited
    search (AutoPlanner's layout solver) or from rank-local data can differ."""
    if mesh.size() == 1 or mesh.get_coordinate() is None:  # (a dry run agrees as a real run does)
        return
    sharders = [(path, repr(s) if is_dataclass(s) else type(s).__qualname__) for path, s in resolved.sharders]
    text = repr((resolved.params, sharders, resolved.outputs, resolved.local))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    rows = comm.gather_over_mesh([digest], mesh.get_all_groups(), mesh.shape)
    ranks = mesh.mesh.flatten().tolist()
    odd = [r for r, row in zip(ranks, rows) if row != rows[0]]
    if odd:
        raise ValueError(
            f"shard_module: the ranks of {mesh!r} were given different plans (rank(s) {odd} differ from rank "
            f"{ranks[0]}): every rank must apply the same plan. Build it from the same inputs on every rank (a "
            f"time-limited search such as AutoPlanner's layout solver can stop at different plans: give it more "
            f"time_limit), or build it on one rank and send it to the others"
        )


def _each_dtensor(out: Any, fn: Callable[[DTensor], Any], where: str) -> Any:
    if isinstance(out, DTensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_each_dtensor(o, fn, where) for o in out)
    if isinstance(out, torch.Tensor):
        raise TypeError(
            f"{where}: module returned a plain tensor, not a DTensor; output_plan and return_local_tensor apply "
            f"to distributed outputs (drop the module from them, or have its style return DTensors)"
        )
    return out


def _output_layout_hook(path: str, layout: PlanEntry, mesh: DeviceMesh) -> Callable[..., Any]:
    def move(t: DTensor) -> DTensor:
        lay = to_layout(layout, mesh, t.ndim)
        return t.redistribute(mesh, lay.placements, shard_order=lay.shard_order)

    return lambda _m, _args, out: _each_dtensor(out, move, f"output_plan[{path!r}]")


def _local_output_hook(path: str) -> Callable[..., Any]:
    return lambda _m, _args, out: _each_dtensor(out, lambda t: t.to_local(), f"return_local_tensor {path!r}")


def parallelize_module(
    module: nn.Module,
    device_mesh: Optional[DeviceMesh] = None,
    parallelize_plan: Union[ParallelStyle, Mapping[str, ParallelStyle], ShardingPlan, ShardingPlanner, None] = None,
    *,
    src_data_rank: Optional[int] = 0,
    replicate_rest: bool = False,
) -> nn.Module:
    """Apply tensor-parallel styles: one style to `module`, or a dict of module patterns -> styles.

    Patterns match module paths atom by atom (`"blocks.*.attn.q"`); `""` is `module` itself.
    `device_mesh` must be 1-D: on an n-D mesh pass the tensor-parallel sub-mesh
    (`mesh["tp"]`). The dict becomes a `ShardingPlan` and goes through `shard_module`, so
    every pattern that matches nothing and every style on a module it cannot shard is
    reported in one ValueError before any communication (torch warns and skips).
    Parameters and buffers of modules the plan does not mention stay plain tensors, as in
    torch (`replicate_rest=True` makes them replicated DTensors, as `shard_module` does).
    A `ShardingPlan` or `ShardingPlanner` (such as `HFPlanner()`, a Hugging Face model's own
    plan) is applied the same way.

    At the end of the first backward pass, the plain parameters' gradients are compared across
    the mesh (one small all_gather): a module left plain that runs on this rank's share of the
    activations gets a partial gradient on each rank, and that is an error naming it and the
    fix (`ReplicateParallel`), not a silent drift.
    """
    mesh = _mesh(device_mesh, "parallelize_module")
    if mesh.ndim != 1 and not _spans_mesh_dims(parallelize_plan):
        names = f" with dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        raise ValueError(
            f"parallelize_module takes a 1-D mesh, got shape {mesh.shape}{names}: pass the tensor-parallel "
            f"sub-mesh, e.g. mesh['tp']"
        )
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan: nothing to do", stacklevel=2)
        return module
    if isinstance(parallelize_plan, ShardingPlanner):
        parallelize_plan = parallelize_plan.build_plan(module)
    if isinstance(parallelize_plan, ShardingPlan):
        return shard_module(module, parallelize_plan, mesh, src_data_rank=src_data_rank, replicate_rest=replicate_rest)
    if isinstance(parallelize_plan, Sharder):
        styles: dict[str, Sharder] = {"": parallelize_plan}
    elif isinstance(parallelize_plan, Mapping):
        styles = dict(parallelize_plan)
        bad = [f"{k!r}: {describe(v)}" for k, v in styles.items() if not isinstance(v, Sharder)]
        if bad:
            raise TypeError(f"parallelize_plan maps module patterns to ParallelStyles; these are not: {', '.join(bad)}")
    else:
        refuse_torch(parallelize_plan, "parallelize_module(parallelize_plan=...)")
        raise TypeError(
            f"parallelize_plan must be a ParallelStyle or a dict of module patterns -> ParallelStyle, "
            f"got {describe(parallelize_plan)}"
        )
    styles = {k: _with_src(v, src_data_rank) for k, v in styles.items()}
    return shard_module(module, ShardingPlan(styles), mesh, src_data_rank=src_data_rank, replicate_rest=replicate_rest)


def _spans_mesh_dims(plan: Any) -> bool:
    """Whether every style of `plan` reads an n-D mesh as a whole (expert parallelism by token
    dispatch with tokens said per mesh dim), so an n-D mesh is no mistake for a tp sub-mesh."""
    styles = list(plan.values()) if isinstance(plan, Mapping) else [plan]
    return bool(styles) and all(getattr(s, "spans_mesh_dims", False) for s in styles)


def _with_src(style: Sharder, src_data_rank: Optional[int]) -> Sharder:
    """The style with `src_data_rank` set (a new value; styles are frozen), if it has that field."""
    value: Any = style
    names = {f.name for f in fields(value)} if is_dataclass(value) and not isinstance(value, type) else set()
    if "src_data_rank" in names and value.src_data_rank != src_data_rank:
        new: Sharder = replace(value, src_data_rank=src_data_rank)
        return new
    return style
