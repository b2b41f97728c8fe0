"""`DTensor`: a `torch.Tensor` whose data is spread over a device mesh by a layout.

It is a wrapper subclass: the outer tensor carries the global shape, dtype and autograd
state; `_local_tensor` holds this rank's piece and `_spec` the layout. Every aten op on
it goes through `__torch_dispatch__` (see `_dispatch.py`). Torch function is off, except
on a tensor whose layout splits a batch dim of 3 or more dims (`_SplitBatchDTensor`): there
linear and matmul are caught before they decompose, to keep the split (see `_local_linear.py`).

`from_local`, `to_local`, `redistribute` and `full_tensor` are autograd functions, so a
DTensor can live in only part of a model: gradients that flow through them are the
single-device gradients, redistributed to the layout each side expects.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .. import _comm as comm
from .._layout import ShardOrderLike, normalize_placements, normalize_shard_order
from .._mesh import DeviceMesh
from .._ops._utils import order_like
from .._partition_spec import PartitionEntry, from_placements
from .._placement import Partial, Placement, Replicate
from .._spec import DTensorSpec
from ._async import Pending, adopt, redistribute_async, resolve
from ._grad_reduce import note_accumulated
from ._redistribute import redistribute_local

__all__ = ["DTensor", "class_for"]

_make_wrapper = torch.Tensor._make_wrapper_subclass


class DTensor(torch.Tensor):
    """A distributed tensor: global metadata outside, this rank's piece inside."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    # No __slots__: `torch.utils.swap_tensors` (how `spmd.mark_sharding` turns an existing
    # nn.Parameter into a DTensor in place) only swaps objects whose classes have the same slots.

    # Torch function is off for a DTensor (no Python call before every op and property
    # access); only a layout that a composite linear / matmul would lose gets the subclass
    # below, whose `__torch_function__` routes those calls to `_local_linear`.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
        if cls is DTensor:
            cls = class_for(spec)
        meta = spec.tensor_meta
        r = _make_wrapper(
            cls,
            meta.shape,
            strides=meta.stride,
            dtype=meta.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh!r}, "
            f"placements={self._spec.placements})"
        )

    # -- layout --------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        mesh = self._spec.mesh
        assert isinstance(mesh, DeviceMesh)
        return mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def shard_order(self) -> dict[int, tuple[int, ...]]:
        """Tensor dim -> mesh dims that split it, outermost first (sharded dims only)."""
        return self._spec.split_orders()

    @property
    def partition_spec(self) -> tuple[PartitionEntry, ...]:
        """The layout as a partition spec: per tensor dim, the mesh dims that split it (by name
        when the mesh has names), major to minor; `None` where not split. A `Partial` mesh dim
        has no partition spec: ValueError."""
        return from_placements(self._spec.placements, self._spec.shard_order, self._spec.mesh.mesh_dim_names, self._spec.ndim)

    # -- conversions ---------------------------------------------------------------
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        run_check: bool = False,
        shape: Optional[Sequence[int]] = None,
        stride: Optional[Sequence[int]] = None,
        shard_order: ShardOrderLike = None,
    ) -> DTensor:
        """Wrap this rank's piece as a DTensor (differentiable; see `shardwise.from_local`)."""
        from ._api import from_local

        return from_local(
            local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride, shard_order=shard_order
        )

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:
        """As `torch.Tensor.requires_grad_`; a leaf that requires grad also gets its gradient in
        its own layout, reduced once per backward (see `_grad_reduce`). `nn.Parameter(dtensor)`
        comes through here."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.grad_fn is None:
            hooks = self._post_accumulate_grad_hooks
            if not hooks or note_accumulated not in hooks.values():
                self.register_post_accumulate_grad_hook(note_accumulated)  # type: ignore[no-untyped-call]
        return self

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """This rank's piece as a plain tensor (differentiable).

        `grad_placements` declares the layout of the gradient that will flow back into the
        returned tensor (default: this tensor's placements).
        """
        if type(self._local_tensor) is Pending:
            self._local_tensor.wait()  # hand out the arrived piece, not a placeholder
        if not torch.is_grad_enabled():
            return self._local_tensor
        grad_spec = self._spec
        if grad_placements is not None:
            pl = normalize_placements(grad_placements, self._spec.mesh.ndim, self.ndim, what="grad_placements")
            # this tensor's split order holds for the dims the gradient splits the same way
            grad_spec = self._spec.with_placements(pl, order_like(pl, self._spec))
        return _ToLocal.apply(self, grad_spec)  # type: ignore[no-untyped-call,no-any-return]

    def redistribute(
        self,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        async_op: bool = False,
        shard_order: ShardOrderLike = None,
    ) -> DTensor:
        """This tensor in another layout, moved with the fewest bytes (see `explain_redistribute`).

        Redistributing to `Partial` is refused (it is the result of ops, not a target), except
        that a mesh dim already `Partial` may stay so.

        `async_op=True` returns at once: the collectives run in the background, in program order
        with every other collective, and the first op that uses the result waits for it (compute
        issued in between overlaps the communication). The backward runs synchronously, and so
        does everything inside `shardwise.compile`'s trace.
        """
        spec = self._spec
        if device_mesh is not None and device_mesh != spec.mesh:
            raise NotImplementedError(
                f"redistribute across meshes ({spec.mesh!r} -> {device_mesh!r}) is not supported yet: "
                f"use full_tensor() and distribute_tensor() onto the new mesh"
            )
        if placements is None:
            placements = spec.placements
        target = normalize_placements(placements, spec.mesh.ndim, self.ndim)
        for i, (old, new) in enumerate(zip(spec.placements, target)):
            if isinstance(new, Partial) and new != old:
                raise ValueError(
                    f"cannot redistribute {spec.layout_str()} to {new} on mesh dim {i}: Partial is produced by "
                    f"ops (e.g. a sharded contraction), not requested; use Replicate() or Shard(dim)"
                )
        order = normalize_shard_order(target, shard_order, self.ndim)
        target_spec = spec.with_placements(target, order)
        if target_spec == spec:
            return self
        return _Redistribute.apply(self, target_spec, async_op and not comm.must_be_synchronous())  # type: ignore[no-untyped-call,no-any-return]

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable)."""
        replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)


