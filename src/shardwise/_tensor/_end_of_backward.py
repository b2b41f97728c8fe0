"""The end of backward: one engine callback per backward pass, and who reduces each parameter's gradient.

Gradients arrive during backward one parameter at a time; what makes them the gradients an
optimizer steps with runs once the pass is over. Five mechanisms did that, each with its own
engine callback queued in whatever order its first gradient happened to arrive, and a
composition found out who reduced what by reading another one's private state. Here there
is one registry, with two halves.

**Steps.** A `Step` (a unit's finishing, the layout reduction, a group sum, a check) is
*armed* from inside backward (a hook, an autograd function's backward) by `arm(step)`. The
first arm of a pass queues the pass's only callback (`_end_of_pass`); it runs the steps armed
in that pass in phase order, then in the order each step first armed (the same on every rank
of an SPMD program, so their collectives match):

| phase | what runs | steps today |
|---|---|---|
| `units` | collectives started during backward finished, units resharded | `fully_shard` / ZeRO-3 roots |
| `layout` | each gradient moved into its parameter's own layout | DTensor and plain leaves (`_grad_reduce`) |
| `replicas` | a sum or mean over the ranks that hold copies of a parameter | `data_parallel`, `ContextParallel` (`GroupSum`) |
| `across` | sums over replica groups | (fault tolerance: see below; pipelines run theirs after the schedule) |
| `checks` | reading the settled gradients | the plain-gradient check (`parallel/_grad_check.py`) |

A reentrant backward inside a pass (a checkpoint recomputing with `use_reentrant=True`) is a
pass of its own: a step armed there runs at its end. A pass that raises never reaches its
end: its steps run at the end of the next pass that arms them (`disarm` drops them at once).

**Reducers.** `register(reducer)` says who reduces which parameters, at one *level*:
`layout` (within the parameter's own mesh: what its placements say, or the style that
declared them, `ReplicateParallel`), `replicas` (over ranks holding copies of it: a unit,
`data_parallel`, `ContextParallel`) or `across` (after that: over replica groups, or across
pipeline stages). Each parameter has exactly one reducer per level; registering a second one
is refused naming both registrations, so no gradient is summed twice over the same ranks
and two mechanisms never silently split one job. Where a parameter needs two sums at one
level, one reducer composes them (and says so). The default layout reduction of a DTensor
leaf needs no registration: its layout is the record. A reducer that sets `.grad` itself, in
the parameter's layout (a unit, data_parallel: `sets_grad`), settles the layout too, and the
layout step leaves its parameters alone. `reducers_at(level)` answers "who
reduces this parameter?" for a composition that must know (the `ContextParallel` style skips
what a unit over its ranks reduces); `shardwise.debug.gradient_reducers` is the public question.

Slotting in later, with no callback of their own:
- expert-parallel averaging: a `GroupSum("ExpertParallel", dp group, op="avg")` taking the
  expert parameters (level and phase `replicas`); if a unit or data_parallel already reduces
  them, the registration fails, which is the point;
- fault-tolerant cross-group reduction: a reducer at level `across` whose `Step` (phase
  `across`) reduces every parameter's gradient over the manager's group after each replica
  group's own reduction, and records what `should_commit` reads.

Pipelines (`DistributedPipe`) register their sums too, but run them after the schedule
rather than at the end of each backward pass (one step holds many passes): the average over
dp at level `replicas` (unless ZeRO-3 units hold it), the sum of each tied parameter over the
stages holding it, and the sum over cp, at level `across` (a ZeRO-3 unit may hold `replicas`).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

__all__ = ["LEVELS", "PHASES", "GradientReducer", "Reducer", "Step", "arm", "averaged_within_layout", "caller_place",
           "disarm", "is_armed", "register", "reducers_at", "registered", "unregister"]

PHASES = ("units", "layout", "replicas", "across", "checks")
LEVELS = ("layout", "replicas", "across")
_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}


# -- steps ------------------------------------------------------------------------------------

class Step:
    """Work for the end of a backward pass: subclass it, set `phase`, implement `finish`."""

    phase: str = "replicas"  # one of PHASES (a class attribute; an instance may set its own)
    _armed_in: Optional[int] = None  # the pass (graph task) this step is armed in, if any
    _order: Optional[int] = None  # when it first armed: its place within its phase

    def finish(self) -> None:
        raise NotImplementedError


class _Passes:
    """The steps armed in each running backward pass, by graph task id."""

    def __init__(self) -> None:
        self.armed: dict[int, list[weakref.ref[Step]]] = {}
        self.count = 0


_PASSES = _Passes()


def arm(step: Step) -> None:
    """Run `step.finish()` at the end of the current backward pass (once, however often armed)."""
    task = torch._C._current_graph_task_id()
    if step._armed_in == task:
        return
    if task == -1:
        raise RuntimeError(f"{type(step).__name__} asked for the end of a backward pass outside one: arm a step "
                           "from a hook or an autograd function's backward")
    if step._order is None:
        step._order = _PASSES.count
        _PASSES.count += 1
    step._armed_in = task
    refs = _PASSES.armed.get(task)
    if refs is None:
        refs = _PASSES.armed[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end_of_pass, task))
    if not any(r() is step for r in refs):
        refs.append(weakref.ref(step))


def is_armed(step: Step) -> bool:
    """Whether `step` waits for the end of a pass (a running one, or one that raised)."""
    return step._armed_in is not None


def disarm(step: Step) -> None:
    """Forget that `step` was armed (after a failed pass its owner resets)."""
    task, step._armed_in = step._armed_in, None
    refs = _PASSES.armed.get(task) if task is not None else None
    if refs is not None:
        refs[:] = [r for r in refs if r() is not step]


def _end_of_pass(task: int) -> None:
    """The one engine callback of a pass: its armed steps, by phase, then by first arming."""
    refs = _PASSES.armed.pop(task, [])
    steps = [s for r in refs if (s := r()) is not None]
    steps.sort(key=lambda s: (_PHASE_INDEX[s.phase], s._order))
    for step in steps:
        step._armed_in = None
    _forget_stale()
    for step in steps:
        step.finish()


def _forget_stale() -> None:
    """Drop entries of passes that will not end here: steps since armed elsewhere (a pass that
    raised, an outer pass whose steps a nested one ran) or gone. At most one entry per live step."""
    for task in list(_PASSES.armed):
        refs = [r for r in _PASSES.armed[task] if (s := r()) is not None and s._armed_in == task]
        if refs:
            _PASSES.armed[task] = refs
        else:
            del _PASSES.armed[task]


# -- reducers ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GradientReducer:
    """Who reduces a parameter's gradient at the end of backward, over which ranks, how.

    >>> GradientReducer("ContextParallel", "replicas", "sum", (0, 2), "cp", "train.py:12")
    GradientReducer(registrant='ContextParallel', level='replicas', op='sum', ranks=(0, 2), over='cp', where='train.py:12', sets_grad=False)
    >>> print(_)
    ContextParallel: sum over cp, ranks [0, 2] (replicas; registered at train.py:12)
    """

    registrant: str  # what registered it: "fully_shard unit 'Block'", "data_parallel", "ContextParallel", ...
    level: str  # "layout", "replicas" or "across"
    op: str  # how the terms combine: "sum", "avg", "reduce_scatter, avg"
    ranks: tuple[int, ...]  # the global ranks whose terms are combined (this rank's group)
    over: str  # the group, for people: "cp", "mesh dim 'dp'"
    where: str  # the line outside shardwise that asked for it
    sets_grad: bool = False  # it writes `.grad` itself, in the parameter's layout (no layout step runs)

    def __str__(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        return f"{self.registrant}: {self.op} over {self.over}, ranks [{ranks}] ({self.level}; registered at {self.where})"


class Reducer(Protocol):
    """What `register` takes: a description and the parameters it reduces now (by name)."""

    def gradient_reducer(self) -> GradientReducer: ...

    def reduced_params(self) -> Iterable[tuple[str, torch.Tensor]]: ...


_REDUCERS: list[weakref.ref[Any]] = []  # registered reducers, in registration order (held by their owners)


def registered() -> list[Reducer]:
    """The live registered reducers, in registration order."""
    live = [(r, reducer) for r in _REDUCERS if (reducer := r()) is not None]
    _REDUCERS[:] = [r for r, _ in live]
    return [reducer for _, reducer in live]


def reducers_at(level: str) -> dict[int, tuple[str, GradientReducer]]:
    """id(parameter) -> (its name there, its reducer) for every parameter reduced at `level`
    (use at once: ids of live tensors)."""
    out: dict[int, tuple[str, GradientReducer]] = {}
    for reducer in registered():
        record = reducer.gradient_reducer()
        if record.level == level:
            for name, p in reducer.reduced_params():
                out.setdefault(id(p), (name, record))
    return out


def averaged_within_layout(ranks: Iterable[int], ops: tuple[str, ...] = ("avg",)) -> set[int]:
    """The ids of the parameters whose layout reducer already combines their gradients over
    `ranks` (and perhaps more) by one of `ops`: whole experts per rank under token dispatch,
    every rank's tokens reaching each expert. A data-parallel average (or a context-parallel
    sum, `ops=("avg", "sum")`) over those ranks must leave them alone."""
    want = set(ranks)
    return {i for i, (_, r) in reducers_at("layout").items() if r.op.startswith(ops) and want <= set(r.ranks)}


def register(reducer: Reducer, hint: str = "") -> None:
    """Record `reducer` (held weakly: its owner keeps it). ValueError, naming both registrations,
    when one of its parameters already has a reducer at its level; `hint` says how to fix it."""
    record = reducer.gradient_reducer()
    if record.level not in LEVELS:
        raise ValueError(f"{record.registrant}: reducer level {record.level!r}: one of {LEVELS}")
    taken = reducers_at(record.level)
    clashes: dict[GradientReducer, list[str]] = {}
    for name, p in reducer.reduced_params():
        if id(p) in taken:
            old_name, old = taken[id(p)]
            clashes.setdefault(old, []).append(name if name == old_name else f"{name} ({old_name} there)")
    if clashes:
        lines = [f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}: already "
                 f"reduced by {old}" for old, names in clashes.items()]
        raise ValueError(
            f"{record} would reduce parameters that already have a reducer at level {record.level!r}; each "
            f"parameter has one, or its gradient would be summed twice over the same ranks:\n  - "
            + "\n  - ".join(lines) + (f"\n{hint}" if hint else ""))
    _REDUCERS.append(weakref.ref(reducer))


def unregister(reducer: Reducer) -> None:
    """Forget `reducer` (its owner stops reducing those parameters)."""
    _REDUCERS[:] = [r for r in _REDUCERS if r() is not None and r() is not reducer]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def caller_place() -> str:
    """file:line of the innermost caller outside shardwise: the user's line that asked for it."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
