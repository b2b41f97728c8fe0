"""See before you run: what an op or a step communicates, and why.

- `explicit()` / `SHARDWISE_EXPLICIT=1`: any implicit redistribution (an op moving an input
  with communication) raises `ImplicitRedistributionError` naming the op, the layouts, the
  collectives with their bytes, and the `redistribute(...)` that makes it explicit.
- `CommCounter(model)`: collectives and bytes per module path, forward and backward apart,
  printed as a tree (`comm_log()` lists every record in order).
- `dry_run(step, *args, mesh=AbstractMesh(shape, names))`: one step of a model sharded on an
  abstract mesh, run with meta tensors as one rank of a mesh of any size: every collective
  (kind, mesh dims, bytes, op, module) and the memory per rank (parameters, gradients,
  optimizer state, activations), as a table or JSON; with a MoE section per experts module
  that dispatches tokens (all_to_all bytes per pass, expert memory) under `routing=`.
- `moe_report(model, counter, optimizer)`: the same MoE section for a real run's step.
- `dry_mesh(shape, mesh_dim_names=...)`: the mesh a dry run shards over, with no processes
  behind it (`init_device_mesh`'s dry twin); `simulating(rank)` picks the rank it plays.
- `visualize_sharding(dtensor)` (or a shape with mesh= and placements=): which rank holds
  which piece, for any mesh and tensor rank, as text (and a PNG with png=);
  `layout_table(model)`: every parameter's layout and map.
- `explain_redistribute(...)` / `plan_for(...)`: a redistribution's plan, purely.
- `cache_info()`: the entries each cache of layouts and plans holds (flat over a long run).
- `gradient_reducers(param)` (or a module): who reduces each gradient at the end of backward
  (a unit, data parallel, context parallel, a style, the DTensor layout), over which ranks.
"""

from .._comm import CommRecord, comm_log
from .._explain import explain_redistribute, plan_for
from .._explicit import ImplicitRedistributionError, explicit
from .._mesh import dry_mesh, simulating
from .._tensor import GradientReducer
from ._caches import cache_info
from ._counter import CommCounter
from ._dry_run import dry_run
from ._moe import MoeLayer, MoeReport, moe_report
from ._reducers import gradient_reducers
from ._report import DryCollective, DryRunReport, MemoryReport, RankReport
from ._visualize import layout_table, visualize_sharding

__all__ = [
    "CommCounter",
    "CommRecord",
    "DryCollective",
    "DryRunReport",
    "GradientReducer",
    "ImplicitRedistributionError",
    "MemoryReport",
    "MoeLayer",
    "MoeReport",
    "RankReport",
    "cache_info",
    "comm_log",
    "dry_mesh",
    "dry_run",
    "explain_redistribute",
    "explicit",
    "gradient_reducers",
    "layout_table",
    "moe_report",
    "plan_for",
    "simulating",
    "visualize_sharding",
]
