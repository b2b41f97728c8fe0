"""The process groups meshes share, and the timeout of every collective shardwise issues.

Process groups are created collectively (every process, in the same order), so they are
kept per slice of ranks and shared by every mesh that needs the same slice. One more group
spans the world for moves between meshes (`crossing_group`): their point-to-point messages
differ in number from rank to rank by nature, so they stay off the groups whose collectives
every rank issues alike (and `shardwise.testing` leaves it out of its in-step check).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ._compat import new_group_in_order

__all__ = ["GROUPS", "POINT_TO_POINT", "collective_timeout", "crossing_group", "group_for"]

GROUPS: dict[tuple[int, Any], Any] = {}  # (id of the world's group, ranks or a role) -> group
POINT_TO_POINT: set[str] = set()  # names of the groups that carry point-to-point messages only


def collective_timeout() -> timedelta:
    """Timeout of every collective shardwise issues (env `SHARDWISE_COLLECTIVE_TIMEOUT`, seconds)."""
    return timedelta(seconds=float(os.environ.get("SHARDWISE_COLLECTIVE_TIMEOUT", "300")))


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
