"""See before you run: what an op or a step communicates, and why.

- `explicit()` / `SHARDWISE_EXPLICIT=1`: any implicit redistribution (an op moving an input
  with communication) raises `ImplicitRedistributionError` naming the op, the layouts, the
  collectives with their bytes, and the `redistribute(...)` that makes it explicit.
- `CommCounter(model)`: collectives and bytes per module path, forward and backward apart,
  printed as a tree (`comm_log()` lists every record in order).
- `explain_redistribute(...)` / `plan_for(...)`: a redistribution's plan, purely.
"""

from .._comm import CommRecord, comm_log
from .._explain import explain_redistribute, plan_for
from .._explicit import ImplicitRedistributionError, explicit
from ._counter import CommCounter

__all__ = ["CommCounter", "CommRecord", "ImplicitRedistributionError", "comm_log", "explain_redistribute", "explicit", "plan_for"]
