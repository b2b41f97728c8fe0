"""Skip connections across pipeline partitions (torchgpipe's `torchgpipe.skip` API).

`@skippable(stash=[...], pop=[...])` layers `yield stash(name, tensor)` and
`tensor = yield pop(name)`; `Namespace` and `.isolate(ns)` keep same-named skips apart;
`verify_skippables(module)` checks the pairing; `inspect_skip_layout(partitions)` plans
the routes a `Pipe` uses; trackers say where a skip waits (`use_skip_tracker`).
"""

from ._routes import SkipRoutes, SkipRoute, inspect_skip_layout
from ._namespace import Namespace
from ._portal import Portal
from ._skippable import Skippable, pop, skippable, stash
from ._tracker import SkipTracker, SkipTrackerThroughPortals, current_skip_tracker, use_skip_tracker
from ._verify import verify_skippables

__all__ = [
    "Namespace",
    "Portal",
    "SkipRoutes",
    "SkipRoute",
    "SkipTracker",
    "SkipTrackerThroughPortals",
    "Skippable",
    "current_skip_tracker",
    "inspect_skip_layout",
    "pop",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]
