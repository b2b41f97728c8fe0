"""What runs around a sharded module's forward and backward, and what one root's units share.

Per `fully_shard` call there is one `FSDPState` (its modules, its unit, its options) and
per model one `Root`: the first state whose forward runs becomes the root at that moment
(lazily, as in torch) and takes every state below it. Per step:

| moment | what the state does |
|---|---|
| pre-forward | gather the unit (waiting for a prefetch), put the compute views where the module reads them, start gathering the next unit in forward order, cast inputs |
| post-forward | take the views away, reshard (unless told not to; never during a recomputation inside backward), hook the outputs for pre-backward, cast outputs |
| pre-backward (the first gradient reaching an output) | gather the unit again if it was resharded, start gathering the previous unit |
| post-backward (the unit's `_UnitGrad` node) | finish the previous unit's reduction, start this one's, reshard |
| end of backward (the end-of-backward registry's `units` phase, armed once per pass) | finish every reduction, reshard what is left, reset per-step state |

Where a state is in the step is one `TrainingState` (IDLE, FORWARD, PRE_BACKWARD,
POST_BACKWARD), moved by the table in `_lifecycle`: a hook that meets a state its row does
not allow (a forward after a backward that raised and was not reset) raises, naming the unit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .._tensor import Step, arm, disarm
from ._lifecycle import TRAINING, TrainingState, advance
from ._param import UnitParam
from ._policy import MixedPrecisionPolicy
from ._reduce import Reduction
from ._unit import Unit

__all__ = ["FSDPState", "Root", "STATE_ATTR", "reduce_accumulated", "snapshot", "state_of"]

STATE_ATTR = "_shardwise_fsdp_state"
_IN_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)  # its backward has begun: no prefetch


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Root(Step):
    """The units of one model: their forward order (for prefetch), pending reductions, the end of
    backward (a step of the end-of-backward registry's first phase, `units`)."""

    phase = "units"

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self.order: list[FSDPState] = []  # states with a unit, in the order their forward first ran
        self.recording = True
        self.index: dict[FSDPState, int] = {}
        self.pending: list[Reduction] = []

    def ran(self, state: FSDPState) -> None:
        if self.recording and state.unit is not None and state not in self.order:
            self.order.append(state)

    def stop_recording(self) -> None:
        self.recording = False
        self.index = {state: i for i, state in enumerate(self.order)}

    def neighbour(self, state: FSDPState, step: int) -> list[FSDPState]:
        """The unit `step` places after `state` in forward order (none while the order is being learnt)."""
        i = self.index.get(state)
        if i is None or not 0 <= i + step < len(self.order):
            return []
        return [self.order[i + step]]

    def finish_reductions(self) -> None:
        pending, self.pending = self.pending, []
        for reduction in pending:
            reduction.finish()

    def queue_end_of_backward(self) -> None:
        if _in_backward():
            arm(self)

    def finish(self) -> None:
        self.end_of_backward()

    def end_of_backward(self) -> None:
        self.finish_reductions()
        for state in self.states:
            state.end_step("end_of_backward")
            if state.unit is not None and state.reshard_after_backward:
                state.unit.reshard()

    def reset(self) -> None:
        """Forget a failed step: drop pending reductions and in-flight gathers, reshard every unit."""
        self.pending = []
        disarm(self)
        for state in self.states:
            state.end_step("reset_iter_state")
            if state.unit is not None:
                state.unit.abandon()


class FSDPState:
    """One `fully_shard` call: its modules, its unit (None when it took no parameters), its options."""

    def __init__(self, modules: list[nn.Module], unit: Optional[Unit], mp: MixedPrecisionPolicy,
                 reshard_after_forward: Union[bool, int], auto_reshard: bool) -> None:
        self.modules = modules
        self.unit = unit
        self.mp = mp
        self.reshard_after_forward: Union[bool, int] = reshard_after_forward
        self.auto_reshard = auto_reshard
        self.reshard_after_backward = True
        self.reshard_after_no_grad_forward = False  # data_parallel's root: no backward will free it
        self.root: Optional[Root] = None
        self.is_root = False
        self.training = TrainingState.IDLE
        self.open_nodes = 0  # _UnitGrad nodes of this step whose backward has not run
        self.forward_prefetch: Optional[list[FSDPState]] = None
        self.backward_prefetch: Optional[list[FSDPState]] = None
        self.is_last_backward = True
        self.handles: list[Any] = []
        # per module: (parameter index, owner, attribute) of every place inside it a parameter is read
        self.slots: dict[nn.Module, list[tuple[int, nn.Module, str]]] = {}
        if unit is not None:
            unit.on_backward = self.post_backward
            for module in modules:
                inside = set(module.modules())
                self.slots[module] = [(i, owner, attr) for i, p in enumerate(unit.params)
                                      for owner, attr in p.owners if owner in inside]

    # -- state --------------------------------------------------------------------------
    def _move(self, call: str) -> TrainingState:
        """Take the training state `call` leads to (`_lifecycle.TRAINING`); returns the one before."""
        name = self.unit.registrant if self.unit is not None else f"fully_shard of {type(self.modules[0]).__name__}"
        before, self.training = self.training, advance(name, TRAINING, self.training, call)
        return before

    def end_step(self, call: str) -> None:
        """The end of a backward pass or of a failed step (`call`): IDLE, no node open, no views."""
        self._move(call)
        self.open_nodes = 0
        self._uninstall()

    # -- root ---------------------------------------------------------------------------
    def lazy_init(self) -> None:
        states: list[FSDPState] = []
        for module in self.modules:
            for sub in module.modules():
                found = state_of(sub)
                if found is not None and found not in states:
                    states.append(found)
        root = Root(states)
        for state in states:
            if state.root is None:
                state.root = root
        self.is_root = True
        if self.auto_reshard:
            self.reshard_after_forward = False

    # -- forward ------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.root is None:
            self.lazy_init()
        root = self.root
        assert root is not None
        recomputing = _in_backward()
        if not recomputing:  # a forward recomputed inside backward moves no state
            self._move("pre_forward")
        if self.is_root and not recomputing and root.recording and root.order:
            root.stop_recording()  # the second forward of the root: the order is known
        if self.unit is not None:
            self.unit.unshard()
            views = self.unit.views()
            if not recomputing and torch.is_grad_enabled():
                self.open_nodes += 1
            for i, owner, attr in self.slots[module]:
                owner.__dict__[attr] = views[i]
        if not recomputing:
            root.ran(self)
            for target in self.forward_prefetch if self.forward_prefetch is not None else root.neighbour(self, 1):
                if target.unit is not None:
                    target.unit.start_gather()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not _in_backward():
            self._move("post_forward")
        if self.unit is not None:
            for _, owner, attr in self.slots[module]:
                owner.__dict__.pop(attr, None)
            keep = self.reshard_after_forward is False and not (
                self.reshard_after_no_grad_forward and not torch.is_grad_enabled())
            if not _in_backward() and not keep:
                if isinstance(self.reshard_after_forward, bool) or self.unit.small is None:
                    self.unit.reshard()
                else:  # an int: keep this rank's piece of a smaller group, gathered over it in backward
                    self.unit.reshard_to_small_group()
        if not _in_backward() and torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self.pre_backward)  # type: ignore[no-untyped-call]
        if self.mp.output_dtype is not None:
            output = _cast(output, self.mp.output_dtype)
        return output

    # -- backward -----------------------------------------------------------------------
    def pre_backward(self, grad: torch.Tensor) -> None:
        if self._move("pre_backward") is not TrainingState.IDLE:
            return  # a later output's gradient: the unit's backward has begun
        root = self.root
        assert root is not None
        root.queue_end_of_backward()
        if self.unit is not None:
            self.unit.unshard()
            # a checkpointed region recomputed inside the module's own forward reads the
            # parameters without calling the module: put views where it reads them until the
            # unit's backward is over (tracked, so a reentrant recomputation's gradients reach the unit)
            with torch.enable_grad():
                views = self.unit.views()
            self._install(views)
        for target in self.backward_prefetch if self.backward_prefetch is not None else root.neighbour(self, -1):
            if target.unit is not None and target.training not in _IN_BACKWARD:
                target.unit.start_gather()

    def post_backward(self, params: list[UnitParam], grads: Sequence[Optional[torch.Tensor]]) -> None:
        root = self.root
        assert root is not None and self.unit is not None
        root.queue_end_of_backward()
        root.finish_reductions()  # the previous unit's gradient buffer goes before this one's is made
        self.open_nodes = max(self.open_nodes - 1, 0)
        self._move("post_backward" if self.open_nodes else "last post_backward")
        if self.open_nodes == 0:  # freed before the reduction allocates, as FSDP2 orders it
            self._uninstall()
            if self.reshard_after_backward:
                self.unit.reshard()
        root.pending.extend(self.unit.reduce(params, grads))

    def _install(self, views: list[torch.Tensor]) -> None:
        for slots in self.slots.values():
            for i, owner, attr in slots:
                owner.__dict__[attr] = views[i]

    def _uninstall(self) -> None:
        for slots in self.slots.values():
            for _, owner, attr in slots:
                owner.__dict__.pop(attr, None)


