"""Redistribution: plan a layout change (pure) and execute it through the comm layer."""

from ._cross import CrossPlan, Side, _volume, cross_plan
from ._exchange import Box, Routes, overlap, piece_boxes, scatter_routes
from ._execute import LocalStep, Program, build_program, run_program
from ._planner import COST_MODEL, RedistributePlan, Step, plan_redistribute
from ._specs import StridedStep, as_shard, plan_between, plan_parts

__all__ = [
    "COST_MODEL",
    "Box",
    "CrossPlan",
    "LocalStep",
    "Program",
    "RedistributePlan",
    "Routes",
    "Side",
    "Step",
    "StridedStep",
    "_volume",
    "as_shard",
    "build_program",
    "cross_plan",
    "overlap",
    "piece_boxes",
    "plan_between",
    "plan_parts",
    "plan_redistribute",
    "run_program",
    "scatter_routes",
]
