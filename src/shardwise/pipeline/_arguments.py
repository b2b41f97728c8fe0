"""Checking `DistributedPipe`'s arguments: every problem with the mesh, the schedule and the
tp plan, raised together in one ValueError that names the values and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from .._describe import describe
from .._mesh import DeviceMesh
from ._tensor_parallel import tp_dim_of
from ._topology import Topology

__all__ = ["SCHEDULES", "check_arguments", "check_staged"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "zero_bubble", "zbv", "dualpipev")
LOOPED = ("interleaved", "looped_bfs", "zero_bubble")  # several stages per rank, stage s on rank s % pp


def check_arguments(mesh: DeviceMesh, pp_dim: str, dp_dim: Optional[str], tp_dim: Optional[str],
                     cp_dim: Optional[str], tp_plan: Optional[Mapping[str, Any]], schedule: str,
                     virtual_stages: Optional[int], num_stages: int, chunks: int
                     ) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """Problems with the mesh and the schedule, raised together; returns the dp, tp and cp dims."""
    problems: list[str] = []
    names = mesh.mesh_dim_names or ()
    if pp_dim not in names:
        problems.append(f"pp_dim={pp_dim!r} is not a dim of the mesh (dims: {names or 'unnamed'}): build the mesh "
                        "with mesh_dim_names=(..., 'pp', ...) or pass pp_dim=")
    if dp_dim is None and "dp" in names and pp_dim != "dp":
        dp_dim = "dp"
    elif dp_dim is not None and dp_dim == pp_dim:
        problems.append(f"dp_dim={dp_dim!r} is also the pp dim: averaging gradients over it would mix different "
                        f"stages' parameters; name a separate data-parallel mesh dim, or leave dp_dim=None")
    elif dp_dim is not None and dp_dim not in names:
        problems.append(f"dp_dim={dp_dim!r} is not a dim of the mesh (dims: {names}): name the mesh's data-parallel "
                        "dim, or leave dp_dim=None for a mesh without one")
    if cp_dim is None and "cp" in names and "cp" not in (pp_dim, dp_dim, tp_dim):
        cp_dim = "cp"
    elif cp_dim is not None and (cp_dim not in names or cp_dim in (pp_dim, dp_dim, tp_dim)):
        problems.append(f"cp_dim={cp_dim!r} is not a dim of the mesh apart from its pp, dp and tp dims (dims: "
                        f"{names}): name the mesh's context-parallel dim, or leave cp_dim=None")
    tp_dim, tp_problems = tp_dim_of(mesh, pp_dim, dp_dim, tp_dim, tp_plan)
    problems += tp_problems
    others = [n for n in names if n not in (pp_dim, dp_dim, tp_dim, cp_dim)]
    if others:
        problems.append(f"mesh dims {others} are not the pp dim ({pp_dim!r}), the dp dim ({dp_dim!r}), the cp dim "
                        f"({cp_dim!r}) or the tp dim ({tp_dim!r}): DistributedPipe runs over meshes of a pp dim and "
                        "optionally dp, cp and tp dims; slice the mesh (mesh['pp', 'dp']) or name the dims")
    if pp_dim in names:
        problems += _schedule_problems(mesh.size(pp_dim), schedule, virtual_stages, num_stages, chunks)
    elif schedule not in SCHEDULES:
        problems.append(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if problems:
        raise ValueError(problems[0] if len(problems) == 1 else f"{len(problems)} problems with the "
                         "DistributedPipe arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    return dp_dim, tp_dim, cp_dim


def check_staged(topology: Topology, tp_plan: Optional[Mapping[str, Any]], schedule: str,
                  virtual_stages: Optional[int], num_stages: int, chunks: int) -> None:
    """Problems with the schedule and tp_plan of a pipe over one mesh per stage, raised together."""
    problems = _schedule_problems(topology.pp, schedule, virtual_stages, num_stages, chunks)
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        problems.append(f"tp_plan must map module patterns of the whole model to ParallelStyles (as "
                        f"parallelize_module takes), got {describe(tp_plan)}")
    wide = [p for p in range(topology.pp) if len(topology.row(p)) > 1]
    if wide and not tp_plan:
        problems.append(f"stage meshes {wide} have tp rows of {[len(topology.row(p)) for p in wide]} ranks but "
                        "there is no tp_plan, so those ranks would all compute the same thing: give tp_plan="
                        "{pattern: ParallelStyle} naming the layers to shard")
    if problems:
        raise ValueError(problems[0] if len(problems) == 1 else f"{len(problems)} problems with the "
                         "DistributedPipe arguments:\n" + "\n".join(f"  - {p}" for p in problems))


def _schedule_problems(pp: int, schedule: str, virtual_stages: Optional[int], num_stages: int,
                       chunks: int) -> list[str]:
    problems: list[str] = []
    if schedule not in SCHEDULES:
        problems.append(f"schedule={schedule!r} is not one of {SCHEDULES}")
    else:
        if schedule in LOOPED:
            if num_stages % pp or num_stages == 0:
                problems.append(f"schedule={schedule!r} puts the same number of stages on each of the {pp} pp ranks, "
                                f"but balance has {num_stages} stages: give len(balance) a multiple of {pp}")
            elif virtual_stages is not None and virtual_stages * pp != num_stages:
                problems.append(f"virtual_stages={virtual_stages} with {pp} pp ranks means {virtual_stages * pp} "
                                f"stages, but balance has {num_stages}: give one balance entry per stage")
            if schedule == "interleaved" and isinstance(chunks, int) and chunks > 0 and chunks % pp:
                problems.append(f"interleaved 1F1B sends micro-batches through the ranks in groups of {pp}, so "
                                f"chunks ({chunks}) must be a multiple of {pp}")
        elif schedule in ("zbv", "dualpipev"):
            if num_stages != 2 * pp:
                per = f"{num_stages // pp} stages per rank" if num_stages % pp == 0 else f"{num_stages} stages"
                problems.append(f"schedule={schedule!r} places stages in a V, two on each pp rank (rank k holds stages k "
                                f"and {2 * pp - 1}-k), so balance needs {2 * pp} entries for {pp} pp ranks, got {per}: "
                                f"split the model into {2 * pp} stages, or use schedule='zero_bubble' for another "
                                "number per rank")
            if virtual_stages not in (None, 2):
                problems.append(f"virtual_stages={virtual_stages}: schedule={schedule!r} holds exactly 2 stages per rank")
            if schedule == "dualpipev" and isinstance(chunks, int) and 0 < chunks < 2 * pp:
                problems.append(f"schedule='dualpipev' fills the V with 2 * pp micro-batches before its steady state, "
                                f"so chunks ({chunks}) must be at least {2 * pp}: use chunks={2 * pp}, or "
                                "schedule='zbv'")
        else:
            if num_stages != pp:
                problems.append(f"schedule={schedule!r} runs one stage per pp rank, so balance needs {pp} entries "
                                f"(got {num_stages}); use schedule='interleaved', 'looped_bfs', 'zero_bubble' or "
                                "'zbv' for several stages per rank")
            if virtual_stages not in (None, 1):
                problems.append(f"virtual_stages={virtual_stages} needs a schedule of several stages per rank "
                                f"({', '.join(LOOPED)} or zbv)")
    return problems
