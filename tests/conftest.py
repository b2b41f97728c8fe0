"""Fixtures shared by the whole test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardwise.testing import shutdown_pools

# --- multi-rank harness (shardwise.testing) ------------------------------------------
# Tests run bodies on N ranks with `run_distributed` or `@distributed(world_size=N)`.
# The worker pools (one per world size) live across tests; stop them when the session ends.


@pytest.fixture(scope="session", autouse=True)
def _shardwise_worker_pools() -> Iterator[None]:
    yield
    shutdown_pools()
