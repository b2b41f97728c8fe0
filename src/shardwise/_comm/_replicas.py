"""Collectives between replica groups: the fault-tolerant reduction and the healing transfer.

Replica groups are separate launches, each with its own world, so the group that joins
them (made per quorum by `_mesh.replica_group`) is not a group of any world: no global
ranks, no world store to diagnose a failure with. Its messages go through here instead of
`_p2p` and `_bucket`, and are told to the door's hooks the same way (`comm_log` counts
them). A failure, timeout or peer gone, raises `ReplicaError` within the group's
fault-tolerance timeout, naming the operation and the replica ranks: the caller (the
manager) records it, and that step is not committed anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ._door import CommRecord, notify

__all__ = ["ReplicaError", "replica_all_reduce", "replica_recv", "replica_send"]


class ReplicaError(RuntimeError):
    """A message between replica groups did not complete (`what`: the operation)."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {cause}")
        self.what = what


def _waited(work: dist.Work, timeout: timedelta, what: str) -> None:
    try:
        work.wait(timeout)
    except RuntimeError as exc:
        raise ReplicaError(what, exc) from exc


def replica_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, size: int, timeout: timedelta,
                       label: str) -> None:
    """Sum `flat` (contiguous) in place over the `size` replica ranks of `group`, in replica-rank
    order for every element: `((x0 + x1) + x2) + ...`, the same bits on every rank and in a
    one-process replay (a ring all_reduce adds in an order that moves with the chunk). Each
    rank adds up one chunk of everyone's (an all_to_all) and the sums are gathered: the bytes
    of a ring all_reduce, in two messages."""
    what = f"all_reduce of {label} ({flat.numel()} x {flat.dtype}) over {size} replica groups"
    if size > 1:
        n, chunk = flat.numel(), -(-flat.numel() // size)
        # `flat` itself when it splits evenly (the sums are gathered back into it), else a padded copy
        mine = flat.view(-1) if n == size * chunk else torch.cat([flat.reshape(-1), flat.new_zeros(size * chunk - n)])
        theirs = torch.empty_like(mine)  # row j: replica rank j's piece of this rank's chunk
        try:
            _waited(group.alltoall_base(theirs, mine, [], []), timeout, what)
            rows = theirs.view(size, chunk)
            total = rows[0].clone()
            for j in range(1, size):
                total += rows[j]
            _waited(group._allgather_base(mine, total), timeout, what)
        except RuntimeError as exc:
            raise exc if isinstance(exc, ReplicaError) else ReplicaError(what, exc) from exc
        if mine.data_ptr() != flat.data_ptr():
            flat.copy_(mine[:n].view_as(flat))
    notify(CommRecord("all_reduce", size, 2 * (size - 1) * flat.numel() * flat.element_size() // max(size, 1)))


def replica_send(tensors: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup, timeout: timedelta,
                 label: str, tag: int = 0) -> None:
    """Send each of `tensors` (contiguous) to replica rank `dst`, in order, each waited for."""
    _one_by_one("send", tensors, dst, group, timeout, label, tag)


def replica_recv(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup, timeout: timedelta,
                 label: str, tag: int = 0) -> None:
    """Receive into each of `tensors` (contiguous) from replica rank `src`, in order."""
    _one_by_one("recv", tensors, src, group, timeout, label, tag)


def _one_by_one(op: str, tensors: Sequence[torch.Tensor], peer: int, group: dist.ProcessGroup, timeout: timedelta,
                label: str, tag: int) -> None:
    for t in tensors:
        what = f"{op} of {label} ({t.numel()} x {t.dtype}) {'to' if op == 'send' else 'from'} replica rank {peer}"
        try:
            work = group.send([t], peer, tag) if op == "send" else group.recv([t], peer, tag)
        except RuntimeError as exc:
            raise ReplicaError(what, exc) from exc
        _waited(work, timeout, what)
        notify(CommRecord(op, 2, 0 if op == "send" else t.numel() * t.element_size()))
