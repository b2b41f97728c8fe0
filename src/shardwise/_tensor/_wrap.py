"""The one constructor of DTensors: `wrap(local, spec)`, and the base class it builds on.

A DTensor is a wrapper subclass of `torch.Tensor`: the outer tensor carries the global
shape, stride, dtype and autograd state; `_local_tensor` holds this rank's piece and
`_spec` the layout. Every place that turns a local result into a DTensor (dispatch,
autograd functions, gradient reduction, constructors) goes through a `Wrapper`, the
record of what wrapping one spec needs, worked out once: `wrap(local, spec)` makes one and
calls it; a dispatch plan keeps one per output, and its lean path inlines the call (one
Python call less per op, measured in `make bench`'s per-op overhead).

This module is a leaf of the tensor layer: it imports no other module of it. The classes
it builds are declared by subclassing `DTensorBase` with a role (`role="plain"` for
`DTensor`; `role="split_batch"` for the variant whose layout splits a batch dim of a tensor
of 3 or more dims, which turns torch function on to keep linear and matmul from
flattening that split; see `_local_linear`). `class_for(spec)` picks between them.
"""

from __future__ import annotations

from typing import Any

import torch

from .._spec import DTensorSpec

__all__ = ["DTENSOR_CLASSES", "DTensorBase", "Wrapper", "class_for", "rewrap", "wrap"]

_make_wrapper = torch.Tensor._make_wrapper_subclass
_ROLES = ("plain", "split_batch")
_CLASS: dict[str, type[DTensorBase]] = {}
# The classes DTensors are made of. `type(a) in DTENSOR_CLASSES` is the hot paths' test:
# `isinstance` against the base costs twice as much (torch's metaclass has no fast path
# for a subclass), and every DTensor argument of every op is tested.
DTENSOR_CLASSES: set[Any] = set()


class DTensorBase(torch.Tensor):
    """What every DTensor has: its piece and its layout. Torch function is off (no Python
    call before every op and property access); `DTensor` adds the behaviour."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    # No __slots__: `torch.utils.swap_tensors` (how `spmd.mark_sharding` turns an existing
    # nn.Parameter into a DTensor in place) only swaps objects whose classes have the same slots.

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __init_subclass__(cls, *, role: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not role:
            return
        if role not in _ROLES or role in _CLASS:
            raise TypeError(f"DTensorBase roles are {_ROLES}, each taken once; {cls.__name__} asked for {role!r}")
        _CLASS[role] = cls
        DTENSOR_CLASSES.add(cls)


# spec -> the class a DTensor of that layout gets (only specs of 3 or more dims are cached)
_CLASSES: dict[DTensorSpec, type[DTensorBase]] = {}


def class_for(spec: DTensorSpec) -> type[DTensorBase]:
    """The split-batch class for a layout that splits a dim other than the last of a tensor
    of 3 or more dims (a composite linear would lose that split), else the plain one."""
    if len(spec.tensor_meta.shape) < 3:
        return _CLASS["plain"]
    try:
        return _CLASSES[spec]
    except KeyError:
        n = len(spec.tensor_meta.shape)
        split_batch = any(d != n - 1 for d in spec.split_orders())
        cls = _CLASSES[spec] = _CLASS["split_batch" if split_batch else "plain"]
        return cls


class Wrapper:
    """Makes DTensors of one spec: what `wrap` needs worked out once (a dispatch plan keeps
    one per output, so wrapping a result is one call)."""

    __slots__ = ("cls", "shape", "stride", "dtype", "spec")

    def __init__(self, spec: DTensorSpec) -> None:
        meta = spec.tensor_meta
        self.cls, self.shape, self.stride, self.dtype, self.spec = class_for(spec), meta.shape, meta.stride, meta.dtype, spec

    def __call__(self, local: torch.Tensor, requires_grad: bool = False) -> Any:
        """A DTensor of this spec whose piece on this rank is `local`."""
        if requires_grad:
            r: Any = _make_wrapper(self.cls, self.shape, strides=self.stride, dtype=self.dtype, device=local.device,
                                   layout=local.layout, requires_grad=True)
        else:
            r = _make_wrapper(self.cls, self.shape, strides=self.stride, dtype=self.dtype, device=local.device,
                              layout=local.layout)
        r._local_tensor = local
        r._spec = self.spec
        return r


def wrap(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> Any:
    """A DTensor of layout `spec` whose piece on this rank is `local`."""
    return Wrapper(spec)(local, requires_grad)


def rewrap(owner: DTensorBase, local: torch.Tensor, spec: DTensorSpec) -> None:
    """Give an existing DTensor a new piece and layout in place (an in-place op that changes
    its shape, `squeeze_`): its class follows the layout, its sizes and strides are set
    below the Python key (they are metadata only)."""
    owner._local_tensor = local
    owner._spec = spec
    owner.__class__ = class_for(spec)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        torch.ops.aten.as_strided_.default(owner, spec.shape, spec.tensor_meta.stride)
