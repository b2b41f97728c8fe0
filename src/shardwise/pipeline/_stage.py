"""Pipeline stages on ranks: one partition's layers, how to run a micro-batch through them,
and the skip tracker that sends skips between ranks.

`split_module(module, balance)` cuts an `nn.Sequential` into partitions exactly as `Pipe`
does (same validation, same messages); a rank keeps only the partitions its schedule
gives it, each as a `PipelineStage`. A stage runs one micro-batch at a time, optionally
checkpointed (forward without keeping activations, recomputed in backward with the same
random numbers), with a skip tracker installed so `@skippable` layers find their skips.

`SkipTrackerThroughRanks` is that tracker for stages on different processes. A skip whose
stash and pop are in one stage stays in the plain dict. A skip that crosses stages is
taken out of the forward when stashed (the runtime sends it straight to the popping
stage's rank, never through the stages between) and hidden from autograd behind a
`Portal`'s blue end joined to the stage's output; the popping stage receives it as a
leaf. After the popping stage's backward, the leaf's gradient goes straight back, is put
into the portal, and the stashing stage's backward hands it to the stashed tensor. Under
checkpointing the stash runs twice (no-grad forward, then the recomputation in backward):
the first sends, the second only rebuilds the autograd edge for the gradient.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Optional

from torch import Tensor, nn

from .._describe import describe

from ._checkpoint import Checkpointing
from ._microbatch import Batch, BatchValue
from ._pipe import check_arguments
from .skip import Namespace, Portal, SkipRoutes, SkipTracker, SkipTrackerThroughPortals, use_skip_tracker
from .skip._tracker import SkipKey

__all__ = ["PipelineStage", "SkipTrackerThroughRanks", "split_module"]


def split_module(module: nn.Sequential, balance: Sequence[int], *, chunks: int = 1,
                 checkpoint: str = "except_last", allow_shared: bool = False) -> list[nn.Sequential]:
    """`module`'s layers cut into `len(balance)` partitions (`balance[j]` layers in partition
    `j`), after the checks `Pipe` makes: an `nn.Sequential` without duplicate children,
    positive balance entries adding up to `len(module)`, valid `chunks` and `checkpoint`,
    matching skips, no parameter shared across partitions (unless `allow_shared`). All
    problems are raised at once."""
    balance = check_arguments(module, balance, chunks, checkpoint, "pipeline", allow_shared=allow_shared)
    layers = iter(module._modules.items())
    return [nn.Sequential(OrderedDict(next(layers) for _ in range(size))) for size in balance]


class SkipTrackerThroughRanks(SkipTrackerThroughPortals):
    """The skips of one micro-batch on one rank, for stages on different ranks (see module doc).

    The runtime calls `take_outbox()` after a stage's forward (skips to send), `deliver()`
    before a popping stage's forward, `popped_grad()` after its backward, and `put_grad()`
    before the stashing stage's backward.
    """

    def __init__(self, skip_routes: SkipRoutes) -> None:
        super().__init__(skip_routes)
        self.outbox: list[tuple[SkipKey, Optional[Tensor]]] = []
        self.inbox: dict[SkipKey, Optional[Tensor]] = {}

    def _new_portal(self, ns: Optional[Namespace], name: str, tensor: Optional[Tensor]) -> Portal:
        # the forward: send the tensor, keep the gradient's way back (a recomputation of a
        # checkpointed stage finds the portal and only rebuilds the edge)
        self.outbox.append(((ns, name), None if tensor is None else tensor.detach()))
        return Portal(tensor, 1)

    def load(self, batch: Batch, ns: Optional[Namespace], name: str) -> Optional[Tensor]:
        if not self.skip_routes.requires_copy(ns, name):
            return SkipTracker.load(self, batch, ns, name)
        return self.inbox[(ns, name)]  # KeyError: never delivered, which the layer reports

    def take_outbox(self) -> list[tuple[SkipKey, Optional[Tensor]]]:
        """The skips stashed since the last call, to send to their popping stages."""
        out, self.outbox = self.outbox, []
        return out

    def deliver(self, key: SkipKey, tensor: Optional[Tensor]) -> None:
        """A skip received for a stage of this rank that pops it."""
        self.inbox[key] = tensor

    def popped_grad(self, key: SkipKey) -> Optional[Tensor]:
        """After the popping stage's backward: the popped skip's gradient (None if it got none)."""
        tensor = self.inbox.pop(key)
        return tensor.grad if tensor is not None and tensor.requires_grad else None

    def put_grad(self, key: SkipKey, grad: Optional[Tensor]) -> None:
        """Before the stashing stage's backward: the gradient that came back for its skip."""
        portal = self.portals[key]
        if grad is not None:
            portal.put_grad(grad)

    def release(self, keys: Sequence[SkipKey]) -> None:
        """Drop the portals of skips whose stashing stage has finished its backward."""
        for key in keys:
            self.portals.pop(key, None)


class PipelineStage:
    """Partition `index` (of `num_stages`) on global rank `rank`: its layers and how to run them."""

    def __init__(self, partition: nn.Sequential, index: int, num_stages: int, rank: int) -> None:
        if not isinstance(partition, nn.Sequential):
            raise TypeError(f"PipelineStage takes its partition as an nn.Sequential, got {describe(partition)}")
        for name, value in (("index", index), ("num_stages", num_stages), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PipelineStage({name}=...) takes an int, got {describe(value)}")
        if rank < 0:
            raise ValueError(f"PipelineStage(rank={rank}) must be a global rank, >= 0")
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is out of range for {num_stages} stages: use one in "
                             f"[0, {num_stages - 1}]")
        self.partition = partition
        self.index = index
        self.num_stages = num_stages
        self.rank = rank

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def run(self, value: BatchValue, tracker: SkipTracker, *, checkpoint: bool) -> Batch:
        """One micro-batch through the partition, with `tracker` installed; checkpointed: its
        activations are dropped now and recomputed when the output's backward runs."""
        function = _WithTracker(self.partition, tracker)
        if not checkpoint:
            return Batch(function(value))
        chk = Checkpointing(function, Batch(value))
        output = chk.checkpoint()
        chk.recompute(output)
        return output

    def __repr__(self) -> str:
        return (f"PipelineStage(index={self.index}, num_stages={self.num_stages}, rank={self.rank}, "
                f"layers={len(self.partition)})")


class _WithTracker:
    def __init__(self, partition: nn.Sequential, tracker: SkipTracker) -> None:
        self.partition, self.tracker = partition, tracker

    def __call__(self, value: BatchValue) -> BatchValue:
        with use_skip_tracker(self.tracker):
            out: Any = self.partition(value)
        if not isinstance(out, (Tensor, tuple)):
            raise TypeError(f"a pipeline stage must return a Tensor or a tuple holding a Tensor, got "
                            f"{type(out).__name__}")
        return out

