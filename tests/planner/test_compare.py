"""`AutoPlanner.compare`: candidates of one's own, roles or `ShardingPlan`s, measured as the
report measures its own.

A plan given by hand (Megatron's, or the layout solver's `report.plan`) costs exactly what the
report says for the roles that make the same plan, clustered blocks included; its printed
row reads as the report's. A plan that treats blocks differently is measured on the whole
model. On a 2-D mesh a plan comes with roles that say where it goes, or is refused.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.parallel import MegatronPlanner, ShardingPlan
from shardwise.planner import AutoPlanner, Comparison, CostModel
from shardwise.planner._model import cut_plan

from ._models import Stack

SLOW_LINKS = CostModel(flops_per_second=1e11, default_bandwidth=1e8, latency=1e-5)


def _row(table: str, label: str) -> str:
    """The numbers of `table`'s row for `label` (the columns after the label)."""
    line = next(line for line in table.splitlines() if line.strip().startswith(label + " "))
    return line.strip()[len(label):].replace("<- chosen", "").strip()


def test_compare_takes_sharding_plans_and_agrees_with_the_report() -> None:
    model = Stack(64, 6)  # 6 repeated blocks: clustered, a plan cut to 1 and 2 blocks
    planner = AutoPlanner(sw.AbstractMesh((2,), ("x",)), example_inputs=(torch.randn(8, 64),), cost=SLOW_LINKS)
    planner.build_plan(model)
    assert planner.report is not None and planner.layouts is not None
    report = {c.roles: c.cost for c in planner.report.candidates}
    megatron = MegatronPlanner().build_plan(model)
    assert "blocks.5.up" in megatron.plan  # a plan naming every block: the clustered dry runs get it cut
    compared = planner.compare(model, {"megatron": megatron, "auto": planner.layouts.plan, "data parallel": ("dp",)})
    assert isinstance(compared, Comparison) and list(compared) == ["megatron", "auto", "data parallel"]
    assert compared["megatron"] == report[("tp",)]
    assert compared["auto"] == report[("auto",)]
    assert compared["data parallel"] == report[("dp",)]
    assert compared.fits == {"megatron": True, "auto": True, "data parallel": True}
    table, full = str(compared), str(planner.report)
    for name, roles in (("megatron", "x=tp"), ("auto", "x=auto"), ("data parallel", "x=dp")):
        assert _row(table, name) == _row(full, roles)  # step, compute, comm s, comm bytes, peak, fits


def test_a_plan_that_treats_blocks_differently_is_measured_on_the_whole_model() -> None:
    model = Stack(64, 4)
    planner = AutoPlanner(sw.AbstractMesh((2,), ("x",)), example_inputs=(torch.randn(8, 64),), cost=SLOW_LINKS)
    megatron = MegatronPlanner().build_plan(model)
    first = ShardingPlan({k: v for k, v in megatron.plan.items() if k.startswith("blocks.0.")})
    assert cut_plan(first, "blocks", 4, 2) is None
    assert cut_plan(megatron, "blocks", 4, 1) == ShardingPlan(
        {k: v for k, v in megatron.plan.items() if not k.startswith(("blocks.1", "blocks.2", "blocks.3"))})
    pattern = ShardingPlan({"blocks.*.up.weight": (sw.Shard(0),), "head.weight": (sw.Replicate(),)})
    assert cut_plan(pattern, "blocks", 4, 1) == pattern
    compared = planner.compare(model, {"first block only": first, "every block": megatron})
    assert compared["first block only"] == planner._measure(model, ("tp",), None, first)
    # one block cut instead of four: two collectives (forward and backward) per block fewer
    assert compared["first block only"].collectives < compared["every block"].collectives


def test_a_plan_on_a_2d_mesh_goes_where_its_roles_say() -> None:
    model = Stack(64, 6)
    planner = AutoPlanner(sw.AbstractMesh((2, 2), ("dp", "tp")), example_inputs=(torch.randn(8, 64),),
                          cost=SLOW_LINKS)
    plan = MegatronPlanner().build_plan(model)
    with pytest.raises(ValueError, match=r"compare\['megatron'\] is a ShardingPlan, which shards over one mesh dim, "
                                         r"and mesh \(2, 2\) \('dp', 'tp'\) has 2: say which .* e\.g\. "
                                         r"\(plan, \('dp', 'tp'\)\) puts the plan on 'tp'"):
        planner.compare(model, {"megatron": plan})
    compared = planner.compare(model, {"plan": (plan, ("zero", "tp")), "roles": ("zero", "tp")})
    assert compared["plan"] == compared["roles"]
    with pytest.raises(ValueError, match=r"give one role per mesh dim of \('dp', 'tp'\), 'tp' where the plan goes"):
        planner.compare(model, {"both": (plan, ("tp", "tp"))})
    with pytest.raises(TypeError, match=r"compare\['x'\] = 'tp': a candidate is roles"):
        planner.compare(model, {"x": "tp"})
