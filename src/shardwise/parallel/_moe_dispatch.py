"""Token dispatch: every route of this rank's tokens to the rank that owns its expert, and the results home.

Under expert parallelism by token dispatch each rank of the ep group holds its own tokens
(the ep ranks are data-parallel ranks) and a contiguous range of whole experts. A MoE layer
then moves only what it must, the way torchtitan's and Megatron's all-to-all dispatchers do:

| step | what | communication |
|---|---|---|
| sort | the (token, slot) routes by expert, so each owner's routes lie together | none |
| counts | each owner learns how many routes each rank sends each of its experts | one all_to_all of `num_experts` ints |
| dispatch | each route's hidden state to its expert's owner | one all_to_all of exact sizes |
| experts | the module's own forward on the routes it received, grouped by expert (weight 1) | none |
| combine | each result back to the rank its token lives on, weighted and summed per token | one all_to_all of exact sizes |

The exchanged counts become the split sizes on the host: one synchronisation per layer
(`capacity` is the form without it: every owner takes exactly `capacity` routes per expert
from every rank, padded, so the sizes are known before the step; routes beyond it are
dropped, counted, and weigh nothing, as one process that drops the same routes computes).
Backward is the same two all_to_alls transposed, with the sizes kept from forward.

An expert's parameters receive, through the dispatch, the gradient of every ep rank's loss:
the sum half of data parallelism's average. Their gradient is scaled by `1 / ep` as it
reaches them (`grad_scale`), so a step equals one process on the global batch, as data
parallelism's average does for dense parameters; a reducer over the ranks that hold copies
of the experts (a unit over the dp ranks ep does not use) then averages as for any parameter.

Where the ranks of one mesh dim hold the same tokens (tensor parallelism) and ep spans them
too, each takes its share of the rows before the dispatch (`take_rows`) and the shares are
gathered after (`gather_rows`); every token then travels once, from one rank, and the scale
is 1 over the ranks whose tokens differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._compile import mark_persistent
from .._layout import chunk_range
from ._cp_comm import CpGroup, all_to_all_heads, gather_pieces
from ._moe_dry import exchanged_sizes

__all__ = ["EpRanks", "RouteCounts", "capacity_of", "dispatch_capacity", "dispatch_dropless", "gather_rows",
           "take_rows"]

RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (routes, local expert per route) -> outputs


@dataclass(frozen=True)
class EpRanks:
    """The ep group (as `CpGroup`: process group, size, this rank's index, ranks, mesh dim)
    and the experts each ep rank owns: `firsts[j]`, `counts[j]` (contiguous, uneven as
    `torch.chunk`)."""

    group: CpGroup
    num_experts: int
    firsts: tuple[int, ...]
    counts: tuple[int, ...]

    @staticmethod
    def of(group: CpGroup, num_experts: int) -> EpRanks:
        ranges = [chunk_range(num_experts, group.size, j) for j in range(group.size)]
        return EpRanks(group, num_experts, tuple(f for f, _ in ranges), tuple(c for _, c in ranges))

    @property
    def mine(self) -> int:
        """How many experts this rank owns."""
        return self.counts[self.group.rank]


@dataclass
class RouteCounts:
    """What the last forward of a dispatched experts module routed, on this rank (tensors: reading
    them is the caller's synchronisation): `routes` sent out, `dropped` (capacity form only),
    and `per_expert`, the routes of this rank's tokens to each expert (kept ones).

    The tensors are kept for good and written in place (`record`), so a step that
    `shardwise.compile` replays updates them as an eager one does."""

    routes: int = 0
    dropped: Optional[torch.Tensor] = None
    per_expert: Optional[torch.Tensor] = None
    capacity: Optional[int] = None

    def record(self, routes: int, per_expert: torch.Tensor, dropped: Optional[torch.Tensor],
               capacity: Optional[int]) -> None:
        """Keep a forward's counts: copied into this value's own tensors, made once (outside any trace)."""
        self.routes, self.capacity = routes, capacity
        self.per_expert = _kept_in(self.per_expert, per_expert)
        self.dropped = None if dropped is None else _kept_in(self.dropped, dropped)

    @staticmethod
    def ready(num_experts: int, device: torch.device) -> RouteCounts:
        """Counts whose tensors exist before any forward (a traced first call then writes into them)."""
        zeros = torch.zeros((num_experts,), dtype=torch.int64, device=device)
        return RouteCounts(dropped=mark_persistent(zeros.new_zeros(())), per_expert=mark_persistent(zeros))


def _kept_in(held: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    if held is None or held.shape != value.shape or held.device != value.device or held.dtype != value.dtype:
        held = mark_persistent(torch.zeros_like(value))
    return held.copy_(value)


def _sorted_routes(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(route order sorted by expert, each sorted route's token, each sorted route's expert);
    routes are (token, slot) in row-major order, kept in that order within an expert."""
    k = index.shape[-1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.div(order, k, rounding_mode="floor"), flat[order]


def _per_expert(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert (int64), without reading the ids on the host (`bincount` would, for its size)."""
    flat = index.reshape(-1).to(torch.int64)
    return torch.zeros(num_experts, dtype=torch.int64, device=index.device).scatter_add_(0, flat, torch.ones_like(flat))


def _combine(home: torch.Tensor, order: torch.Tensor, token: torch.Tensor, weights: torch.Tensor,
             tokens: int, like: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its routes' results (in the model's own arithmetic: the
    result times its weight, cast to the tokens' dtype, then added up)."""
    w = weights.reshape(-1)[order]
    weighted = (home * w.unsqueeze(-1)).to(like.dtype)
    return like.new_zeros((tokens, like.shape[-1])).index_add(0, token, weighted)


def dispatch_dropless(run: RunExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, ep: EpRanks,
                      stats: RouteCounts) -> torch.Tensor:
    """The experts' weighted sum for every token of `x` (tokens, hidden), routed by `index` /
    `weights` (tokens, k), every route taken (see the module docstring)."""
    g, p, mine = ep.group, ep.group.size, ep.mine
    order, token, _ = _sorted_routes(index)
    counts = _per_expert(index, ep.num_experts)
    got = all_to_all_heads(counts, 0, 0, ep.counts, (mine,) * p, g)  # (p * mine): routes each rank sends my experts
    sizes = exchanged_sizes(counts, got, index, ep)  # the layer's one host synchronisation (a dry run: its routing)
    send = tuple(sum(sizes[f:f + c]) for f, c in zip(ep.firsts, ep.counts))
    arrived = sizes[ep.num_experts:]
    recv = tuple(sum(arrived[i * mine:(i + 1) * mine]) for i in range(p))
    routed = all_to_all_heads(x[token], 0, 0, send, recv, g)  # arrives by (source rank, expert)
    n = routed.shape[0]
    local = torch.repeat_interleave(torch.arange(mine, device=x.device).repeat(p),
                                    torch.tensor(arrived, device=x.device), output_size=n)
    by_expert = torch.argsort(local, stable=True)
    out = run(routed[by_expert], local[by_expert])
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(n, device=x.device)
    home = all_to_all_heads(out[back], 0, 0, recv, send, g)
    stats.record(int(index.numel()), counts, None, None)
    return _combine(home, order, token, weights, x.shape[0], x)


def capacity_of(factor: float, tokens: int, k: int, num_experts: int) -> int:
    """Routes each expert takes from each rank: `factor` times an even share, at least 1."""
    return max(1, math.ceil(factor * tokens * k / num_experts))


def dispatch_capacity(run: RunExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, ep: EpRanks,
                      capacity: int, stats: RouteCounts) -> torch.Tensor:
    """`dispatch_dropless` with every expert taking exactly `capacity` routes from every rank
    (padded with zeros; routes beyond it dropped, in token order): sizes known in advance, no
    host synchronisation."""
    g, p, mine, e = ep.group, ep.group.size, ep.mine, ep.num_experts
    order, token, expert = _sorted_routes(index)
    counts = _per_expert(index, e)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(expert.numel(), device=x.device) - starts[expert]  # place within its expert
    kept = slot < capacity
    where = torch.where(kept, expert * capacity + slot, torch.full_like(slot, e * capacity))  # dropped: a spare row
    buffer = x.new_zeros((e * capacity + 1, x.shape[-1])).index_copy(0, where, x[token])[:-1]
    send = tuple(c * capacity for c in ep.counts)
    routed = all_to_all_heads(buffer, 0, 0, send, (mine * capacity,) * p, g)  # (source, expert, slot)
    by_expert = routed.view(p, mine, capacity, -1).transpose(0, 1).reshape(p * mine * capacity, -1)
    local = torch.arange(mine, device=x.device).repeat_interleave(p * capacity)
    out = run(by_expert, local)
    by_source = out.view(mine, p, capacity, -1).transpose(0, 1).reshape(p * mine * capacity, -1)
    home = all_to_all_heads(by_source, 0, 0, (mine * capacity,) * p, send, g)  # (expert, slot) here
    home = torch.cat([home, home.new_zeros((1, home.shape[-1]))])[where]  # dropped routes: nothing
    w = torch.where(kept, weights.reshape(-1)[order], torch.zeros((), dtype=weights.dtype, device=weights.device))
    stats.record(int(index.numel()), torch.minimum(counts, torch.full_like(counts, capacity)), (~kept).sum(), capacity)
    return _combine(home, torch.arange(w.numel(), device=x.device), token, w, x.shape[0], x)



# -- tokens the same on some ranks (tensor parallelism): each takes its rows before dispatch -----------

def _rows(tokens: int, rows: CpGroup) -> tuple[tuple[int, ...], int, int]:
    """(rows per rank of `rows`, this rank's first row, its count): uneven as `torch.chunk`."""
    pieces = tuple(chunk_range(tokens, rows.size, j)[1] for j in range(rows.size))
    start, count = chunk_range(tokens, rows.size, rows.rank)
    return pieces, start, count


class _TakeRows(torch.autograd.Function):
    """This rank's rows of a tensor every rank of `rows` holds alike; the gradient of the whole is
    every rank's rows' gradient, gathered (the others' rows took their routes elsewhere)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: CpGroup) -> torch.Tensor:
        pieces, start, count = _rows(x.shape[0], rows)
        ctx.pieces, ctx.rows = pieces, rows
        return x.narrow(0, start, count)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_pieces(grad.contiguous(), 0, ctx.pieces, ctx.rows), None


class _GatherRows(torch.autograd.Function):
    """Every rank's rows laid back together; the gradient (the same on every rank of `rows`, as
    for any activation tensor parallelism keeps whole) is cut to this rank's rows."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, pieces: tuple[int, ...], rows: CpGroup) -> torch.Tensor:
        ctx.start = sum(pieces[:rows.rank])
        ctx.count = pieces[rows.rank]
        return gather_pieces(y.contiguous(), 0, pieces, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(0, ctx.start, ctx.count), None, None


def take_rows(x: torch.Tensor, rows: CpGroup) -> torch.Tensor:
    """This rank's share of the rows of `x` (the same on every rank of `rows`)."""
    out: torch.Tensor = _TakeRows.apply(x, rows)  # type: ignore[no-untyped-call]
    return out


def gather_rows(y: torch.Tensor, tokens: int, rows: CpGroup) -> torch.Tensor:
    """Every rank's share of `tokens` rows (`take_rows`' pieces), laid together on every rank."""
    out: torch.Tensor = _GatherRows.apply(y, _rows(tokens, rows)[0], rows)  # type: ignore[no-untyped-call]
    return out
