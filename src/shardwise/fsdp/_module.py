"""`FSDPModule`: the methods a module gains from `fully_shard` (its class becomes `FSDP<Orig>`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional, Union

from torch import nn

from .._describe import describe
from ._state import FSDPState, state_of
from ._unit import Unit

__all__ = ["FSDPModule", "UnshardHandle", "fsdp_class"]

_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """`FSDP<cls>`: FSDPModule first in the method order, then the module's own class (one per class)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return made


class UnshardHandle:
    """An explicit `unshard(async_op=True)`: `wait()` finishes the unit's all_gather and registers
    the unsharded parameters. The module's next forward finishes it too when nobody waited;
    a `wait()` after that reshard (or after `reshard()`) does nothing, as under torch."""

    def __init__(self, unit: Optional[Unit]) -> None:
        self._unit = unit

    def wait(self) -> None:
        unit, self._unit = self._unit, None
        if unit is not None and unit.requested:
            unit.unshard()


class FSDPModule:
    """Methods of a module `fully_shard` was applied to; `recurse=True` applies to every
    FSDP module under it as well."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # a container that builds a new one of its own class (nn.Sequential slicing) gets the original class
        orig = next(c for c in cls.__mro__ if c is not FSDPModule and not issubclass(c, FSDPModule))
        made = orig.__new__(orig)
        made.__init__(*args, **kwargs)  # type: ignore[misc]
        return made

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            f"copy.deepcopy({type(self).__name__}): a module given to fully_shard cannot be copied (its units hold "
            f"process groups and freed unsharded storage): deep-copy the model before fully_shard, or copy its "
            f"state_dict() into a new model"
        )

    def _fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise ValueError(f"{type(self).__name__} has no fully_shard state")
        return state

    def _fsdp_states(self, recurse: bool) -> Iterator[FSDPState]:
        if not recurse:
            yield self._fsdp_state()
            return
        seen: set[int] = set()
        for sub in self.modules():  # type: ignore[attr-defined]
            state = state_of(sub)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                yield state

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's unit now (not recursive) and register its unsharded parameters on
        the modules: `module.weight` is the whole weight (a plain `nn.Parameter`; the tp DTensor
        under tensor parallelism) until `reshard()` or the reshard after the module's forward.
        With `async_op=True` return a handle whose `wait()` finishes the gather, so it overlaps
        what runs in between; the parameters are registered at `wait()`."""
        unit = self._fsdp_state().unit
        if unit is not None:
            unit.request()
            unit.start_gather()
        if async_op:
            return UnshardHandle(unit)
        if unit is not None:
            unit.unshard()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones again (not recursive)."""
        unit = self._fsdp_state().unit
        if unit is not None:
            unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps each unit's gradients unsharded and unreduced (summing over
        micro-steps); the next backward with True reduces the sum. For gradient accumulation."""
        _check_bool("set_requires_gradient_sync", requires_gradient_sync)
        for state in self._fsdp_states(recurse):
            if state.unit is not None:
                state.unit.sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients but leaves the all_reduce over the replicate dim for later."""
        _check_bool("set_requires_all_reduce", requires_all_reduce)
        for state in self._fsdp_states(recurse):
            if state.unit is not None:
                state.unit.all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _check_bool("set_reshard_after_forward", reshard_after_forward)
        for state in self._fsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            state.auto_reshard = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _check_bool("set_reshard_after_backward", reshard_after_backward)
        for state in self._fsdp_states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' units when this module's forward starts (instead of the next in forward order)."""
        self._fsdp_state().forward_prefetch = _states("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' units when this module's backward starts (instead of the previous in forward order)."""
        self._fsdp_state().backward_prefetch = _states("set_modules_to_backward_prefetch", modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by `factor` instead of the number of data-parallel
        ranks (this module's unit only, as torch's: call it on each FSDP module)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor({factor!r}): a positive number (default: the dp size)")
        unit = self._fsdp_state().unit
        if unit is not None:
            unit.divide_factor = float(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        _check_bool("set_is_last_backward", is_last_backward)
        for state in self._fsdp_states(True):
            state.is_last_backward = is_last_backward

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: forget the failed step (its gradients are dropped)
        so the next step runs as if it never happened. Call it on the root."""
        state = self._fsdp_state()
        if state.root is not None:
            state.root.reset()


def _check_bool(where: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}({value!r}): True or False")


def _states(where: str, modules: Union[list[FSDPModule], Any]) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"{where} takes a list of FSDP modules, got {describe(modules)}")
    out = []
    for i, m in enumerate(modules):
        state = state_of(m) if isinstance(m, nn.Module) else None
        if state is None:
            raise ValueError(f"{where}: modules[{i}] ({type(m).__name__}) was not given to fully_shard")
        out.append(state)
    return out