def snapshot(modules: Sequence[nn.Module]) -> Callable[[], None]:
    """A function that puts every unit state under `modules` back as it is now: which is root,
    where it is in the step, the forward order learnt (a dry run replays one step per simulated
    rank, each as the first, even after one whose step raised)."""
    states = {s for m in modules for sub in m.modules() if (s := state_of(sub)) is not None}
    saved = [(s, s.root, s.is_root, s.reshard_after_forward, s.training) for s in states]
    roots = {s.root for s in states if s.root is not None}
    learnt = [(r, list(r.order), r.recording, dict(r.index)) for r in roots]

    def restore() -> None:
        for s, root, is_root, reshard, training in saved:
            s.root, s.is_root, s.reshard_after_forward, s.training = root, is_root, reshard, training
        for r, order, recording, index in learnt:
            r.order, r.recording, r.index = list(order), recording, dict(index)

    return restore


def reduce_accumulated(module: nn.Module) -> None:
    """End a step whose backward passes summed gradients with sync off (a pipeline schedule's, one
    pass per micro-batch; `set_requires_gradient_sync(False)`): with sync back on, every unit
    under `module` runs the reduction its post-backward would (one reduce_scatter of its sum),
    then each root ends the backward (finishes them; reshards where `reshard_after_backward`).
    The units stay their parameters' reducers: this only says when they reduce."""
    states = list({id(s): s for sub in module.modules() if (s := state_of(sub)) is not None}.values())
    roots: list[Root] = []
    for state in states:
        root, unit = state.root, state.unit
        if root is None:  # no forward ran: nothing summed
            continue
        if unit is not None and any(p.unsynced is not None for p in unit.params):
            root.pending.extend(unit.reduce(unit.params, [None] * len(unit.params)))
        if root not in roots:
            roots.append(root)
    for root in roots:
        root.end_of_backward()


def state_of(module: nn.Module) -> Optional[FSDPState]:
    found = module.__dict__.get(STATE_ATTR)
    return found if isinstance(found, FSDPState) else None


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
