"""The states of a `fully_shard` call and of its unit's parameters, and the calls that move them.

Two small machines, as torch's FSDP2 keeps them (its `TrainingState` and sharded states), each
one table from call to (state before -> state after), so what a call may meet is written down
in one place instead of spread over flags. A call in a state its row does not list raises a
`TransitionError` that names the unit, the state and the call, and says what to do.

Training state (`FSDPState.training`), per step:

| call | from -> to |
|---|---|
| `pre_forward` | IDLE -> FORWARD, FORWARD -> FORWARD (a module of the unit inside another of it) |
| `post_forward` | FORWARD -> IDLE, IDLE -> IDLE (the inner one of those) |
| `pre_backward` (first gradient at an output) | IDLE -> PRE_BACKWARD; PRE_BACKWARD, POST_BACKWARD: unchanged (a later output: nothing to do) |
| `post_backward` (a `_UnitGrad` node, others still open) | IDLE, PRE_BACKWARD, POST_BACKWARD: unchanged |
| `last post_backward` (its last open node) | IDLE, PRE_BACKWARD, POST_BACKWARD -> POST_BACKWARD |
| `end_of_backward`, `reset_iter_state` | any -> IDLE |

A forward recomputed inside backward (activation checkpointing) moves nothing. IDLE at a
post-backward is a unit whose outputs' hooks never ran (a reentrant checkpoint recomputes it
inside backward). A forward met in PRE_BACKWARD or POST_BACKWARD is a step whose backward
raised and was not reset; a post-backward met in FORWARD is a backward over the unit's
parameters inside its own forward, which would reduce and free them halfway.

Parameters (`Unit.state`), as gathers and frees move them:

| call | from -> to |
|---|---|
| `start_gather` | SHARDED -> GATHERING, SHARDED_POST_FORWARD -> GATHERING (over the small group); GATHERING, UNSHARDED: unchanged |
| `unshard` | SHARDED, SHARDED_POST_FORWARD, GATHERING -> UNSHARDED (gathering, or waiting for the gather); UNSHARDED: unchanged |
| `reshard_to_small_group` | UNSHARDED, GATHERING -> SHARDED_POST_FORWARD; SHARDED, SHARDED_POST_FORWARD: unchanged |
| `reshard`, `abandon` (a failed step) | any -> SHARDED |
| `views` | UNSHARDED only: the forward computes with the unsharded tensors |

>>> advance("fully_shard unit 'Block'", TRAINING, TrainingState.IDLE, "pre_forward")
<TrainingState.FORWARD: 'forward'>
>>> advance("fully_shard unit 'Block'", TRAINING, TrainingState.PRE_BACKWARD, "pre_forward")
Traceback (most recent call last):
...
shardwise.fsdp._lifecycle.TransitionError: fully_shard unit 'Block': pre_forward in training state PRE_BACKWARD (allowed in IDLE, FORWARD): the last backward over this unit did not finish (it raised?): call reset_iter_state() on the root module before the next step
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["PARAMS", "TRAINING", "Table", "TrainingState", "TransitionError", "UnitState", "advance"]


class TrainingState(enum.Enum):
    """Where one `fully_shard` call is in the training step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre-backward"
    POST_BACKWARD = "post-backward"


class UnitState(enum.Enum):
    """What a unit's parameters hold beside the stored shards."""

    SHARDED = "sharded"  # the unsharded storage freed
    GATHERING = "gathering"  # an all_gather in flight
    UNSHARDED = "unsharded"  # every parameter's unsharded tensor filled
    SHARDED_POST_FORWARD = "sharded post-forward"  # reshard_after_forward=int: this rank's piece of the small group


class TransitionError(RuntimeError):
    """A call met a unit in a state its transition table does not allow."""


S = TypeVar("S", TrainingState, UnitState)


@dataclass(frozen=True)
class Table(Generic[S]):
    """One machine: per call, the states it may meet and the state each leads to."""

    what: str  # the state's name in messages
    moves: Mapping[str, Mapping[S, S]]
    fixes: Mapping[str, str]  # per call: what to do when it meets another state


def _all(states: type[S], to: S) -> dict[S, S]:
    return {s: to for s in states}


def _same(*states: S) -> dict[S, S]:
    return {s: s for s in states}


_T = TrainingState
_UNFINISHED = ("the last backward over this unit did not finish (it raised?): call reset_iter_state() on the "
               "root module before the next step")
TRAINING: Table[TrainingState] = Table("training state", {
    "pre_forward": {_T.IDLE: _T.FORWARD, _T.FORWARD: _T.FORWARD},
    "post_forward": {_T.FORWARD: _T.IDLE, _T.IDLE: _T.IDLE},
    "pre_backward": {_T.IDLE: _T.PRE_BACKWARD, **_same(_T.PRE_BACKWARD, _T.POST_BACKWARD)},
    "post_backward": _same(_T.IDLE, _T.PRE_BACKWARD, _T.POST_BACKWARD),
    "last post_backward": {s: _T.POST_BACKWARD for s in (_T.IDLE, _T.PRE_BACKWARD, _T.POST_BACKWARD)},
    "end_of_backward": _all(TrainingState, _T.IDLE),
    "reset_iter_state": _all(TrainingState, _T.IDLE),
}, {
    "pre_forward": _UNFINISHED,
    "post_forward": _UNFINISHED,
    "pre_backward": "a gradient reached the unit's output while its forward runs: run backward after the forward",
    "post_backward": ("the unit's parameters got gradients while its forward runs (a backward over them inside "
                      "the forward): fully_shard reduces a unit's gradients once, after its forward"),
    "last post_backward": ("the unit's parameters got gradients while its forward runs (a backward over them "
                           "inside the forward): fully_shard reduces a unit's gradients once, after its forward"),
})

_U = UnitState
PARAMS: Table[UnitState] = Table("parameters", {
    "start_gather": {_U.SHARDED: _U.GATHERING, _U.SHARDED_POST_FORWARD: _U.GATHERING,
                     **_same(_U.GATHERING, _U.UNSHARDED)},
    "unshard": _all(UnitState, _U.UNSHARDED),
    "reshard_to_small_group": {_U.UNSHARDED: _U.SHARDED_POST_FORWARD, _U.GATHERING: _U.SHARDED_POST_FORWARD,
                               **_same(_U.SHARDED, _U.SHARDED_POST_FORWARD)},
    "reshard": _all(UnitState, _U.SHARDED),
    "abandon": _all(UnitState, _U.SHARDED),
    "views": _same(_U.UNSHARDED),
}, {
    "views": "the forward computes with the unsharded parameters: unshard() the unit first",
})


def advance(owner: str, table: Table[S], state: S, call: str) -> S:
    """The state `call` leads `owner` to from `state`, or a `TransitionError` naming all three."""
    row = table.moves[call]
    to = row.get(state)
    if to is None:
        allowed = ", ".join(s.name for s in row)
        fix = table.fixes.get(call)
        raise TransitionError(f"{owner}: {call} in {table.what} {state.name} (allowed in {allowed})"
                              + (f": {fix}" if fix else ""))
    return to
