"""`SkipRoutes`: which partition stashes and which pops each skip, and the copies that implies.

`Pipe` plans skip routes once, from the declarations of the partitions' layers: a
skip stashed in partition `j` and popped in partition `j'` is copied straight from
`j`'s device to `j'`'s right before `j'` runs, and nowhere else. `copy_policy(j')`
lists those copies in order of source partition (a fixed order, so copies are issued
the same way on every run); a skip popped in the partition that stashed it needs no
copy. `str(routes)` prints them for people. (`inspect_skip_layout` keeps torchgpipe's name;
"layout" elsewhere in shardwise means how a tensor lies on a mesh.)

>>> from torch import nn
>>> from shardwise.pipeline.skip import skippable, stash, pop
>>> @skippable(stash=["x"])
... class A(nn.Module):
...     def forward(self, t):
...         yield stash("x", t)
...         return t
>>> @skippable(pop=["x"])
... class B(nn.Module):
...     def forward(self, t):
...         x = yield pop("x")
...         return t + x
>>> routes = inspect_skip_layout([nn.Sequential(A()), nn.Sequential(nn.ReLU()), nn.Sequential(B())])
>>> list(routes.copy_policy(2))
[(0, None, 'x')]
>>> print(routes)
1 skip over 3 partitions:
  'x': stashed in partition 0 (layer '0'), popped in partition 2 (layer '0'), skips partition 1
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..._describe import describe
from ._namespace import Namespace, sort_key
from ._skippable import Skippable

__all__ = ["SkipRoutes", "SkipRoute", "inspect_skip_layout"]


@dataclass(frozen=True)
class SkipRoute:
    """One skip: stashed in partition `stash_partition`, popped in `pop_partition`."""

    ns: Optional[Namespace]
    name: str
    stash_partition: int
    pop_partition: int
    stash_layer: Optional[str] = None
    pop_layer: Optional[str] = None

    @property
    def skipped_partitions(self) -> range:
        """The partitions between stash and pop, which the skip tensor never visits."""
        return range(self.stash_partition + 1, self.pop_partition)

    def __str__(self) -> str:
        ns = "" if self.ns is None else f" in {self.ns!r}"
        where = [_place("stashed", self.stash_partition, self.stash_layer),
                 _place("popped", self.pop_partition, self.pop_layer)]
        skipped = list(self.skipped_partitions)
        if self.stash_partition == self.pop_partition:
            where.append("same partition, no copy")
        elif skipped:
            where.append(f"skips partition{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))}")
        return f"'{self.name}'{ns}: " + ", ".join(where)


def _place(verb: str, partition: int, layer: Optional[str]) -> str:
    return f"{verb} in partition {partition}" + ("" if layer is None else f" (layer '{layer}')")


class SkipRoutes:
    """The routes of all skips of a partitioned model."""

    def __init__(self, num_partitions: int, routes: Iterable[SkipRoute]) -> None:
        self.num_partitions = num_partitions
        self.routes: tuple[SkipRoute, ...] = tuple(
            sorted(routes, key=lambda r: (r.stash_partition, r.pop_partition, sort_key(r.ns), r.name)))
        self._by_key = {(r.ns, r.name): r for r in self.routes}
        self.by_partition: list[list[tuple[int, Optional[Namespace], str]]] = [[] for _ in range(num_partitions)]
        for r in self.routes:  # already sorted by source partition
            self.by_partition[r.pop_partition].append((r.stash_partition, r.ns, r.name))

    def copy_policy(self, next_j: int) -> Iterator[tuple[int, Optional[Namespace], str]]:
        """`(prev_j, ns, name)` of every skip to copy into partition `next_j`, by source partition."""
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield prev_j, ns, name

    def requires_copy(self, ns: Optional[Namespace], name: str) -> bool:
        """Whether skip `(ns, name)` crosses partitions (unknown skips do not)."""
        route = self._by_key.get((ns, name))
        return route is not None and route.stash_partition != route.pop_partition

    def route(self, ns: Optional[Namespace], name: str) -> SkipRoute:
        """The route of skip `(ns, name)`; KeyError if no partition stashes and pops it."""
        return self._by_key[(ns, name)]

    def __repr__(self) -> str:
        return f"SkipRoutes(num_partitions={self.num_partitions}, routes={list(self.routes)!r})"

    def __str__(self) -> str:
        n = len(self.routes)
        head = f"{n} skip{'' if n == 1 else 's'} over {self.num_partitions} partition" \
               f"{'' if self.num_partitions == 1 else 's'}"
        return head + (":\n" + "\n".join(f"  {r}" for r in self.routes) if n else "")


def inspect_skip_layout(partitions: Sequence[nn.Module]) -> SkipRoutes:
    """Plan the skip routes of `partitions` (each an `nn.Sequential`, or a single layer);
    torchgpipe's name."""
    if isinstance(partitions, nn.Module) or not isinstance(partitions, Sequence) or not all(
        isinstance(p, nn.Module) for p in partitions
    ):
        raise TypeError(f"inspect_skip_layout takes a list of partitions (nn.Sequential or layers), got "
                        f"{describe(partitions)}")
    stashed_at: dict[tuple[Optional[Namespace], str], tuple[int, str]] = {}
    routes: list[SkipRoute] = []
    for j, partition in enumerate(partitions):
        layers = partition.named_children() if isinstance(partition, nn.Sequential) else [(str(j), partition)]
        for layer_name, layer in layers:
            if not isinstance(layer, Skippable):
                continue
            for ns, name in layer.poppable():
                if (ns, name) in stashed_at:
                    prev_j, prev_layer = stashed_at.pop((ns, name))
                    routes.append(SkipRoute(ns, name, prev_j, j, prev_layer, layer_name))
            for ns, name in layer.stashable():
                stashed_at[(ns, name)] = (j, layer_name)
    return SkipRoutes(len(partitions), routes)
