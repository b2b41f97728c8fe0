"""Skip trackers: where a stashed skip tensor waits, per micro-batch, until it is popped.

A `@skippable` layer never touches devices or autograd itself: it asks the *current
tracker* (thread-local, set with `use_skip_tracker`) to `save` what it stashes and to
`load` what it pops. That keeps the layer code the same in every runtime:

- `SkipTracker` (the default, created lazily per thread) is a dict: `@skippable` layers
  work in a bare `nn.Sequential`, eagerly, with autograd seeing the tensor directly.
- `SkipTrackerThroughPortals` (what `Pipe` installs, one per micro-batch) sends every
  skip whose stash and pop are in different partitions through a `Portal`: straight
  from the stashing partition's device to the popping one, gradient straight back,
  freed as soon as it is popped. Skips inside one partition still use the dict.

Interface for other runtimes (a multi-process one subclasses `SkipTracker`):
`save(batch, ns, name, tensor)` is called after the stashing layer returns, with that
layer's output batch (attach autograd edges to `batch[batch.find_tensor_idx()]`);
`load(batch, ns, name)` before the popping layer runs, with its input batch, returning
the tensor (or `None`) and raising `KeyError` when nothing was stashed under that name;
`copy(batch, prev_stream, next_stream, ns, name)` is called by the pipeline before
partition `j` runs, once per route in `SkipRoutes.copy_policy(j)`, with the batch
about to enter partition `j`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional, Protocol

from torch import Tensor

from .._checkpoint import is_checkpointing
from .._dependency import fork, join
from .._microbatch import Batch
from .._stream import AbstractStream
from ._namespace import Namespace
from ._portal import Portal

__all__ = ["SkipTracker", "SkipTrackerThroughPortals", "current_skip_tracker", "use_skip_tracker"]

SkipKey = tuple[Optional[Namespace], str]


class SkipTracker:
    """The skip tensors of one micro-batch, by `(namespace, name)`, in a plain dict."""

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Optional[Namespace], name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Optional[Namespace], name: str) -> Optional[Tensor]:
        return self.tensors.pop((ns, name))

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Optional[Namespace], name: str) -> None:
        raise TypeError(
            f"copy is not supported for non-portal skip tensors (skip {name!r}): only a tracker "
            "that moves skips between partitions (SkipTrackerThroughPortals) can copy"
        )


class _Routes(Protocol):
    """What a tracker asks of a `SkipRoutes` (`_routes` imports this module through
    `_skippable`, so this one names only the question it asks: no import circle)."""

    def requires_copy(self, ns: Optional[Namespace], name: str) -> bool: ...


class SkipTrackerThroughPortals(SkipTracker):
    """Routes skips that cross partitions of `skip_routes` through portals (one micro-batch)."""

    def __init__(self, skip_routes: _Routes) -> None:
        super().__init__()
        self.skip_routes = skip_routes
        self.portals: dict[SkipKey, Portal] = {}

    def save(self, batch: Batch, ns: Optional[Namespace], name: str, tensor: Optional[Tensor]) -> None:
        if not self.skip_routes.requires_copy(ns, name):
            super().save(batch, ns, name, tensor)
            return
        portal = self.portals.get((ns, name))
        if portal is None:
            portal = self.portals[(ns, name)] = self._new_portal(ns, name, tensor)
        else:
            # The stashing partition is being recomputed: the recomputed tensor is needed
            # only by the new blue(), whose backward hands the gradient to it.
            portal.put_tensor(tensor, 1)
        phony = portal.blue()
        k = batch.find_tensor_idx()
        batch[k] = join(batch[k], phony)

    def _new_portal(self, ns: Optional[Namespace], name: str, tensor: Optional[Tensor]) -> Portal:
        # Uses still to come: the stash's blue(), the pop's orange(), and under
        # checkpointing the pop's orange() again when its partition is recomputed.
        return Portal(tensor, 3 if is_checkpointing() else 2)

    def load(self, batch: Batch, ns: Optional[Namespace], name: str) -> Optional[Tensor]:
        if not self.skip_routes.requires_copy(ns, name):
            return super().load(batch, ns, name)
        portal = self.portals[(ns, name)]
        k = batch.find_tensor_idx()
        batch[k], phony = fork(batch[k])
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Optional[Namespace], name: str) -> None:
        portal = self.portals[(ns, name)]
        k = batch.find_tensor_idx()
        batch[k], phony = fork(batch[k])
        phony = portal.copy(prev_stream, next_stream, phony)
        batch[k] = join(batch[k], phony)


class _Current(threading.local):
    tracker: Optional[SkipTracker] = None


_current = _Current()


def current_skip_tracker() -> SkipTracker:
    """The tracker of this thread: the one installed by `use_skip_tracker`, else a plain one."""
    tracker = _current.tracker
    if tracker is None:
        tracker = _current.tracker = SkipTracker()
    return tracker


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Install `tracker` as this thread's current tracker inside the block."""
    previous = _current.tracker
    _current.tracker = tracker
    try:
        yield
    finally:
        _current.tracker = previous
