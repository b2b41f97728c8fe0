"""`cache_info()`: how many entries each of shardwise's caches holds now.

Every cache of layouts and plans is keyed by layouts, shapes, dtypes and argument types,
never by tensor values or by floats that change from step to step (an optimizer's lr, bias
corrections, step sizes: those ops' plans are keyed by the float's type, `OpRule.floats_by_type`).
After the first steps of a training loop the sizes stop growing; a growth test
(`tests/test_long_run.py`) holds them flat over a thousand steps.
"""

from __future__ import annotations

from .._mesh import CACHE_SIZES

__all__ = ["cache_info"]


def cache_info() -> dict[str, int]:
    """{cache name: entries now} for every cache of layouts and plans (this process)."""
    return {name: int(size()) for name, size in sorted(CACHE_SIZES.items())}
