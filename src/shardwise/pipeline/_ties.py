"""Parameters tied across pipeline stages (embeddings tied to the LM head): found, checked, grouped.

Stages on different pp ranks may use one parameter. Each of those ranks keeps its own copy,
and after the step the copies' gradients are summed (`_gradients`), so every copy steps as
the one parameter would. Ties are found by identity, so before any stage is sharded (which
makes new parameter objects), and become values: which pp indices hold them, the
parameters' names in each stage, and the rows of ranks whose copies' pieces line up (one
process group each, made by `_process_groups`). Holders whose tp rows differ in width have
no such rows: their copies are split differently and are summed across meshes instead.
`_gradients` registers each tie's sum as the reducer of its copies.

>>> from torch import nn
>>> from shardwise.pipeline._topology import Topology
>>> shared = nn.Linear(2, 2)
>>> parts = [nn.Sequential(shared), nn.Sequential(nn.ReLU()), nn.Sequential(shared)]
>>> t = Topology(grids=(((0,),), ((1,),), ((2,),)), pp_rank=0, dp_index=0, tp_index=0)
>>> [(tie.holders, tie.names, tie.rows) for tie in find_ties(parts, lambda s: s, t, False)]
[((0, 2), ('0.0.weight', '0.0.bias'), ((0, 2),))]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from ._topology import Topology

__all__ = ["Tie", "find_ties"]


@dataclass(frozen=True)
class Tie:
    """Trainable parameters that the stages on pp indices `holders` share: `names[k]` (as
    "stage.parameter", for errors) is called `where[k][stage]` in each stage that uses it."""

    holders: tuple[int, ...]
    names: tuple[str, ...]
    where: tuple[tuple[tuple[int, str], ...], ...]
    rows: tuple[tuple[int, ...], ...]  # per (dp, tp) coordinate, the ranks whose copies' pieces line up
    across: bool  # the holders' tp rows differ in width: no rows, summed by crossing meshes

    def params(self, local: nn.ModuleDict) -> list[tuple[str, nn.Parameter]]:
        """This rank's copies ("stage.parameter", parameter) among its stages `local` (by index
        as a string), looked up by name now: sharding or `to_empty` may have made new objects."""
        out = []
        for where in self.where:
            here = [(f"{j}.{n}", local[str(j)].get_parameter(n)) for j, n in where if str(j) in local]
            if here:
                out.append(here[0])
        return out


def find_ties(partitions: Sequence[nn.Module], stage_rank: Callable[[int], int], topology: Topology,
              shard_parameters: bool) -> tuple[Tie, ...]:
    """Every set of parameters that stages on different pp ranks share, one `Tie` per set of
    holders (in order of first use); ValueError for a tie that ZeRO-3 cannot sum."""
    found = _shared_across_ranks(partitions, stage_rank)
    _check(topology, found, shard_parameters)
    by_holders: dict[tuple[int, ...], list[tuple[str, dict[int, str]]]] = {}
    for holders, name, where in found:
        by_holders.setdefault(holders, []).append((name, where))
    ties = []
    for holders, entries in by_holders.items():
        widths = [len(topology.grids[h][0]) for h in holders]
        across = len(set(widths)) > 1
        rows = () if across else tuple(tuple(grid[d][t] for grid in (topology.grids[h] for h in holders))
                                       for d in range(len(topology.grids[0])) for t in range(widths[0]))
        ties.append(Tie(holders, tuple(name for name, _ in entries),
                        tuple(tuple(where.items()) for _, where in entries), rows, across))
    return tuple(ties)


def _shared_across_ranks(partitions: Sequence[nn.Module], stage_rank: Callable[[int], int]
                         ) -> list[tuple[tuple[int, ...], str, dict[int, str]]]:
    """(pp indices, name, its name in each stage that uses it) of every trainable parameter
    that stages on different pp ranks use (found by identity, so before any stage is sharded)."""
    seen: dict[int, tuple[str, list[int], dict[int, str]]] = {}
    for j, part in enumerate(partitions):
        for name, p in part.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                _, holders, where = seen.setdefault(id(p), (f"{j}.{name}", [], {}))
                where.setdefault(j, name)
                if stage_rank(j) not in holders:
                    holders.append(stage_rank(j))
    return [(tuple(sorted(holders)), name, where) for name, holders, where in seen.values() if len(holders) > 1]


def _check(topology: Topology, shared: list[tuple[tuple[int, ...], str, dict[int, str]]],
           shard_parameters: bool) -> None:
    """ValueError for a parameter shared by ZeRO-3 stages whose tp rows differ in width (their
    copies are split over (dp, tp) differently; plain tp stages sum them across meshes)."""
    for holders, name, _ in shared:
        widths = [len(topology.grids[h][0]) for h in holders]
        if len(set(widths)) > 1 and shard_parameters:
            stage, inner = name.split(".", 1)
            raise ValueError(f"parameter {inner} of stage {stage} is shared by stages on pp indices {list(holders)}, "
                             f"whose tp rows have {widths} ranks: under shard_parameters=True a shared (tied) "
                             "parameter needs stages of one tp width, so that each copy's piece sums with the same "
                             "piece of the others; untie it, give those stages meshes of one tp size, or leave "
                             "shard_parameters off")
