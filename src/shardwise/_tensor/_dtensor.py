"""`DTensor`: a `torch.Tensor` whose data is spread over a device mesh by a layout.

It is a wrapper subclass (`_wrap.DTensorBase`): the outer tensor carries the global shape,
dtype and autograd state; `_local_tensor` holds this rank's piece and `_spec` the layout.
Every aten op on it goes through `__torch_dispatch__` (see `_dispatch`). Torch function is
off, except on a tensor whose layout splits a batch dim of 3 or more dims
(`_SplitBatchDTensor`): there linear and matmul are caught before they decompose, to keep
the split (see `_local_linear`).

`from_local`, `to_local`, `redistribute` and `full_tensor` are differentiable (`_autograd`),
so a DTensor can live in only part of a model: gradients that flow through them are the
single-device gradients, redistributed to the layout each side expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, cast

import torch

from .. import _comm as comm
from .._describe import refuse_torch
from .._layout import ShardOrder, ShardOrderLike, normalize_placements, normalize_shard_order
from .._mesh import DeviceMesh
from .._mesh import as_device_mesh
from .._ops import order_like
from .._partition_spec import PartitionEntry, from_placements
from .._placement import Partial, Placement, Replicate, check_reduce_dtype
from .._spec import DTensorSpec, TensorMeta
from . import _api, _dcp
from ._async import Pending
from ._autograd import Redistribute, to_local
from ._dispatch import torch_dispatch
from ._foreign import FIX, refuse_torch_fsdp
from ._grad_reduce import note_accumulated
from ._local_linear import TORCH_FUNCTION_HANDLERS
from ._wrap import DTensorBase, wrap

__all__ = ["DTensor"]


class DTensor(DTensorBase, role="plain"):
    """A distributed tensor: global metadata outside, this rank's piece inside. Made by
    `distribute_tensor`, `DTensor.from_local`, the factories, and every op on DTensors."""

    # Torch function stays off; only a layout that a composite linear / matmul would lose
    # gets the subclass below, whose `__torch_function__` routes those calls to
    # `_local_linear`. (Set here too, not only inherited: torch finds it faster on the class itself.)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
        """This rank's piece and the layout, as a DTensor (no checks, no communication: prefer
        `DTensor.from_local` or `distribute_tensor`); the class follows the layout (`wrap`)."""
        return wrap(local_tensor, spec, requires_grad)  # type: ignore[no-any-return]

    # every aten op on a DTensor: `_dispatch.torch_dispatch` (bound directly: no call in between)
    __torch_dispatch__ = classmethod(torch_dispatch)  # type: ignore[assignment,var-annotated]

    # -- the wrapper-subclass protocol ----------------------------------------------------
    # With these two, torch treats a DTensor as a wrapper of one inner tensor: `module.to(dtype)`,
    # `module.to_empty()` and `module.double()` swap whole parameters (`torch.utils.swap_tensors`)
    # instead of setting `param.data`, which would change the wrapper's dtype and leave the piece.
    def __tensor_flatten__(self) -> tuple[list[str], tuple[DTensorSpec, bool]]:
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], context: tuple[DTensorSpec, bool],
                             outer_size: Any, outer_stride: Any) -> DTensor:
        spec, requires_grad = context
        local = inner["_local_tensor"]
        meta = spec.tensor_meta
        if local.dtype != meta.dtype or tuple(outer_size) != tuple(meta.shape) or tuple(outer_stride) != tuple(meta.stride):
            spec = spec.with_meta(TensorMeta(torch.Size(outer_size), tuple(outer_stride), local.dtype))
        return wrap(local, spec, requires_grad)  # type: ignore[no-any-return]

    def __coerce_same_metadata_as_tangent__(self, flatten_spec: tuple[DTensorSpec, bool],
                                            expected_type: Optional[type] = None) -> Optional[DTensor]:
        """A compiled backward traced its incoming gradient in the layout of the output it is the
        gradient of; one that arrives in another layout (a Replicate gradient for a Partial
        output) is moved to that layout, as torch's DTensor does."""
        if expected_type is not None:
            return None
        spec = flatten_spec[0]
        if spec.placements == self._spec.placements:
            return self
        return self.redistribute(placements=spec.placements)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as its piece and its layout (`torch.save(dtensor)`, a state dict of them);
        the mesh is found again by its ranks on load (see `DeviceMesh.__reduce__`)."""
        return (_api.rebuild, (self._local_tensor, self._spec, self.requires_grad))

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh!r}, "
            f"placements={self._spec.placements})"
        )

    # -- layout --------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        # a DTensor is made on a DeviceMesh (from_local and distribute_tensor check it) and
        # every op keeps its inputs' mesh; only planning uses specs on abstract meshes
        return cast(DeviceMesh, self._spec.mesh)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def shard_order(self) -> ShardOrder:
        """The split order where it is not mesh-dim order: `((tensor dim, (mesh dims, outermost
        first)), ...)`, `()` when every split tensor dim follows mesh-dim order. It is what
        `shard_order=` takes (`redistribute(..., shard_order=x.shard_order)` keeps it); the
        full map, every split tensor dim included, is `x._spec.split_orders()`."""
        return self._spec.shard_order

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
        return _api.from_local(
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
        grad_spec = self._spec
        if grad_placements is not None:
            pl = normalize_placements(grad_placements, self._spec.mesh.ndim, self.ndim, what="grad_placements")
            # this tensor's split order holds for the dims the gradient splits the same way
            grad_spec = self._spec.with_placements(pl, order_like(pl, self._spec))
        return to_local(self, grad_spec)

    def redistribute(
        self,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        async_op: bool = False,
        shard_order: ShardOrderLike = None,
        forward_dtype: Optional[torch.dtype] = None,
        backward_dtype: Optional[torch.dtype] = None,
    ) -> DTensor:
        """This tensor in another layout, moved with the fewest bytes (see `explain_redistribute`).

        `device_mesh` other than this tensor's mesh moves it there (any two meshes: disjoint,
        overlapping, the same ranks in another shape or order; `placements` are then for the
        new mesh): Partials are reduced on this mesh, then each rank sends every rank of the
        new mesh the part of its piece that rank needs and does not hold, point to point;
        ranks in neither mesh do nothing. Every rank of either mesh must call it.

        `forward_dtype`: cast the piece to it before moving (the result has that dtype, and
        the collectives move its bytes); `backward_dtype`: the gradient travels back in it and
        is cast to this tensor's dtype on arrival (mixed-precision communication, as torch).

        To `Partial(op)`, every op `Partial` takes, from any layout: the value is gathered if
        split (a `Partial` of another op reduced first), then turned into terms with no
        communication. The terms reduce to the value exactly: for `sum`, `bxor` the first rank
        along the mesh dim holds the value and the others 0, for `prod` the others 1, for `avg`,
        `max`, `min`, `band`, `bor` every rank holds it. (torch's `redistribute` refuses a
        `Partial` target; its `distribute_tensor` divides by n for `sum`.)

        `async_op=True` returns at once: the collectives run in the background, in program order
        with every other collective, and the first op that uses the result waits for it (compute
        issued in between overlaps the communication). The backward runs synchronously, and so
        does everything inside `shardwise.compile`'s trace.
        """
        spec = self._spec
        mesh = spec.mesh if device_mesh is None else as_device_mesh(device_mesh)
        if not isinstance(mesh, DeviceMesh):
            refuse_torch(mesh, "redistribute(device_mesh=...)")
            raise TypeError(f"redistribute(device_mesh=...) takes a DeviceMesh, got {mesh!r} of type "
                            f"{type(mesh).__name__}: pass the target mesh (shardwise.DeviceMesh or init_device_mesh), "
                            "or leave it out to stay on this tensor's mesh")
        if placements is None:
            if mesh.ndim != spec.mesh.ndim:
                raise ValueError(
                    f"redistribute onto mesh {tuple(mesh.shape)} from mesh {tuple(spec.mesh.shape)} needs placements "
                    f"for the new mesh ({mesh.ndim} of them): the current {spec.layout_str()} has one per old mesh dim"
                )
            placements = spec.placements
        target = normalize_placements(placements, mesh.ndim, self.ndim)
        check_reduce_dtype(target, forward_dtype or spec.dtype, "redistribute")
        if mesh != spec.mesh and any(isinstance(p, Partial) for p in target):
            # onto the new mesh with those mesh dims replicated, then into terms there
            whole = [Replicate() if isinstance(p, Partial) else p for p in target]
            moved = self.redistribute(mesh, whole, async_op=async_op, shard_order=shard_order,
                                      forward_dtype=forward_dtype, backward_dtype=backward_dtype)
            return moved.redistribute(mesh, target, async_op=async_op, shard_order=shard_order)
        order = normalize_shard_order(target, shard_order, self.ndim)
        target_spec = DTensorSpec(mesh, target, spec.tensor_meta, order)
        if forward_dtype is not None and forward_dtype != spec.dtype:
            target_spec = target_spec.with_meta(spec.tensor_meta._replace(dtype=forward_dtype))
        if target_spec == spec and backward_dtype is None:
            return self
        return Redistribute.apply(  # type: ignore[no-untyped-call,no-any-return]
            self, target_spec, async_op and not comm.must_be_synchronous(), backward_dtype)

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable)."""
        try:
            replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        except comm.CollectiveError as exc:
            raise exc.add_operation(f"full_tensor of a {list(self.shape)} DTensor")
        return replicated.to_local(grad_placements=grad_placements)

    # -- torch's distributed checkpoint: the boxes of the global tensor this rank holds (see `_dcp`)
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        return _dcp.write_items(self, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        return _dcp.chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return _dcp.tensor_shard(self, index)

    # -- torch's own fully_shard ---------------------------------------------------
    # torch's FSDP asks a parameter's piece for these two (its tensor-subclass all-gather
    # extension) and calls the first at the forward, on every rank, before it all-gathers:
    # a shardwise DTensor refuses there, naming the fix (see `_foreign`).
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> Any:
        """Refused: torch's `fully_shard` does not know shardwise DTensors (TypeError naming
        `shardwise.fsdp.fully_shard`)."""
        raise refuse_torch_fsdp(self, mesh, outer_size, module)

    def fsdp_post_all_gather(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as `fsdp_pre_all_gather` is (never reached: that one raises first)."""
        raise TypeError(FIX)


class _SplitBatchDTensor(DTensor, role="split_batch"):
    """A DTensor of 3 or more dims split along a dim other than the last: linear and matmul
    on it must not decompose (see `_local_linear`), so torch function is on for it alone."""

    @classmethod
    def __torch_function__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        try:
            handler = TORCH_FUNCTION_HANDLERS.get(func)
        except TypeError:  # an unhashable callable: never one of ours
            handler = None
        if handler is not None:
            out = handler(args, kwargs or {})
            if out is not NotImplemented:
                return out
        # every other call runs exactly as with torch function disabled
        return _disabled_torch_function(func, types, args, kwargs or {})


_disabled_torch_function = torch._C._disabled_torch_function_impl
