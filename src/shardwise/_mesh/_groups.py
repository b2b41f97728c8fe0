"""The process groups meshes share, and the timeout of every collective shardwise issues.

Process groups are created collectively (every process, in the same order), so they are
kept per slice of ranks and shared by every mesh that needs the same slice. One more group
spans the world for moves between meshes (`crossing_group`): their point-to-point messages
differ in number from rank to rank by nature, so they stay off the groups whose collectives
every rank issues alike (and `shardwise.testing` leaves it out of its in-step check). A
job that runs beside the program (an `async_save` agreeing from a thread) gets a
world-spanning group of its own (`side_group`), so its collectives never interleave with
the program's on a shared group. Groups a caller owns (`new_groups`) go back through
`destroy_groups`. Fault tolerance joins replica groups, each its own launch with its own
world, by a group outside every world (`replica_group`), made on the quorum's store.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from .._compat import new_group_in_order
from .._process import collective_timeout

__all__ = ["GROUPS", "POINT_TO_POINT", "collective_timeout", "crossing_group", "destroy_groups", "group_for",
           "new_groups", "replica_group", "side_group"]

GROUPS: dict[tuple[int, Any], Any] = {}  # (id of the world's group, ranks or a role) -> group
POINT_TO_POINT: set[str] = set()  # names of the groups that carry point-to-point messages only


def group_for(ranks: tuple[int, ...], backend: Optional[str]) -> Any:
    """The group over `ranks` in this order (the world's own group for the whole world in order)."""
    world = dist.group.WORLD
    if ranks == tuple(range(dist.get_world_size())):
        return world
    key = (id(world), ranks)
    group = GROUPS.get(key)
    if group is None:
        if list(ranks) == sorted(ranks):
            group = dist.new_group(list(ranks), timeout=collective_timeout(), backend=backend)
        else:
            # `new_group` sorts its ranks, but collectives must see the slice in mesh order
            # (piece j of an all_gather comes from mesh position j): keep the order given
            group = new_group_in_order(ranks, collective_timeout(), backend)
        GROUPS[key] = group
    return group


def crossing_group(backend: Optional[str] = None) -> Any:
    """The world-spanning group that moves between meshes send their pieces over; made by the
    first mesh this process builds (every process builds it, so every process makes it)."""
    key = (id(dist.group.WORLD), "crossing")
    group = GROUPS.get(key)
    if group is None:
        group = GROUPS[key] = dist.new_group(list(range(dist.get_world_size())), timeout=collective_timeout(),
                                             backend=backend)
        POINT_TO_POINT.add(group.group_name)
    return group


def new_groups(rows: Sequence[Sequence[int]], backend: Optional[str], *, point_to_point: bool = False) -> Any:
    """A new group per row of ranks, made by every process in the same order; this rank's
    (None when it is in no row). Not cached, unlike `group_for`: the caller owns the groups
    and destroys them (a pipeline's messages keep to groups of their own, which its `close()`
    releases). With `point_to_point`, this rank's group carries messages whose counts differ
    from rank to rank by nature (see `POINT_TO_POINT`)."""
    mine = None
    for row in rows:
        group = dist.new_group(list(row), timeout=collective_timeout(), backend=backend)
        if dist.get_rank() in row:
            mine = group
    if point_to_point and mine is not None:
        POINT_TO_POINT.add(mine.group_name)
    return mine


def destroy_groups(groups: Sequence[Any]) -> None:
    """Destroy groups made by `new_groups` (collective: every member calls it, in the same
    order); None and stand-ins that are no process group (a dry run's labels) are skipped."""
    for group in groups:
        if isinstance(group, dist.ProcessGroup):
            POINT_TO_POINT.discard(group.group_name)
            dist.destroy_process_group(group)


def side_group(role: str, backend: Optional[str] = None) -> Any:
    """The world-spanning group of `role` alone (e.g. "checkpoint async_save"), for collectives
    issued beside the program's, from another thread; made at the first call, which every
    process makes, in the same order as its other groups."""
    key = (id(dist.group.WORLD), ("side", role))
    group = GROUPS.get(key)
    if group is None:
        group = GROUPS[key] = dist.new_group(list(range(dist.get_world_size())), timeout=collective_timeout(),
                                             backend=backend)
    return group


def replica_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A gloo group of `size` processes, one per replica group, joined through `store` (a prefix
    of the quorum's store that no other group uses); this process is `rank`. It belongs to no
    world: the caller owns it and drops it when the quorum's members change."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)
