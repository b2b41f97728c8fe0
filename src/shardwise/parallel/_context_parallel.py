"""Context parallelism: one long sequence split over the ranks of a cp mesh, attention exact.

`context_parallel(mesh, buffers=[...], buffer_seq_dims=[...])` is torch's experimental
context manager, on CPU and on any device: on entry every listed buffer (input ids,
position ids, labels, rotary tables) is cut in place along its sequence dim to the tokens
this rank holds; inside it, every `F.scaled_dot_product_attention` call of the model (an
unchanged Hugging Face model's sdpa attention included) runs over the whole sequence with
this rank's queries (`_cp_attention`); on exit the buffers get their whole values back,
gathered from the ranks (unless listed in `no_restore_buffers`).

    cp = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    positions = torch.arange(ids.size(1)).expand_as(ids)
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # next-token labels, shifted once
    with context_parallel(cp, buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1]):
        # the mean over this rank's tokens (transformers computes a loss when `labels` is given,
        # and takes `shift_labels` as already shifted)
        loss = model(input_ids=ids, position_ids=positions, labels=shift, shift_labels=shift).loss
        loss.backward()

Pass `position_ids`, so the rotary tables are indexed by global positions, and labels
shifted once over the whole sequence (`shift_labels`), since a model that shifts its
`labels` itself would shift within each rank's piece. The cp ranks hold the same
parameters and each computes the gradient of its own tokens' loss: reduce the gradients
over cp as over data parallel (`fully_shard` or `data_parallel` on a mesh that includes
the cp dim), weighting by tokens when pieces differ in length.

Tokens are split head-tail by default (`SequenceLayout`); `set_load_balance(False)` gives
contiguous pieces. `set_rotate_method` picks how K/V reach the queries: `"allgather"`
(default), `"ring"` (point-to-point blocks merged by log-sum-exp), `"alltoall"` (the same
ring, each hop an all_to_all, as torch's) or `"ulysses"` (sequence <-> heads).

The block is one session object (`_cp_session.CpSession`): it owns the attention, the
buffers it cut and the state of the attention layers running, and leaves nothing behind.
The one global of this module is `_SETTINGS`, what `set_rotate_method` and
`set_load_balance` chose: torch's API makes them process-wide settings, read by every
block entered later (and by `context_parallel_unshard`). The rotation is looked up by name
there, once; each block takes the `Rotation` object from it when it is made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .._comm import all_gather_ints
from .._describe import describe
from .._mesh import DeviceMesh
from ._cp_attention import CpAttention
from ._cp_buffers import SplitBuffers, check_buffers, unshard, whole_positions
from ._cp_comm import CpGroup
from ._cp_layout import SequenceLayout
from ._cp_rotation import ALL_GATHER, ROTATIONS, Rotation
from ._cp_session import CpSession as CpSession  # (re-exported: the pipeline enters its stages' sessions by it)
# what the pipeline imports from here (its stages enter a session of their own attention)
from ._cp_session import cp_mode_on as cp_mode_on
from ._cp_session import current_cp_attention as current_cp_attention

__all__ = ["context_parallel", "context_parallel_unshard", "set_load_balance", "set_rotate_method"]


@dataclass
class _Settings:
    """What `set_rotate_method` and `set_load_balance` chose (for blocks entered later)."""

    rotation: Rotation = ALL_GATHER
    balanced: bool = True


_SETTINGS = _Settings()


def set_rotate_method(method: str) -> None:
    """How keys and values reach the queries of other ranks: "allgather" (default), "ring",
    "alltoall" or "ulysses" (see `_cp_rotation`)."""
    rotation = ROTATIONS.get(method) if isinstance(method, str) else None
    if rotation is None:
        raise ValueError(f"set_rotate_method({method!r}): the rotations are {list(ROTATIONS)}")
    _SETTINGS.rotation = rotation


def set_load_balance(balanced: bool) -> None:
    """Head-tail pieces (True, the default: rank r holds chunks r and 2cp-1-r of 2cp), or contiguous ones."""
    _SETTINGS.balanced = bool(balanced)


def cp_group(mesh: Any, what: str = "context_parallel") -> CpGroup:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} takes the cp DeviceMesh, got {describe(mesh)}")
    if mesh.ndim != 1:
        raise ValueError(f"{what} takes a 1-D cp mesh, got a {mesh.ndim}-D mesh with dims "
                         f"{mesh.mesh_dim_names}: pass its cp sub-mesh, e.g. mesh['cp']")
    return CpGroup(mesh.get_group(0), mesh.size(), mesh.get_local_rank(0), tuple(int(r) for r in mesh.mesh.tolist()))


def make_cp_attention(length: int, cp: CpGroup) -> CpAttention:
    """Attention for sequences of `length` tokens split over `cp`, by the rotation and load
    balance set now (`set_rotate_method`, `set_load_balance`)."""
    return CpAttention(SequenceLayout(length, cp.size, _SETTINGS.balanced), cp, _SETTINGS.rotation)


@contextlib.contextmanager
def context_parallel(mesh: DeviceMesh, *, buffers: Optional[Sequence[torch.Tensor]] = None,
                     buffer_seq_dims: Optional[Sequence[int]] = None,
                     no_restore_buffers: Optional[set[torch.Tensor]] = None,
                     position_ids: Optional[torch.Tensor] = None) -> Iterator[CpAttention]:
    """Split `buffers` along `buffer_seq_dims` over the 1-D cp `mesh` and run attention
    context-parallel until the block ends (see the module docstring). Yields the attention
    object (`explain()` says what it does).

    `position_ids` (a shardwise addition; (batch, seq), whole, and usually one of the
    buffers too): when several documents are packed in a sample (positions restarting),
    attention stays within each document, and a model's own mask built from the position
    ids of this rank's tokens is recognised and replaced by the global one."""
    with split_sequence(cp_group(mesh), list(buffers or []), [int(d) for d in (buffer_seq_dims or [])],
                        {id(b) for b in (no_restore_buffers or ())}, position_ids) as attention:
        yield attention


