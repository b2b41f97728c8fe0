"""Strategies for batched linear algebra: factorizations, solves, inverses, determinants,
eigen- and singular value decompositions, `matrix_exp`, `cross`.

A `torch.linalg` op works on the trailing matrix dims (two; one for a vector such as the
pivots, the eigenvalues or a solve's vector right-hand side) and loops over the leading
batch dims, broadcasting them between inputs. The matrix is one indivisible unit: the
factorization of a row block is not a block of the factorization. So along one mesh dim:

| option | outputs | inputs |
|---|---|---|
| batch dim b split | S(b) (an output batched like one input only: S where it has b) | S where the input has b at full size, else R |
| linear in one input (the right-hand side of a solve) | P(op) where linear in it, else R | that input P(op), op sum or avg, the rest R |
| replicated | R | R |

Every other Partial is reduced first: factorizations are not linear. An output emptied by a
flag (`compute_uv=False`, `mode="r"`) stays R. A batch dim is split only on a mesh dim where
some input already splits it: shardwise follows the user's splits, it does not start new ones
(chunking a replicated input is free under the byte cost model, see `_matmul.anchored`).

`linalg_cross` is elementwise over every dim but `dim`, with broadcasting, and bilinear.
`linalg_lstsq` and `geqrf` have no meta kernel, so their output shapes are unknown before they
run: they are left to the replicated fallback. `_linalg_check_errors` gathers the (small) `info`
codes first, so a singular matrix raises on every rank: checking only the local batches would
raise on some ranks and leave the others to hang in their next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._args import Args, Option, broadcast_shards, combine
from ._registry import register_op_strategy
from ._schema import Layout, OpSchema, OpStrategy, PlacementStrategy
from ._utils import normalize_dim

__all__ = ["LINALG_OPS", "LinalgOp", "linalg_strategy"]

aten = torch.ops.aten
R = Replicate()
_LINEAR = ("sum", "avg")  # Partial reductions that commute with a linear map

Core = Union[int, Callable[[OpSchema], int]]


@dataclass(frozen=True)
class LinalgOp:
    """How one op reads its inputs and batches its outputs.

    `cores`: trailing (non-batch) dims of each tensor parameter, an int or a function of the
    call; `sources`: per output, the input whose batch dims it carries, or "" for the batch
    broadcast over every input; `linear`: an input the op is linear in, and the outputs
    that are linear in it (the other outputs must not read it)."""

    cores: dict[str, Core]
    sources: tuple[str, ...] = ()
    linear: Optional[tuple[str, tuple[int, ...]]] = None


def _solve_rhs_core(schema: OpSchema) -> int:
    """`linalg.solve`'s B is a (batch of) vector(s) when it is 1-D or A's shape minus the last dim."""
    a, b = schema.arg(0, "A"), schema.arg(1, "B")
    assert isinstance(a, DTensorSpec) and isinstance(b, DTensorSpec)
    return 1 if b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1])) else 2


LINALG_OPS: dict[torch._ops.OpOverload, LinalgOp] = {
    aten._linalg_svd.default: LinalgOp({"A": 2}),
    aten.linalg_pinv.atol_rtol_tensor: LinalgOp({"self": 2, "atol": 0, "rtol": 0}),
    aten.linalg_inv_ex.default: LinalgOp({"A": 2}),
    aten.linalg_lu_factor_ex.default: LinalgOp({"A": 2}),
    aten.linalg_lu.default: LinalgOp({"A": 2}),
    aten.lu_unpack.default: LinalgOp({"LU_data": 2, "LU_pivots": 1}),
    aten.linalg_lu_solve.default: LinalgOp({"LU": 2, "pivots": 1, "B": 2}, linear=("B", (0,))),
    aten._linalg_solve_ex.default: LinalgOp({"A": 2, "B": _solve_rhs_core}, ("", "A", "A", "A"), ("B", (0,))),
    aten.linalg_cholesky_ex.default: LinalgOp({"self": 2}),
    # torch 2.15 dropped aten.cholesky (torch.cholesky now decomposes to linalg_cholesky_ex)
    **({aten.cholesky.default: LinalgOp({"self": 2})} if hasattr(aten, "cholesky") else {}),
    aten.cholesky_inverse.default: LinalgOp({"self": 2}),
    aten.cholesky_solve.default: LinalgOp({"self": 2, "input2": 2}, linear=("self", (0,))),
    aten.linalg_eig.default: LinalgOp({"self": 2}),
    aten._linalg_eigh.default: LinalgOp({"A": 2}),
    aten.linalg_ldl_factor_ex.default: LinalgOp({"self": 2}),
    aten.linalg_ldl_solve.default: LinalgOp({"LD": 2, "pivots": 1, "B": 2}, linear=("B", (0,))),
    aten.linalg_qr.default: LinalgOp({"A": 2}),
    aten._linalg_slogdet.default: LinalgOp({"A": 2}),
    aten._linalg_det.default: LinalgOp({"A": 2}),
    aten.linalg_householder_product.default: LinalgOp({"input": 2, "tau": 1}),
    aten.ormqr.default: LinalgOp({"self": 2, "input2": 1, "input3": 2}, linear=("input3", (0,))),
    aten.triangular_solve.default: LinalgOp({"self": 2, "A": 2}, linear=("self", (0,))),
    aten.linalg_solve_triangular.default: LinalgOp({"self": 2, "B": 2}, linear=("B", (0,))),
    aten.linalg_matrix_exp.default: LinalgOp({"self": 2}),
}


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The broadcast of batch shapes (they are valid: the op's meta run accepted them)."""
    n = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (n - len(s)) + s for s in shapes]
    return tuple(max((s[d] for s in padded), default=1) for d in range(n))


