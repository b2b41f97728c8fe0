"""The plan between two specs: the one place a layout change of a DTensor is planned.

Propagation prices input moves with it and the tensor layer executes what it returns, so
the plan an op was priced with is the plan that runs. Whether the exchange step (one
all_to_all over the whole mesh) is available is the mesh's to say (`has_mesh_group`):
a 2-D sub-mesh without a group over its ranks plans without it.
"""

from __future__ import annotations

from .._spec import DTensorSpec
from ._planner import RedistributePlan, plan_redistribute

__all__ = ["plan_between"]


def plan_between(src: DTensorSpec, dst: DTensorSpec) -> RedistributePlan:
    """The cheapest plan from `src`'s layout to `dst`'s (same mesh, shape and dtype)."""
    mesh = src.mesh
    return plan_redistribute(
        tuple(mesh.shape), tuple(src.shape), src.dtype.itemsize, src.placements, dst.placements,
        src.shard_order, dst.shard_order, None, mesh.has_mesh_group,
    )
