"""Redistribution: plan a layout change (pure) and execute it through the comm layer."""

from ._execute import LocalStep, Program, build_program, run_program
from ._planner import COST_MODEL, RedistributePlan, Step, plan_redistribute
from ._specs import plan_between

__all__ = [
    "COST_MODEL",
    "LocalStep",
    "Program",
    "RedistributePlan",
    "Step",
    "build_program",
    "plan_between",
    "plan_redistribute",
    "run_program",
]
