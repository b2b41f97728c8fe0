"""The harness's knobs: default timeouts (overridable by environment variables) and argument checks."""

from __future__ import annotations

import os

__all__ = ["DEFAULT_TIMEOUT", "COLLECTIVE_TIMEOUT", "default_timeout", "collective_timeout", "check_world_size", "check_timeout"]

DEFAULT_TIMEOUT = 60.0  # seconds per body, unless SHARDWISE_TEST_TIMEOUT says otherwise
COLLECTIVE_TIMEOUT = 30.0  # seconds, unless SHARDWISE_COLLECTIVE_TIMEOUT says otherwise


def default_timeout() -> float:
    """Seconds a body may run when no `timeout` is given: env `SHARDWISE_TEST_TIMEOUT`, else 60."""
    return _seconds("SHARDWISE_TEST_TIMEOUT", DEFAULT_TIMEOUT)


def check_world_size(world_size: object) -> int:
    """`world_size` if it is a positive int; TypeError or ValueError naming it otherwise."""
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    return world_size


def check_timeout(timeout: object) -> float:
    """`timeout` as float seconds if it is a positive number; TypeError or ValueError otherwise."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    return float(timeout)


def collective_timeout() -> float:
    """Process-group timeout of the workers: env `SHARDWISE_COLLECTIVE_TIMEOUT`, else 30."""
    return _seconds("SHARDWISE_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT)


def _seconds(var: str, default: float) -> float:
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        return check_timeout(float(raw))
    except ValueError as exc:
        raise ValueError(f"{var}={raw!r} is not a positive number of seconds: set it like {var}={default:g}") from exc
