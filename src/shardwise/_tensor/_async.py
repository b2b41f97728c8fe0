"""`redistribute(async_op=True)`: the collectives run in the background; the first use waits.

A plan of one collective (most are) is issued at once with the process group's own
`async_op`; a longer plan runs on `_comm`'s worker thread (`run_async`), which keeps
collectives in program order on every rank. The returned DTensor's local piece is a `_Pending` tensor: it knows
its shape, dtype and device, and any op that reaches it waits for the collective and runs
on the arrived piece. After that wait the DTensor holds the arrived piece itself, so later
ops pay nothing. Compute issued between the redistribute and the first use overlaps the
communication:

    y = x.redistribute(mesh, [Replicate()], async_op=True)  # returns at once
    h = other @ weight                                        # runs while y travels
    out = y + h                                               # waits for y here
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Any, Optional, Union

import torch
import torch.utils._pytree as pytree

from .. import _comm
from .._spec import DTensorSpec
from ._cross import move_local
from ._redistribute import start_redistribute

__all__ = ["Pending", "adopt", "redistribute_async", "resolve"]


class Pending(torch.Tensor):
    """A local piece still arriving; any op on it waits for it first."""

    _future: Union[Future[torch.Tensor], _comm.Started]
    _owner: Optional[weakref.ref[Any]]

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, future: Union[Future[torch.Tensor], _comm.Started], shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> Pending:
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        r._future = future
        r._owner = None
        return r

    def wait(self) -> torch.Tensor:
        """The arrived piece (raises what the collective raised); the owning DTensor keeps it."""
        local = self._future.result()
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner._local_tensor is self:
            owner._local_tensor = local
        return local

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        args, kwargs = pytree.tree_map_only(Pending, Pending.wait, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        state = "arrived" if self._future.done() else "in flight"
        return f"Pending(shape={tuple(self.shape)}, dtype={self.dtype}, {state})"


def resolve(local: torch.Tensor) -> torch.Tensor:
    """`local` itself, or the arrived piece if it is still pending."""
    return local.wait() if type(local) is Pending else local


def redistribute_async(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> Pending:
    """Start moving `local` from `src` to `dst`.

    A plan of one collective is issued here with the process group's own `async_op` (no
    thread of ours in between); a longer plan runs on `_comm`'s worker thread."""
    coordinate = dst.mesh.get_coordinate()  # type: ignore[attr-defined]
    if coordinate is not None:
        shape = dst.local_shape_and_offset(coordinate)[0]
    else:
        shape = tuple(local.shape) if src.mesh == dst.mesh else (() if dst.ndim == 0 else (0,))
    started = start_redistribute(resolve(local), src, dst) if src.mesh == dst.mesh else None
    if started is not None:
        return Pending(started, shape, local.dtype, local.device)

    def run() -> torch.Tensor:
        return move_local(resolve(local), src, dst)

    return Pending(_comm.run_async(run), shape, local.dtype, local.device)


def adopt(pending: Pending, owner: Any) -> None:
    """Let `owner` (the DTensor holding `pending`) keep the arrived piece after the first wait."""
    pending._owner = weakref.ref(owner)
