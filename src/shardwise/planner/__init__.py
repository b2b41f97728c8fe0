"""The automatic planner: `AutoPlanner` chooses how to shard a training step on a mesh by the
modelled time of dry runs (`CostModel`), under a memory budget per rank.

    planner = AutoPlanner(mesh, example_inputs=(tokens,), memory_budget=8 * 2**30)
    plan = planner.build_plan(model)       # a ShardingPlan (tp styles); roles per mesh dim in planner.report
    print(planner.report)                  # every candidate: modelled step time, communication, peak memory
    planner.apply(model, mesh)             # the plan and data parallel / ZeRO-3 on the real mesh
    print(planner.compare(model, {"megatron": MegatronPlanner().build_plan(model), "dp": ("dp",)}))  # 1-D mesh

`plan_pipeline(layers, pp, example_inputs)` chooses a pipeline the same way: stage
boundaries, micro-batches and schedule by a modelled step, each stage's memory and the
bubble in its `report()`, and `plan.pipe(layers, mesh, loss_fn=...)` builds it.
`AutoPlanner` weighs such a pipeline as the "pp" role of a mesh dim (beside "dp" or "zero"
on a 2-D mesh), and its `apply` builds the pipe.
"""

from ._auto import AutoPlanner, CandidateLike
from ._cost import CostModel, StepCost
from ._pipeline import PipelinePlan, plan_pipeline, step_seconds
from ._report import AutoPlanReport, Candidate, Comparison

__all__ = ["AutoPlanReport", "AutoPlanner", "Candidate", "CandidateLike", "Comparison", "CostModel", "PipelinePlan",
           "StepCost", "plan_pipeline", "step_seconds"]
