"""`plan_between`: the one place a DTensor's layout change is planned, priced and run.

Regression: propagation priced input moves with the exchange step available, while
execution allowed it only where the mesh had a group over all its ranks; on a 2-D
sub-mesh without one, the plan chosen on price was not the plan that ran.
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import AbstractMesh, Shard
from shardwise._layout import Layout
from shardwise._ops import redistribute_cost
from shardwise._redistribute import plan_between
from shardwise._spec import DTensorSpec, TensorMeta
from shardwise.testing import distributed

S0, S1 = Shard(0), Shard(1)


class _WithoutMeshGroup(AbstractMesh):
    """A 2-D mesh that, like a sub-mesh of a larger one, has no group over all its ranks."""

    @property
    def has_mesh_group(self) -> bool:
        return False


def _spec(mesh: AbstractMesh, placements: tuple[Shard, ...]) -> DTensorSpec:
    return DTensorSpec(mesh, placements, TensorMeta(torch.Size([8, 8]), (8, 1), torch.float32))


def test_a_plan_without_a_mesh_group_has_no_exchange_and_propagation_prices_that_plan() -> None:
    for mesh, exchange in [(AbstractMesh((2, 2)), True), (_WithoutMeshGroup((2, 2)), False)]:
        src = _spec(mesh, (S0, S1))
        plan = plan_between(src, src.with_placements((S1, S0)))
        assert ("exchange" in [s.kind for s in plan.steps]) == exchange, plan.explain()
        assert redistribute_cost(src, Layout((S1, S0))) == plan.cost
    # the exchange is cheaper where it exists: the two plans really differ
    with_group = plan_between(_spec(AbstractMesh((2, 2)), (S0, S1)), _spec(AbstractMesh((2, 2)), (S1, S0)))
    without = plan_between(_spec(_WithoutMeshGroup((2, 2)), (S0, S1)), _spec(_WithoutMeshGroup((2, 2)), (S1, S0)))
    assert with_group.cost < without.cost


@distributed(world_size=4)
def test_the_move_that_runs_is_the_plan_propagation_priced() -> None:
    from shardwise._tensor._redistribute import move_between

    mesh = sw.init_device_mesh("cpu", (2, 2))
    assert mesh.has_mesh_group
    x = sw.distribute_tensor(torch.arange(64.0).view(8, 8), mesh, [S0, S1])
    target = x._spec.with_placements((S1, S0))
    move = move_between(x._spec, target)
    # the same plan (equal, not always the same object: the move outlives the plan cache's
    # LRU entry in a worker that has planned many moves before this test)
    assert move.plan == plan_between(x._spec, target)
    assert redistribute_cost(x._spec, Layout((S1, S0))) == move.plan.cost
    with sw.comm_log() as log:
        y = x.redistribute(mesh, [S1, S0])
    assert [r.op for r in log] == [c.kind for c in move.program] == ["all_to_all"]
    assert torch.equal(y.full_tensor(), torch.arange(64.0).view(8, 8))