def _outputs(schema: OpSchema) -> tuple[TensorMeta, ...]:
    meta = schema.output_meta()
    return (meta,) if isinstance(meta, TensorMeta) else tuple(meta)


def _anchored(a: Args, i: int, name: str, d: int) -> bool:
    """Whether input `name` already splits its dim `d` along mesh dim i."""
    spec = a.spec(name)
    return spec is not None and spec.placements[i] == Shard(d)


def linalg_strategy(schema: OpSchema) -> OpStrategy:
    """Candidates for one call of an op in `LINALG_OPS`."""
    info = LINALG_OPS[schema.op]
    a = Args(schema)
    # batch shape of each DTensor input: everything before its core dims
    batch: dict[str, tuple[int, ...]] = {}
    for name in a.names():
        core = info.cores.get(name, 0)
        n = core(schema) if callable(core) else core
        spec = a.need(name)
        batch[name] = tuple(spec.shape[: max(spec.ndim - n, 0)])
    full = _broadcast(list(batch.values()))
    nb = len(full)
    outs = _outputs(schema)
    sources = info.sources or ("",) * len(outs)

    def out_batch(k: int) -> Optional[tuple[int, ...]]:
        """Output k's batch shape, None when it is empty (then it stays R)."""
        if outs[k].shape.numel() == 0:
            return None
        return full if sources[k] == "" else batch[sources[k]]

    # a batch-split is sound only if each non-empty output visibly starts with its batch shape
    splittable = all(
        (b := out_batch(k)) is None or tuple(outs[k].shape[: len(b)]) == b for k in range(len(outs))
    )
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts: list[Option] = []
        for bd in range(nb if splittable else 0):
            ins: dict[str, Placement] = {}
            for name, shp in batch.items():
                d = bd - (nb - len(shp))
                if d >= 0 and shp[d] == full[bd]:
                    ins[name] = Shard(d)
            if not any(_anchored(a, i, name, p.dim) for name, p in ins.items() if isinstance(p, Shard)):
                continue
            placed: list[Placement] = []
            for k in range(len(outs)):
                b = out_batch(k)
                src_dim = bd - (nb - len(b)) if b is not None else -1
                has = b is not None and src_dim >= 0 and (sources[k] == "" or sources[k] in ins)
                placed.append(Shard(src_dim) if has else R)
            opts.append(a.opt(placed, ins))
        if info.linear is not None:
            name, linear_outs = info.linear
            p = a.partial(name, i)
            if p is not None and p.reduce_op in _LINEAR:
                opts.append(a.opt([p if k in linear_outs else R for k in range(len(outs))], {name: p}))
        per_dim.append(opts)
    return combine(a, per_dim, n_outputs=len(outs))


register_op_strategy(list(LINALG_OPS))(linalg_strategy)


@register_op_strategy(aten.linalg_cross.default)
def _cross_strategy(schema: OpSchema) -> OpStrategy:
    """Elementwise (with broadcasting) on every dim but `dim`; bilinear, so one Partial operand survives."""
    a = Args(schema)
    x, y = a.need("self"), a.need("other")
    out = _outputs(schema)[0]
    dim = normalize_dim(int(schema.arg(2, "dim", -1)), len(out.shape))
    inputs = {"self": x, "other": y}
    per_dim: list[list[Option]] = []
    for i in range(a.mesh_ndim):
        opts = []
        for placed, given in broadcast_shards(tuple(out.shape), inputs, a):
            p = placed[0]
            if isinstance(p, Shard) and p.dim != dim and any(
                a.specs[k].placements[i] == g for k, g in given.items()
            ):
                opts.append((placed, given))
        for name in ("self", "other"):
            q = a.partial(name, i)
            if q is not None and q.reduce_op in _LINEAR:
                opts.append(a.opt((q,), {name: q}))
        per_dim.append(opts)
    return combine(a, per_dim)


@register_op_strategy(aten._linalg_check_errors.default)
def _check_errors_strategy(schema: OpSchema) -> OpStrategy:
    """Gathers the `info` codes so every rank checks every batch and all raise together."""
    spec = Args(schema).need("info")
    return OpStrategy([PlacementStrategy(None, (Layout((R,) * spec.mesh.ndim),))])
