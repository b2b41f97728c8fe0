"""See before you run: what an op or a step communicates, and why.

- `explicit()` / `SHARDWISE_EXPLICIT=1`: any implicit redistribution (an op moving an input
  with communication) raises `ImplicitRedistributionError` naming the op, the layouts, the
  collectives with their bytes, and the `redistribute(...)` that makes it explicit.
- `comm_log()`: every collective this rank issues, with its bytes.
- `explain_redistribute(...)` / `plan_for(...)`: a redistribution's plan, purely.
"""

from .._comm import CommRecord, comm_log
from .._explain import explain_redistribute, plan_for
from .._explicit import ImplicitRedistributionError, explicit

__all__ = ["CommRecord", "ImplicitRedistributionError", "comm_log", "explain_redistribute", "explicit", "plan_for"]
