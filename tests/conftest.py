"""Fixtures shared by the whole test suite, and the `multirank` marker.

The tree mirrors `src/shardwise`: `tests/ops/` tests `_ops`, `tests/tensor/` the DTensor
layer, and so on; the top level holds the tests of the top-level modules and the shared
support (`oracle.py`, `strategy_sim.py`, `dist_helpers.py`, `models.py`, the OpInfo sweep).

A test whose body runs on several processes (decorated with `@distributed(...)`, or
calling `run_distributed`) is marked `multirank`, so `pytest -m "not multirank"` runs the
single-process tests alone.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from typing import Optional

import pytest

from shardwise.testing import shutdown_pools

# --- multi-rank harness (shardwise.testing) ------------------------------------------
# Tests run bodies on N ranks with `run_distributed` or `@distributed(world_size=N)`.
# The worker pools (one per world size) live across tests; stop them when the session ends.
# A body's time limit guards against hangs, not slowness: on a loaded machine (2 cores, another
# suite beside it) the heaviest bodies take over a minute, so the suite allows 300 s each
# unless SHARDWISE_TEST_TIMEOUT says otherwise (the harness's own default stays 60 s).
os.environ.setdefault("SHARDWISE_TEST_TIMEOUT", "300")


@pytest.fixture(scope="session", autouse=True)
def _shardwise_worker_pools() -> Iterator[None]:
    yield
    shutdown_pools()


def _runs_on_ranks(fn: object, seen: Optional[set[int]] = None) -> bool:
    """Whether a test function runs a body on several processes: it is `@distributed`, or
    it (or a function it calls by a module-level name, transitively) calls `run_distributed`."""
    seen = set() if seen is None else seen
    unwrapped = inspect.unwrap(fn, stop=lambda f: hasattr(f, "__shardwise_body__"))  # type: ignore[arg-type]
    if hasattr(unwrapped, "__shardwise_body__"):
        return True
    if id(unwrapped) in seen or not inspect.isfunction(unwrapped):
        return False
    seen.add(id(unwrapped))
    codes = [unwrapped.__code__]
    while codes:
        code = codes.pop()
        codes.extend(c for c in code.co_consts if inspect.iscode(c))  # lambdas and inner functions
        for name in code.co_names:
            if name == "run_distributed":
                return True
            callee = unwrapped.__globals__.get(name)
            if inspect.isfunction(callee) and _runs_on_ranks(callee, seen):
                return True
    return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and _runs_on_ranks(fn):
            item.add_marker(pytest.mark.multirank)
