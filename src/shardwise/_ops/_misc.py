"""Placeholder: strategies for this op family arrive with the propagation issue."""

__all__: list[str] = []