def _grad_target(spec: DTensorSpec) -> DTensorSpec:
    """Layout a gradient must take to flow back to an input of layout `spec`.

    The gradient of every term of a Partial sum is the full gradient, so Partial -> Replicate.
    """
    if not spec.has_partial():
        return spec
    return spec.with_placements(
        tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements), spec.shard_order
    )


def _grad_to(grad: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """Local piece of `grad` (a DTensor) in the layout `spec` wants."""
    assert isinstance(grad, DTensor)
    target = _grad_target(spec)
    return redistribute_local(resolve(grad._local_tensor), grad._spec, target)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: DTensor, target: DTensorSpec, async_op: bool = False) -> DTensor:
        ctx.src_spec = x._spec
        if async_op:
            pending = redistribute_async(x._local_tensor, x._spec, target)
            out = DTensor(pending, target, requires_grad=x.requires_grad)
            adopt(pending, out)
            return out
        local = redistribute_local(resolve(x._local_tensor), x._spec, target)
        return DTensor(local, target, requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Optional[DTensor], None, None]:
        spec = _grad_target(ctx.src_spec)
        local = _grad_to(grad, ctx.src_spec)
        return DTensor(local, spec, requires_grad=False), None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: DTensor, grad_spec: DTensorSpec) -> torch.Tensor:
        ctx.grad_spec = grad_spec
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        if isinstance(grad, DTensor):
            # the local tensor went on as a plain tensor counted as replicated (implicit
            # replication): its gradient is a DTensor whose full value is this rank's piece's
            grad = grad.full_tensor()
        return DTensor(grad, ctx.grad_spec, requires_grad=False), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
        ctx.spec = spec
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None]:
        # each rank's piece is one term of a Partial: a Partial("avg") over n ranks counts
        # it 1/n, so its gradient is the full gradient / n (a "sum" term's is the full one)
        spec = ctx.spec
        local = _grad_to(grad, spec)
        n = math.prod(size for size, p in zip(spec.mesh.shape, spec.placements)
                      if isinstance(p, Partial) and p.reduce_op == "avg")
        return (local / n if n > 1 else local), None


class _SplitBatchDTensor(DTensor):
    """A DTensor of 3 or more dims split along a dim other than the last: linear and matmul
    on it must not decompose (see `_local_linear`), so torch function is on for it alone."""

    @classmethod
    def __torch_function__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        try:
            handler = _TORCH_FUNCTION_HANDLERS.get(func)
        except TypeError:  # an unhashable callable: never one of ours
            handler = None
        if handler is not None:
            out = handler(args, kwargs or {})
            if out is not NotImplemented:
                return out
        # every other call runs exactly as with torch function disabled
        return _disabled_torch_function(func, types, args, kwargs or {})


# spec -> the class a DTensor of that layout gets (only specs of 3 or more dims are cached)
_CLASSES: dict[DTensorSpec, type[DTensor]] = {}


def class_for(spec: DTensorSpec) -> type[DTensor]:
    """`_SplitBatchDTensor` for a layout whose split batch dim a composite linear would lose."""
    n = len(spec.tensor_meta.shape)
    if n < 3:
        return DTensor
    try:
        return _CLASSES[spec]
    except KeyError:
        split_batch = any(d != n - 1 for d in spec.split_orders())
        cls = _CLASSES[spec] = _SplitBatchDTensor if split_batch else DTensor
        return cls


from ._dispatch import dispatch as _dispatch  # noqa: E402  (dispatch needs DTensor defined)
from ._local_linear import TORCH_FUNCTION_HANDLERS as _TORCH_FUNCTION_HANDLERS  # noqa: E402

_disabled_torch_function = torch._C._disabled_torch_function_impl