@contextlib.contextmanager
def split_sequence(cp: CpGroup, buffers: list[torch.Tensor], dims: list[int], keep: set[int],
                   position_ids: Optional[torch.Tensor], problem: Optional[Exception] = None,
                   one_document: bool = False, agree: Optional[tuple[str, int]] = None) -> Iterator[CpAttention]:
    """`context_parallel`'s body on the cp group: agree, then open a session that cuts
    `buffers` in place, runs attention context-parallel and restores the buffers not in
    `keep` (ids). `problem`: an error the caller found in its own input, raised on this rank
    after the ranks agreed; `one_document`: the position ids were made 0..S-1 (no documents
    to look for); `agree`: a (what, value) every rank must give the same value for (say,
    whether labels were passed), checked in the same exchange, so that ranks that would
    issue different collectives after the call stop with an error instead."""
    layout, positions = _agreed(cp, buffers, dims, position_ids, problem, agree)
    attention = CpAttention(layout, cp, _SETTINGS.rotation, positions, one_document)
    with CpSession(attention, SplitBuffers(buffers, dims, keep, layout, cp)):
        yield attention


def _agreed(cp: CpGroup, buffers: list[torch.Tensor], dims: list[int], position_ids: Optional[torch.Tensor],
            problem: Optional[Exception], agree: Optional[tuple[str, int]]
            ) -> tuple[SequenceLayout, Optional[torch.Tensor]]:
    """The layout of the buffers' sequence and the whole position ids, once every cp rank has
    said its input is good and of the same length (one small all_gather): a rank with bad
    input, or a sequence of another length, stops every rank with an error instead of a
    collective that never matches."""
    length, layout, positions = 0, None, None
    try:
        if problem is not None:
            raise problem
        length = check_buffers(buffers, dims)
        if not buffers:
            raise ValueError("context_parallel needs the buffers that carry the sequence (input ids, position ids, "
                             "labels) and their sequence dims: buffers=[...], buffer_seq_dims=[...]")
        layout = SequenceLayout(length, cp.size, _SETTINGS.balanced)
        positions = whole_positions(position_ids, length)
    except (TypeError, ValueError) as exc:
        problem = exc
    rows = all_gather_ints([int(problem is not None), length, agree[1] if agree else 0], cp.group, cp.size)
    if problem is not None:
        raise problem
    failed = [r for r, (bad, _, _) in enumerate(rows) if bad]
    if failed:
        raise ValueError(f"context_parallel: the input of cp rank(s) {failed} was refused (see their errors); "
                         "nothing was cut")
    values = [v for _, _, v in rows]
    if agree and len(set(values)) > 1:
        raise ValueError(f"ContextParallel: the cp ranks differ in {agree[0]}: {values} by cp rank; every cp rank "
                         "makes the same call, with the same arguments")
    lengths = [n for _, n, _ in rows]
    if len(set(lengths)) > 1:
        raise ValueError(f"context_parallel: the cp ranks hold sequences of lengths {lengths}; every cp rank passes "
                         "the whole sequence (the same buffers), and context_parallel cuts it")
    assert layout is not None
    return layout, positions


def context_parallel_unshard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int]
                             ) -> list[torch.Tensor]:
    """The whole tensors of `buffers`, each one rank's piece of a sequence split by
    `context_parallel` (with the load balance in effect), gathered over the cp `mesh`."""
    cp = cp_group(mesh)
    out = []
    for b, d in zip(buffers, seq_dims):
        d = d % b.dim()
        lengths = [n for (n,) in all_gather_ints([b.size(d)], cp.group, cp.size)]
        layout = SequenceLayout(sum(lengths), cp.size, _SETTINGS.balanced)
        if tuple(lengths) != layout.lengths:
            raise ValueError(f"context_parallel_unshard: the ranks hold {lengths} tokens, but a "
                             f"{sum(lengths)}-token sequence split {'head-tail' if layout.balanced else 'contiguously'}"
                             f" gives {list(layout.lengths)}: unshard with the load balance the sequence was split by")
        out.append(unshard(b, d, layout, cp))
    return out
