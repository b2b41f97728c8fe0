"""Placeholder: random ops on DTensors arrive with the propagation issue."""

__all__: list[str] = []
