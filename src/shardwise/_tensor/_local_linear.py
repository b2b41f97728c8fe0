"""Linear and matmul on inputs split along a batch dim: one local linear per rank, no collective.

`F.linear(x, w)` and `torch.matmul(x, w)` on an input of 3 or more dims are composite ops:
above `__torch_dispatch__` they flatten `x`, which would move a split batch dim's data
(see `_ops/_batched_linear` for why, and for the layouts). A DTensor whose layout splits a
batch dim (`_SplitBatchDTensor`) turns torch function on, and its `__torch_function__`
hands these calls to `TORCH_FUNCTION_HANDLERS` here: when `_ops.linear_layouts` says the
linear can run on the local pieces, it does (differentiably, through `ToLocal` and
`FromLocal`); otherwise the call runs the ordinary way.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .._mesh import CACHE_SIZES, PER_RANK_CACHES
from .._ops import LinearLayouts, linear_layouts
from .._spec import DTensorSpec
from ._autograd import FromLocal, ToLocal
from ._wrap import DTensorBase

__all__ = ["TORCH_FUNCTION_HANDLERS"]

# (out_dim, x spec, w spec, bias spec or None) -> layouts, or None where the ordinary path runs
_PLANS: dict[tuple[Any, ...], Optional[LinearLayouts]] = {}
PER_RANK_CACHES.append(_PLANS.clear)
CACHE_SIZES["linear layouts"] = _PLANS.__len__


def _local(t: DTensorBase, grad_spec: DTensorSpec) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return t._local_tensor
    return ToLocal.apply(t, grad_spec)  # type: ignore[no-untyped-call,no-any-return]


def _run(x: Any, w: Any, b: Any, out_dim: int) -> Any:
    if not (isinstance(x, DTensorBase) and isinstance(w, DTensorBase) and (b is None or isinstance(b, DTensorBase))):
        return NotImplemented
    if len(x._spec.tensor_meta.shape) < 3:
        return NotImplemented  # cheap exit before the cache: 2-D inputs never flatten
    key = (out_dim, x._spec, w._spec, None if b is None else b._spec)
    try:
        plan = _PLANS[key]
    except KeyError:
        plan = _PLANS[key] = linear_layouts(x._spec, w._spec, None if b is None else b._spec, out_dim)
    if plan is None:
        return NotImplemented
    xl, wl = _local(x, plan.grad_x), _local(w, plan.grad_w)
    if out_dim == 0:
        bl = None if b is None else _local(b, plan.grad_b)  # type: ignore[arg-type]
        yl = F.linear(xl, wl, bl)  # (..., out_local) = (..., in_local) @ (out_local, in_local)^T
    else:
        yl = torch.matmul(xl, wl)  # (..., out_local) = (..., in_local) @ (in_local, out_local)
    return FromLocal.apply(yl, plan.out)  # type: ignore[no-untyped-call]


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> Optional[list[Any]]:
    """Arguments by name (missing ones None); None when the call passes anything else (out=)."""
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names or k in bound:
            return None
        bound[k] = v
    return [bound.get(k) for k in names]


def _linear(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = _bind(args, kwargs, ("input", "weight", "bias"))
    return NotImplemented if bound is None else _run(bound[0], bound[1], bound[2], 0)


def _matmul(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = _bind(args, kwargs, ("input", "other"))
    return NotImplemented if bound is None else _run(bound[0], bound[1], None, 1)


Handler = Callable[[tuple[Any, ...], dict[str, Any]], Any]

# torch callable -> handler(args, kwargs) returning the result, or NotImplemented to run the op as usual
TORCH_FUNCTION_HANDLERS: dict[Any, Handler] = {
    F.linear: _linear,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
}
