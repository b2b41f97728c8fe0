"""Tensor-parallel pipeline stages: each stage's layers sharded over its tp sub-mesh.

On a (pp, tp) or (pp, dp, tp) mesh, the ranks of one stage (one pp index) with the same dp
index form that stage's tp sub-mesh, and `tp_plan` (module patterns of the whole model ->
ParallelStyles, as `parallelize_module` takes) shards each stage's layers over it: a
stage takes the entries that name its layers. Activations and gradients then cross stage
boundaries as DTensors: each tp rank sends its piece to the rank of the next stage with
the same (dp, tp) coordinate, which holds the same piece of the same layout there (see
`_wire`), so nothing is gathered. Data parallel averages each parameter's piece with the
same piece of the other replicas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from torch import nn

from .._describe import describe
from .._mesh import DeviceMesh
from ..parallel import parallelize_module
from ..parallel._plan import match

__all__ = ["check_tp_plan", "shard_stage", "tp_dim_of"]


def tp_dim_of(mesh: DeviceMesh, pp_dim: str, dp_dim: Optional[str], tp_dim: Optional[str],
            tp_plan: Optional[Mapping[str, Any]]) -> tuple[Optional[str], list[str]]:
    """The tensor-parallel mesh dim (default "tp" when the mesh names one), and the problems with it."""
    names = mesh.mesh_dim_names or ()
    problems: list[str] = []
    if tp_dim is None and "tp" in names and "tp" not in (pp_dim, dp_dim):
        tp_dim = "tp"
    elif tp_dim is not None and tp_dim in (pp_dim, dp_dim):
        problems.append(f"tp_dim={tp_dim!r} is also the {'pp' if tp_dim == pp_dim else 'dp'} dim: name a separate "
                        "tensor-parallel mesh dim")
        return None, problems
    elif tp_dim is not None and tp_dim not in names:
        problems.append(f"tp_dim={tp_dim!r} is not a dim of the mesh (dims: {names}): name the mesh's "
                        "tensor-parallel dim, or leave tp_dim=None")
        return None, problems
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        problems.append(f"tp_plan must map module patterns of the whole model to ParallelStyles (as "
                        f"parallelize_module takes), got {describe(tp_plan)}")
    if tp_dim is None and tp_plan:
        problems.append("tp_plan is given but the mesh has no tp dim: build the mesh with a 'tp' dim (e.g. "
                        "mesh_dim_names=('pp', 'tp')) or pass tp_dim=")
    if tp_dim is not None and mesh.size(tp_dim) > 1 and not tp_plan:
        problems.append(f"the tp dim {tp_dim!r} has {mesh.size(tp_dim)} ranks but there is no tp_plan, so every "
                        "one of them would compute the same thing: give tp_plan={pattern: ParallelStyle} naming "
                        "the layers to shard (e.g. {'*.mlp.fc': ColwiseParallel()}), or leave the dim out")
    return tp_dim, problems


def check_tp_plan(tp_plan: Optional[Mapping[str, Any]], partitions: Sequence[nn.Module]) -> None:
    """ValueError when a pattern of `tp_plan` names no layer of any stage."""
    if not tp_plan:
        return
    names = [name for part in partitions for name, _ in part.named_modules() if name]
    unmatched = [k for k in tp_plan if not any(match(k, name) for name in names)]
    if unmatched:
        raise ValueError(f"tp_plan patterns {unmatched} name no layer of the model (its layers are named as in the "
                         f"nn.Sequential given, e.g. {names[:4]}): fix them or drop them")


def shard_stage(part: nn.Module, tp_mesh: Optional[DeviceMesh], tp_plan: Optional[Mapping[str, Any]]) -> None:
    """Shard one stage's layers over `tp_mesh` with the entries of `tp_plan` that name them."""
    if tp_mesh is None or not tp_plan:
        return
    names = [name for name, _ in part.named_modules() if name]
    mine = {k: style for k, style in tp_plan.items() if any(match(k, name) for name in names)}
    if mine:
        # A plan whose styles hand on DTensors (use_local_output=False) makes the stage's other
        # parameters and buffers replicated DTensors, so its ops see DTensors only. A torch-style
        # plan (local outputs, the default) leaves them plain, as torch's parallelize_module
        # does: its activations are plain between the cut layers, and a replicated buffer
        # (a rotary embedding's) would meet them as a DTensor.
        keeps_dtensors = any(getattr(style, "use_local_output", True) is False for style in mine.values())
        parallelize_module(part, tp_mesh, mine, replicate_rest=keeps_dtensors)
