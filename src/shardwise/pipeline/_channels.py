"""The channels of a pipeline's messages: each kind of message between two stages, numbered
the same way on every process (a message's tag depends on its channel's number)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ._schedule import Action
from .skip import Namespace, SkipRoutes
from .skip._tracker import SkipKey

__all__ = ["Channel", "ChannelPlan"]


@dataclass(frozen=True)
class Channel:
    """The messages of one kind from stage `src_stage` (on global rank `src_rank`) to
    `dst_stage` (on `dst_rank`), one per micro-batch; `index` numbers it in the pipeline."""

    index: int
    kind: str  # "activation" | "gradient" | "skip" | "skip gradient" | "shared gradient"
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    skip: str = ""  # the skip's name (and namespace) for skip channels
    src_ranks: tuple[int, ...] = ()  # crossing between rows of different sizes: the sending row's ranks
    dst_ranks: tuple[int, ...] = ()  # and the receiving row's (empty: one partner each side)

    @property
    def crossing(self) -> bool:
        return bool(self.src_ranks)

    @property
    def local(self) -> bool:
        return not self.crossing and self.src_rank == self.dst_rank

    def label(self, microbatch: int) -> str:
        if self.kind == "shared gradient":  # once per step, after every micro-batch
            return (f"the gradients of shared parameters {self.skip} (pp index {self.src_stage} -> "
                    f"{self.dst_stage})")
        what = f"{self.kind} {self.skip}" if self.skip else self.kind
        return f"the {what} of micro-batch {microbatch} (stage {self.src_stage} -> {self.dst_stage})"


class ChannelPlan:
    """Every channel of a pipeline of `num_stages` stages, stage `s` on global rank `rank_of[s]`
    (this rank's partner there); with `rows` (stage `s` on the tp row of ranks `rows[s]`), a
    channel between rows of different sizes crosses by the cross-mesh planner instead (see
    `_crossing`). Activations `s -> s+1`, gradients `s+1 -> s`, and for each skip that crosses stages one
    channel from its stash stage to its pop stage and one back. Numbered the same way on
    every process (tags depend on it), so skips are ordered by where they are stashed and
    popped, never by namespace: `SkipRoutes.routes` sorts namespaces by their ids, which are
    random per process.

    >>> from shardwise.pipeline.skip import SkipRoutes, SkipRoute
    >>> plan = ChannelPlan(3, SkipRoutes(3, [SkipRoute(None, "x", 0, 2)]), rank_of=[0, 1, 2])
    >>> for c in plan.channels:
    ...     print(c.index, c.label(0))
    0 the activation of micro-batch 0 (stage 0 -> 1)
    1 the activation of micro-batch 0 (stage 1 -> 2)
    2 the gradient of micro-batch 0 (stage 1 -> 0)
    3 the gradient of micro-batch 0 (stage 2 -> 1)
    4 the skip 'x' of micro-batch 0 (stage 0 -> 2)
    5 the skip gradient 'x' of micro-batch 0 (stage 2 -> 0)
    >>> [c.index for c in plan.outgoing(Action("F", 0, 0))]  # stage 0's forward: activation and skip
    [0, 4]
    """

    def __init__(self, num_stages: int, layout: SkipRoutes, rank_of: Sequence[int],
                 rows: Optional[Sequence[tuple[int, ...]]] = None) -> None:
        self.channels: list[Channel] = []
        self.num_stages = num_stages
        crossing = sorted((r for r in layout.routes if r.stash_partition != r.pop_partition),
                          key=lambda r: (r.stash_partition, r.pop_partition, r.stash_layer or "", r.pop_layer or "",
                                         r.name))

        def channel(kind: str, src: int, dst: int, skip: str = "") -> Channel:
            across = rows is not None and len(rows[src]) != len(rows[dst])  # no partner: the rows differ in size
            c = Channel(len(self.channels), kind, src, dst, rank_of[src], rank_of[dst], skip,
                        tuple(rows[src]) if across else (), tuple(rows[dst]) if across else ())  # type: ignore[index]
            self.channels.append(c)
            return c

        S = num_stages
        self.activation = {s: channel("activation", s, s + 1) for s in range(S - 1)}
        self.gradient = {s: channel("gradient", s, s - 1) for s in range(1, S)}
        self.skip = {(r.ns, r.name): channel("skip", r.stash_partition, r.pop_partition, _skip_name(r.ns, r.name))
                     for r in crossing}
        self.skip_grad = {(r.ns, r.name): channel("skip gradient", r.pop_partition, r.stash_partition,
                                                  _skip_name(r.ns, r.name)) for r in crossing}
        self.stashed_at: dict[int, list[SkipKey]] = {
            s: [(r.ns, r.name) for r in crossing if r.stash_partition == s] for s in range(S)}
        self.popped_at: dict[int, list[SkipKey]] = {
            s: [(r.ns, r.name) for r in crossing if r.pop_partition == s] for s in range(S)}

    def outgoing(self, a: Action) -> list[Channel]:
        """The channels on which action `a` sends (its forward's output and stashes, or its
        backward's input gradient and popped skips' gradients)."""
        s, last = a.stage, self.num_stages - 1
        if a.kind == "F":
            return ([self.activation[s]] if s < last else []) + [self.skip[k] for k in self.stashed_at[s]]
        return ([self.gradient[s]] if s > 0 else []) + [self.skip_grad[k] for k in self.popped_at[s]]


def _skip_name(ns: Optional[Namespace], name: str) -> str:
    return f"'{name}'" if ns is None else f"'{name}' in {ns!r}"
