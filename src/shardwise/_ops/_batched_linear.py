"""Linear and matmul on inputs split along a batch dim: the layouts of one local linear per rank.

`F.linear(x, w)` and `torch.matmul(x, w)` on an input of 3 or more dims are composite ops:
above `__torch_dispatch__` they flatten `x` to `(B*S, D)`, multiply and unflatten. An input
split along an inner batch dim (the sequence dim of `(B, S, D)`, `Shard(1)`) cannot stay
split through that flatten, because each rank's rows are not one block of the `B*S` rows, so
the flatten moves data (an all_to_all, a gather), and what comes out is laid out for the
flattened matrix, not for the activation. Yet the map only touches the last dim: applied to
every rank's piece it needs no communication. DTensor's `__torch_function__` routes these
calls to the tensor layer (`_tensor/_local_linear`) before they decompose, and when every
mesh dim is one of the rows below (`linear_layouts`) the linear runs on local pieces (torch_xla's `XLAPatchedLinear` job, met without a new module):

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

from typing import NamedTuple, Optional

import torch

from .._layout import contiguous_strides, normalize_shard_order
from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta

__all__ = ["LinearLayouts", "linear_layouts"]

_SUM = Partial("sum")


class LinearLayouts(NamedTuple):
    """The layouts of a local linear: its output, and the gradients of x, w and the bias."""

    out: DTensorSpec
    grad_x: DTensorSpec
    grad_w: DTensorSpec
    grad_b: Optional[DTensorSpec]


def _same(p: Optional[Placement], *allowed: Placement) -> bool:
    return p is None or p in allowed


def linear_layouts(x: DTensorSpec, w: DTensorSpec, b: Optional[DTensorSpec], out_dim: int) -> Optional[LinearLayouts]:
    """The layouts of `linear(x, w, b)` (`out_dim` 0: w is (out, in)) or `matmul(x, w)`
    (`out_dim` 1: w is (in, out)) run as one local linear per rank; None where it cannot
    (the ordinary path runs)."""
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
    return LinearLayouts(
        out_spec,
        x.with_placements(tuple(gx), x.shard_order),
        w.with_placements(tuple(gw), w.shard_order),
        None if b is None else b.with_placements(tuple(gb), b.shard_order),
    )
