"""The token dispatch's split sizes: the routes' counts read on the host, or, in a dry run, the routing it was given.

Dropless dispatch exchanges each expert's route counts (one small all_to_all) and reads them
on the host to size the all_to_alls of the routes. In a dry run those counts are meta
tensors, with no values; the dry run gives the routing instead (`_moe_routing`), and the
sizes are what a real run routed that way would read: this rank's routes per expert, and
what every ep rank sends this rank's experts.

A dry run plays every rank on one model, sharded once: its `EpRanks` names the ep rank that
was played then (`ep.group.rank`, the frame), and the dispatch sizes and labels its
all_to_alls in that frame. So the sizes are given in the frame: the rank played now stands
where the frame's rank stands, the others rotated with it, and every byte count a
collective reads is the rank played now's. (Rotating needs every ep rank to own as many
experts; where they do not, only the frame's rank can be played.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .._mesh import DryGroup, simulated_rank
from .._moe_routing import simulated_routing

if TYPE_CHECKING:
    from ._moe_dispatch import EpRanks

__all__ = ["exchanged_sizes"]


def exchanged_sizes(counts: torch.Tensor, got: torch.Tensor, index: torch.Tensor, ep: EpRanks) -> list[int]:
    """`counts` (this rank's routes per expert, `num_experts`) then `got` (routes each ep rank
    sends each of this rank's experts, `(ep, mine)` flattened), as ints on the host: read (the
    layer's one host synchronisation) or, in a dry run, made from its routing for `index`'s
    (tokens, top_k)."""
    routing = simulated_routing()
    if routing is None:
        sizes: list[int] = torch.cat([counts, got]).tolist()
        return sizes
    tokens, top_k = index.shape
    me, frame, p = _played(ep), ep.group.rank, ep.group.size
    stands = [(j + me - frame) % p for j in range(p)]  # the ep rank frame rank j stands for
    if any(ep.counts[s] != ep.counts[j] for j, s in enumerate(stands)):
        raise ValueError(f"a dry run of token dispatch over {ep.num_experts} experts split unevenly over {p} ep ranks "
                         f"({list(ep.counts)} per rank) plays only ep rank {frame}, the one the model was sharded as; "
                         f"ep rank {me} was asked for: give num_experts divisible by the ep size, or dry-run that rank")
    own = routing.routes(me, tokens, top_k, ep.num_experts)
    every = {s: routing.routes(s, tokens, top_k, ep.num_experts) if routing.per_rank else own for s in stands}
    mine = slice(ep.firsts[me], ep.firsts[me] + ep.counts[me])
    return _framed(own, stands, ep) + [n for s in stands for n in every[s][mine]]


def _framed(routes: tuple[int, ...], stands: list[int], ep: EpRanks) -> list[int]:
    """Routes per expert laid out by frame rank: frame rank j's experts take the counts of the
    experts of the rank it stands for."""
    return [n for s in stands for n in routes[ep.firsts[s]:ep.firsts[s] + ep.counts[s]]]


def _played(ep: EpRanks) -> int:
    """The ep index of the rank played now (in a real run: this rank's)."""
    group = ep.group.group
    if type(group) is not DryGroup:
        return ep.group.rank
    shape = group.root[0]
    rank, index = simulated_rank(), 0
    for d in group.dims:  # (the ep ranks of several mesh dims are those dims flattened, row-major)
        index = index * shape[d] + rank // math.prod(shape[d + 1:]) % shape[d]
    return index
