"""Multi-rank test harness: run a test body on N real processes in one gloo process group.

`run_distributed(fn, world_size, ...)` runs a function on every rank and returns the
per-rank results; `@distributed(world_size)` does the same for a pytest test function.
Workers live in a pool per world size, started once and replaced after any failure;
`shutdown_pools()` stops them (the test suite's conftest does so at the end of the
session). Env `SHARDWISE_TEST_TIMEOUT` sets the default time a body may take (60 s),
`SHARDWISE_COLLECTIVE_TIMEOUT` the workers' process-group timeout (30 s).
"""

from ._decorator import distributed
from ._pool import shutdown_pools
from ._report import DistributedTestError, RankFailure
from ._run import run_distributed
from ._settings import default_timeout

__all__ = ["DistributedTestError", "RankFailure", "default_timeout", "distributed", "run_distributed", "shutdown_pools"]
