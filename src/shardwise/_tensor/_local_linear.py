"""Linear and matmul on inputs split along a batch dim: one local linear per rank, no collective.

`F.linear(x, w)` and `torch.matmul(x, w)` on an input of 3 or more dims are composite ops:
above `__torch_dispatch__` they flatten `x` to `(B*S, D)`, multiply and unflatten. An input
split along an inner batch dim (the sequence dim of `(B, S, D)`, `Shard(1)`) cannot stay
split through that flatten, because each rank's rows are not one block of the `B*S` rows, so
the flatten moves data (an all_to_all, a gather), and what comes out is laid out for the
flattened matrix, not for the activation. Yet the map only touches the last dim: applied to
every rank's piece it needs no communication. DTensor's `__torch_function__` routes these
calls here, before they decompose, and when every mesh dim is one of the rows below the
linear runs on local pieces (torch_xla's `XLAPatchedLinear` job, met without a new module):

| per mesh dim: input `x` | weight `w` (out, in) | bias | output | grad `x` | grad `w` | grad bias |
|---|---|---|---|---|---|---|
| S(d), d a batch dim | R | R | S(d) | S(d) | P(sum) | P(sum) |
| R | S(0) (out features) | S(0) | S(-1) | P(sum) | S(0) | S(0) |
| R | R | R | R | R | R | R |
| S(-1) (contraction) | S(1) | none | P(sum) | S(-1) | S(1) | - |

(for `matmul(x, w2)` with `w2` of shape (in, out) the weight's dims swap). A weight split on
the mesh dim that splits a batch dim, Partial inputs, mixed dtypes, an input with no split
batch dim (the composite path keeps those layouts) and anything else run the ordinary way.
The gradient placements are those of the local computation: a replicated weight used by
a split input gets a `Partial(sum)` gradient, as the matmul strategies give it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .._layout import contiguous_strides, normalize_shard_order
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta

__all__ = ["TORCH_FUNCTION_HANDLERS"]

_SUM = Partial("sum")


class _Plan(NamedTuple):
    out: DTensorSpec
    grad_x: DTensorSpec
    grad_w: DTensorSpec
    grad_b: Optional[DTensorSpec]


# (out_dim, x spec, w spec, bias spec or None) -> plan, or None where the ordinary path runs
_PLANS: dict[tuple[Any, ...], Optional[_Plan]] = {}


def _same(p: Optional[Placement], *allowed: Placement) -> bool:
    return p is None or p in allowed


def _make_plan(x: DTensorSpec, w: DTensorSpec, b: Optional[DTensorSpec], out_dim: int) -> Optional[_Plan]:
    in_dim = 1 - out_dim
    n = x.ndim
    last = n - 1
    if w.ndim != 2 or x.mesh != w.mesh or x.shape[-1] != w.shape[in_dim] or x.dtype != w.dtype:
        return None
    if b is not None and (b.ndim != 1 or b.mesh != x.mesh or b.shape[0] != w.shape[out_dim] or b.dtype != x.dtype):
        return None
    x_orders, w_orders = x.split_orders(), w.split_orders()
    if all(d == last for d in x_orders):
        return None  # no split batch dim: the flatten keeps the layout, the matmul strategies apply
    if x_orders.get(last, ()) != w_orders.get(in_dim, ()):
        return None  # the contraction dim must be split the same way on both sides
    out: list[Placement] = []
    gx: list[Placement] = []
    gw: list[Placement] = []
    gb: list[Placement] = []
    for m, (px, pw) in enumerate(zip(x.placements, w.placements)):
        pb = b.placements[m] if b is not None else None
        R = Replicate()
        if isinstance(px, Shard) and px.dim != last and pw == R and _same(pb, R):
            row: tuple[Placement, Placement, Placement, Placement] = (px, px, _SUM, _SUM)
        elif px == R and pw == Shard(out_dim) and _same(pb, Shard(0)):
            row = (Shard(last), _SUM, pw, Shard(0))
        elif px == R and pw == R and _same(pb, R):
            row = (R, R, R, R)
        elif px == Shard(last) and pw == Shard(in_dim) and b is None:
            row = (_SUM, px, pw, R)
        else:
            return None
        out.append(row[0])
        gx.append(row[1])
        gw.append(row[2])
        gb.append(row[3])
    orders = {d: ms for d, ms in x_orders.items() if d != last}
    if out_dim in w_orders:
        orders[last] = w_orders[out_dim]
    shape = torch.Size(tuple(x.shape[:-1]) + (w.shape[out_dim],))
    out_pl = tuple(out)
    out_spec = DTensorSpec(
        x.mesh, out_pl, TensorMeta(shape, contiguous_strides(shape), x.dtype), normalize_shard_order(out_pl, orders, n)
    )
    return _Plan(
        out_spec,
        x.with_placements(tuple(gx), x.shard_order),
        w.with_placements(tuple(gw), w.shard_order),
        None if b is None else b.with_placements(tuple(gb), b.shard_order),
    )


def _local(t: DTensor, grad_spec: DTensorSpec) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return t._local_tensor
    return _ToLocal.apply(t, grad_spec)  # type: ignore[no-untyped-call,no-any-return]


def _run(x: Any, w: Any, b: Any, out_dim: int) -> Any:
    if not (isinstance(x, DTensor) and isinstance(w, DTensor) and (b is None or isinstance(b, DTensor))):
        return NotImplemented
    if len(x._spec.tensor_meta.shape) < 3:
        return NotImplemented  # cheap exit before the cache: 2-D inputs never flatten
    key = (out_dim, x._spec, w._spec, None if b is None else b._spec)
    try:
        plan = _PLANS[key]
    except KeyError:
        plan = _PLANS[key] = _make_plan(x._spec, w._spec, None if b is None else b._spec, out_dim)
    if plan is None:
        return NotImplemented
    xl, wl = _local(x, plan.grad_x), _local(w, plan.grad_w)
    if out_dim == 0:
        bl = None if b is None else _local(b, plan.grad_b)  # type: ignore[arg-type]
        yl = F.linear(xl, wl, bl)  # (..., out_local) = (..., in_local) @ (out_local, in_local)^T
    else:
        yl = torch.matmul(xl, wl)  # (..., out_local) = (..., in_local) @ (in_local, out_local)
    return _FromLocal.apply(yl, plan.out)  # type: ignore[no-untyped-call]


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

from ._dtensor import DTensor, _FromLocal, _ToLocal  # noqa: E402  (DTensor imports this module)
