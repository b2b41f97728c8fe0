"""Local implementations of p-norms over sharded dims: each rank's term, all-reduced, rooted.

A p-norm `(sum |x|^p)^(1/p)` over a tensor dim that a mesh dim splits needs, from each rank,
only its piece's `sum |x|^p`: the norm's local value raised to p. So the reduced dims may stay
sharded; the rank computes its piece's norm, raises it to p, all-reduces those terms over the
mesh dims that split a reduced dim (`LocalCall.all_reduce`) and takes the p-th root. Only the
terms travel: one number per output element, never the input. Mesh dims that split a kept
dim keep their shards and reduce nothing.

| op | reduced dim split on mesh dim m gives | collective |
|---|---|---|
| `linalg_vector_norm`, `norm.*`, ord p finite, p > 0, p != 1 | R on m | all_reduce(sum) of the local output's terms over m |
| `_foreach_norm`, same ord | R on m, every element split on m | one all_reduce(sum) of the stacked terms per mesh dim (and dtype) |

Orders 0 and 1 (the terms add up as they are) and +-inf (they combine by max / min) need no
root: their strategies make `Partial`s instead, and these implementations run the aten op as it
is. A negative order stays gathered (an empty piece has no such norm). Terms are raised in the
output's dtype, or float32 for a half-precision output, the precision the single-device kernel
accumulates in; so the root of their sum equals the single-device norm to float rounding.
A `Partial` input is reduced before the op (the strategies keep none): the norm of a sum is
not made of the norms of its terms.

>>> [combines_by_root(p) for p in (2, 3, 0.5, None)], [combines_by_root(p) for p in (0, 1, math.inf, -2)]
([True, True, True, True], [False, False, False, False])
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ._local import LocalCall
from ._utils import normalize_dims

__all__ = ["NORMS", "order_name", "combines_by_root", "foreach_norm_local", "vector_norm_local"]

aten = torch.ops.aten

# op -> (position of ord / p, position of dim, position of keepdim); None: the overload reduces every dim
NORMS: dict[Any, tuple[int, Optional[int], Optional[int]]] = {
    aten.linalg_vector_norm.default: (1, 2, 3),
    aten.norm.Scalar: (1, None, None), aten.norm.ScalarOpt_dtype: (1, None, None),
    aten.norm.ScalarOpt_dim: (1, 2, 3), aten.norm.ScalarOpt_dim_dtype: (1, 2, 3),
}


def order_name(op: Any) -> str:
    """The name of a norm overload's order argument."""
    return "ord" if op is aten.linalg_vector_norm.default else "p"


def combines_by_root(order: Any) -> bool:
    """Whether ranks' terms of a norm of this order combine only as (sum term)^(1/p), which
    a local implementation does: finite orders above 0 other than 1 (2 when None)."""
    p = 2.0 if order is None else float(order)
    return math.isfinite(p) and p > 0 and p != 1


def _term_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype terms are raised and summed in: the single-device kernel's accumulator."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def vector_norm_local(call: LocalCall) -> torch.Tensor:
    """`linalg_vector_norm` / `norm.*` on this rank's piece, combined over the mesh dims that split a reduced dim."""
    ord_at, dim_at, _ = NORMS[call.func]
    spec = call.input_specs[0]
    p = call.arg(ord_at, order_name(call.func), 2)
    dims = normalize_dims(None if dim_at is None else call.arg(dim_at, "dim"), spec.ndim)
    mesh_dims = call.splitting(spec, dims)
    local: torch.Tensor = call.run_op()  # this piece's norm: (sum over the piece |x|^p)^(1/p)
    if not mesh_dims or not combines_by_root(p):
        return local
    p = 2.0 if p is None else float(p)
    term = local.to(_term_dtype(local.dtype)).pow(p)  # sum over the piece of |x|^p
    total = call.all_reduce(term, spec, mesh_dims, "sum")  # sum over the whole reduced dims
    return total.pow(1.0 / p).to(local.dtype)


def foreach_norm_local(call: LocalCall) -> list[torch.Tensor]:
    """`_foreach_norm` on this rank's pieces: element k's term all-reduced over the mesh dims
    that split it, in one all_reduce per mesh dim (and term dtype) for the whole list."""
    p = call.arg(1, "ord", 2)
    local: list[torch.Tensor] = list(call.run_op())
    specs = call.input_specs
    if not combines_by_root(p) or not any(s.is_sharded() for s in specs):
        return local
    p = float(p)
    terms = [t.to(_term_dtype(t.dtype)).pow(p) for t in local]  # 0-dim each
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for k, spec in enumerate(specs):
        for m in call.splitting(spec, range(spec.ndim)):
            groups.setdefault((m, terms[k].dtype), []).append(k)
    # the same order on every rank: the specs, hence the groups, are global
    for (m, _), ks in groups.items():
        summed = call.all_reduce(torch.stack([terms[k] for k in ks]), specs[ks[0]], [m], "sum")  # (len(ks),)
        for j, k in enumerate(ks):
            terms[k] = summed[j]
    return [term.pow(1.0 / p).to(t.dtype) for term, t in zip(terms, local)]
