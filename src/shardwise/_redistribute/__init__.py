"""Redistribution: plan a layout change (pure) and execute it through the comm layer."""

from ._planner import COST_MODEL, RedistributePlan, Step, plan_redistribute

__all__ = ["COST_MODEL", "RedistributePlan", "Step", "plan_redistribute"]
