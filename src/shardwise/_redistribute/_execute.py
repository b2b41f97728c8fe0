"""Run a redistribute plan on this rank's piece: the plan's steps as a program of
collective records (`shardwise._comm`) and local steps, built once per plan and rank.

Every step's input is known before anything runs: its layout is the previous step's
output, so this rank's piece of it is a box of global indices (`_exchange.box_of`). So
the program is built once, from the plan, the mesh's groups and this rank's coordinate,
and each run is a loop of `comm.run(record, local)` and local narrowing.

| step | on this rank |
|---|---|
| chunk R -> S(d) | keep piece `me` of `n` along d (`torch.chunk` sizes) |
| partialize R -> P(sum), P(bxor) | the first rank of the mesh dim keeps the value, the others hold zeros |
| partialize R -> P(prod) | the first rank keeps the value, the others hold ones |
| partialize R -> P(avg / max / min / band / bor) | every rank keeps the value |
| all_gather, all_to_all, all_reduce, reduce_scatter | one record on the mesh dim's group |
| exchange, all_reduce_mesh | one record on the group over the whole mesh |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .. import _comm as comm
from .._layout import chunk_range
from .._placement import Partial, Shard
from ._exchange import box_of, exchange_routes
from ._planner import Orders, RedistributePlan, Step, orders_of

__all__ = ["LocalStep", "Instruction", "Program", "build_program", "run_program"]


@dataclass(frozen=True)
class LocalStep:
    """A step without communication: `chunk` keeps `(start, length)` of `tensor_dim`;
    `zero` / `one` replace the piece by zeros / ones (a non-first term of a P(sum) / P(prod)); `unstride` reorders a
    whole `tensor_dim` gathered rank after rank (each rank's piece of `parts` equal parts)
    into part order; `stride` keeps piece `start` of `ways` of every one of `parts` parts
    (the two ends of a `_StridedShard`); `box` keeps a region of the piece (an exchange in
    which nothing moves)."""

    kind: str
    tensor_dim: int = 0
    start: int = 0
    length: int = 0
    parts: int = 1
    ways: int = 1
    box: Optional[tuple[tuple[int, int], ...]] = None  # `box`: the region of the piece kept (None: empty)
    shape: tuple[int, ...] = ()  # `box`: the result's shape


Instruction = Union[comm.Collective, LocalStep]
Program = tuple[Instruction, ...]


def _pieces(parent: int, n: int) -> tuple[int, ...]:
    return tuple(chunk_range(parent, n, j)[1] for j in range(n))


def _instruction(
    step: Step,
    before: Orders,
    plan: RedistributePlan,
    dtype: torch.dtype,
    groups: Sequence[Any],
    coordinate: tuple[int, ...],
    whole: Optional[tuple[Any, Sequence[int]]],
) -> Optional[Instruction]:
    """What `step` does on this rank, its input laid out with split orders `before`; None for nothing."""
    mesh_shape, gshape = plan.mesh_shape, plan.global_shape
    shape = tuple(length for _, length in box_of(gshape, mesh_shape, before, coordinate))
    common: dict[str, Any] = {"shape": shape, "dtype": dtype}
    kind = step.kind
    if kind == "exchange" and step.bytes == 0:  # nothing moves: this rank's target is a box of its piece
        routes = exchange_routes(mesh_shape, gshape, step.src_orders, step.orders, coordinate)
        assert not routes.sends and not routes.recvs, "an exchange planned without bytes sends something"
        return LocalStep("box", box=None if routes.keep is None else tuple(routes.keep[0]),
                         shape=tuple(routes.out_shape))
    if kind in ("exchange", "all_reduce_mesh"):
        if whole is None:
            raise ValueError(f"the plan's {kind} step needs a group over the whole mesh, which this mesh has none of: "
                             f"plan with exchange=mesh.has_mesh_group")
        group, ranks = whole
        common.update(group=group, size=len(ranks), mesh_dims=tuple(range(len(mesh_shape))))
        if kind == "all_reduce_mesh":
            assert isinstance(step.src, tuple) and isinstance(step.src[0], Partial)
            return comm.AllReduce(op=step.src[0].reduce_op, **common)
        routes = exchange_routes(mesh_shape, gshape, step.src_orders, step.orders, coordinate)
        return comm.AllToAllBoxes(
            out_shape=tuple(routes.out_shape),
            sends=tuple((ranks[peer], tuple(box)) for peer, box in routes.sends),
            recvs=tuple((ranks[peer], tuple(box)) for peer, box in routes.recvs),
            keep=None if routes.keep is None else (tuple(routes.keep[0]), tuple(routes.keep[1])),
            **common,
        )
    i = step.mesh_dim
    n, me = mesh_shape[i], coordinate[i]
    if kind == "chunk":
        assert isinstance(step.dst, Shard)
        d = step.dst.dim
        start, length = chunk_range(shape[d], n, me)
        return None if n == 1 else LocalStep("chunk", d, start, length)
    if kind == "partialize":
        assert isinstance(step.dst, Partial)
        if me == 0 or step.dst.reduce_op not in ("sum", "bxor", "prod"):
            return None
        return LocalStep("one" if step.dst.reduce_op == "prod" else "zero")
    if n == 1:
        return None  # one rank: its piece is already the whole and its term the total
    common.update(group=groups[i], size=n, mesh_dims=(i,))
    if kind == "all_gather":
        assert isinstance(step.src, Shard)
        d = step.src.dim
        after = box_of(gshape, mesh_shape, step.orders, coordinate)
        return comm.AllGather(tensor_dim=d, pieces=_pieces(after[d][1], n), **common)
    if kind == "all_to_all":
        assert isinstance(step.src, Shard) and isinstance(step.dst, Shard)
        d, e = step.src.dim, step.dst.dim
        parent_d = box_of(gshape, mesh_shape, step.orders, coordinate)[d][1]
        return comm.AllToAll(split_dim=e, cat_dim=d, split_sizes=_pieces(shape[e], n), cat_pieces=_pieces(parent_d, n),
                             index=me, **common)
    if kind == "all_reduce":
        assert isinstance(step.src, Partial)
        return comm.AllReduce(op=step.src.reduce_op, **common)
    if kind == "reduce_scatter":
        assert isinstance(step.src, Partial) and isinstance(step.dst, Shard)
        d = step.dst.dim
        return comm.ReduceScatter(tensor_dim=d, pieces=_pieces(shape[d], n), index=me, op=step.src.reduce_op, **common)
    raise NotImplementedError(kind)  # pragma: no cover - the planner emits only the kinds above


def build_program(
    plan: RedistributePlan,
    dtype: torch.dtype,
    src_order: Any,
    groups: Sequence[Any],
    coordinate: tuple[int, ...],
    whole: Optional[tuple[Any, Sequence[int]]],
) -> Program:
    """The instructions that carry out `plan` on the rank at `coordinate`: `groups[i]` is its
    group along mesh dim i, `whole` the group over the whole mesh with each mesh position's
    rank in it (None when the mesh has none); `src_order` the source's split order."""
    before = orders_of(plan.src, src_order, len(plan.global_shape))
    out: list[Instruction] = []
    for step in plan.steps:
        made = _instruction(step, before, plan, dtype, groups, coordinate, whole)
        if made is not None:
            out.append(made)
        before = step.orders
    return tuple(out)


def run_program(program: Program, local: torch.Tensor) -> torch.Tensor:
    """Apply `program` to `local` (this rank's piece of the source)."""
    for instruction in program:
        if type(instruction) is LocalStep:
            kind, d = instruction.kind, instruction.tensor_dim
            if kind == "chunk":
                local = local.narrow(d, instruction.start, instruction.length).contiguous()
            elif kind == "box":
                box = instruction.box
                if box is None:
                    local = local.new_empty(instruction.shape)
                else:
                    for dim, (start, length) in enumerate(box):
                        local = local.narrow(dim, start, length)
                    local = local.contiguous()
            elif kind in ("unstride", "stride"):
                parts, ways = instruction.parts, instruction.ways
                shape = list(local.shape)
                outer = (ways, parts) if kind == "unstride" else (parts, ways)
                split = local.reshape(shape[:d] + [*outer, shape[d] // (parts * ways)] + shape[d + 1:])
                if kind == "unstride":  # rank after rank -> part after part
                    local = split.transpose(d, d + 1).reshape(shape)
                else:  # this rank's piece of every part
                    shape[d] //= ways
                    local = split.select(d + 1, instruction.start).reshape(shape)
                local = local.contiguous()
            elif kind == "one":
                local = torch.ones_like(local)
            else:
                local = torch.zeros_like(local)
        else:
            local = comm.run(instruction, local)  # type: ignore[arg-type]
    return local
