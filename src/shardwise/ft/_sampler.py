"""`ReplicaSampler`: each step's global batch, re-partitioned over the groups alive at that step.

The data are a function of the committed step, not of who is alive: committed step `s`
trains on the `s`-th global batch of `global_batch_size` samples, taken in order from the
epoch's permutation (`seed + epoch`; an epoch is `num_samples // global_batch_size` steps,
the remainder dropped). Each step that batch is cut into one part per quorum member (as even
as possible, the first parts one longer), and each part into one piece per rank of the
group alike. So,
within an epoch:

- every sample is trained on exactly once by the committed steps, whatever groups fail,
  join or heal (a discarded step's batch is the next attempt's: the step did not advance);
- a group's weight in the gradient average (`manager.samples`) is the size of its part, so
  uneven parts average to the whole batch's mean, as one process on that batch would.

>>> s = ReplicaSampler(10, 4, shuffle=False)
>>> [s.indices(step=1, members=2, member=m, rank=0, ranks=1) for m in range(2)]
[[4, 5], [6, 7]]
>>> s.indices(step=2, members=3, member=0, rank=0, ranks=1)  # epoch 1 starts: 10 // 4 = 2 steps an epoch
[0, 1]
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ReplicaSampler"]


class ReplicaSampler:
    """Sample indices of `num_samples` for this rank at each step (see the module docstring);
    with a `manager`, its step and quorum are read and its `samples` weight is set."""

    def __init__(self, num_samples: int, global_batch_size: int, manager: Any = None, *, shuffle: bool = True,
                 seed: int = 0) -> None:
        if not 0 < global_batch_size <= num_samples:
            raise ValueError(f"ReplicaSampler: global_batch_size={global_batch_size} must be in [1, num_samples="
                             f"{num_samples}]")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.manager, self.shuffle, self.seed = manager, shuffle, seed
        self.steps_per_epoch = num_samples // global_batch_size
        self._order: Optional[tuple[int, torch.Tensor]] = None  # (epoch, its permutation)

    def global_batch(self, step: int) -> list[int]:
        """The samples of committed step `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            order = (torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
                     if self.shuffle else torch.arange(self.num_samples))
            self._order = (epoch, order)
        start = within * self.global_batch_size
        return self._order[1][start:start + self.global_batch_size].tolist()

    def indices(self, step: Optional[int] = None, members: Optional[int] = None, member: Optional[int] = None,
                rank: Optional[int] = None, ranks: Optional[int] = None) -> list[int]:
        """This rank's samples at `step` when it is rank `rank` of `ranks` in quorum member `member`
        of `members` (each read from the manager when not given)."""
        m = self.manager
        if m is not None:
            step = m.current_step() if step is None else step
            members = m.num_participants() if members is None else members
            member = m.participating_rank() if member is None else member
            rank, ranks = (m.rank if rank is None else rank), (m.world_size if ranks is None else ranks)
        if step is None or not members or member is None or rank is None or not ranks:
            raise ValueError("ReplicaSampler.indices: outside a quorum; call it after the step's start_quorum (the "
                             "Optimizer wrapper's zero_grad), or pass step, members, member, rank and ranks")
        part = _piece(self.global_batch(step), member, members)
        if m is not None:
            m.samples = float(len(part))
        return _piece(part, rank, ranks)


def _piece(items: list[int], i: int, n: int) -> list[int]:
    """Piece `i` of `n` of `items`, as even as possible (the first pieces one longer)."""
    size, extra = divmod(len(items), n)
    start = i * size + min(i, extra)
    return items[start:start + size + (i < extra)]
