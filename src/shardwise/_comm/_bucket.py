"""All-reducing tensors over one group: one tensor, or many in buckets (the one bucketer).

Gradient reduction at the end of backward, data parallel and the pipeline's data-parallel
replicas all reduce many small tensors over the same group; one all_reduce per tensor
would pay the latency each time. `all_reduce_coalesced` flattens them into buckets of
about `BUCKET_BYTES` and issues one all_reduce per bucket:

- tensors are taken in the order given (the same on every rank: backward order, or
  registration order), one open bucket per (dtype, device); a bucket is issued when the
  next tensor would take it past the cap, the rest at the end, in the order they opened;
- a rank may have no value for some tensors (a parameter this replica did not use): give
  `None` and a `template` of its shape, dtype and device; zeros stand in for it and a
  presence flag travels with the bucket, so a tensor no rank had comes back `None` and
  one that some ranks had is reduced with zeros from the others (as torch's DDP does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ._collectives import AllReduce
from ._door import run
from ._fault import CollectiveError

__all__ = ["BUCKET_BYTES", "all_reduce", "all_reduce_coalesced", "plan_buckets"]

BUCKET_BYTES = 25 * 2**20


def all_reduce(local: torch.Tensor, group: Any, size: int, op: str, mesh_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """Reduce `local` over `group` (`size` ranks) with `op`; every rank gets the result (a new tensor)."""
    record = AllReduce(group=group, size=size, shape=tuple(local.shape), dtype=local.dtype, mesh_dims=mesh_dims, op=op)
    return run(record, local)


def plan_buckets(items: Sequence[tuple[int, Any]], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `items` ((bytes, key) each) grouped into buckets of at most `bucket_bytes`
    (a single larger item gets a bucket of its own), one open bucket per key: the full
    buckets in the order they filled, then the open ones in the order their keys came.

    >>> plan_buckets([(4, "f32"), (4, "f64"), (4, "f32"), (4, "f32")], bucket_bytes=8)
    [[0, 2], [3], [1]]
    """
    open_: dict[Any, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for k, (nbytes, key) in enumerate(items):
        bucket, size = open_.get(key, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            done.append(bucket)
            bucket, size = [], 0
        open_[key] = (bucket + [k], size + nbytes)
    return done + [bucket for bucket, _ in open_.values() if bucket]


def all_reduce_coalesced(
    values: Sequence[Optional[torch.Tensor]],
    group: Any,
    size: int,
    op: str,
    *,
    templates: Optional[Sequence[torch.Tensor]] = None,
    bucket_bytes: int = BUCKET_BYTES,
    mesh_dims: tuple[int, ...] = (),
) -> list[Optional[torch.Tensor]]:
    """Reduce every tensor of `values` over `group` with `op`, one all_reduce per bucket.

    Each result is a view of its bucket, shaped like its value. With `templates` (one per
    value), a value may be None (see the module docstring); without, none may be."""
    flags = templates is not None
    like = list(templates) if templates is not None else list(values)
    items: list[tuple[int, Any]] = []
    for value, t in zip(values, like):
        if t is None:
            raise ValueError("all_reduce_coalesced got None without a template: pass templates= for absent values")
        ref = value if value is not None else t
        items.append((ref.numel() * ref.element_size(), (ref.dtype, ref.device)))
    out: list[Optional[torch.Tensor]] = [None] * len(values)
    buckets = plan_buckets(items, bucket_bytes)
    for number, bucket in enumerate(buckets):
        first = like[bucket[0]]
        assert first is not None
        parts = []
        for k in bucket:
            value, t = values[k], like[k]
            assert t is not None
            parts.append(value.reshape(-1) if value is not None else t.new_zeros(t.numel()))
        if flags:
            present = [0.0 if values[k] is None else 1.0 for k in bucket]
            parts.append(torch.tensor(present, dtype=first.dtype, device=first.device))
        flat = torch.cat(parts)  # (sum of numels [+ one flag per value],)
        if size > 1:
            try:
                flat = all_reduce(flat, group, size, op, mesh_dims)
            except CollectiveError as exc:
                raise exc.add_operation(f"bucket {number} of {len(buckets)} ({len(bucket)} tensors, "
                                        f"{flat.numel() * flat.element_size()} B)")
        if not flags:
            used = [1.0] * len(bucket)
        else:  # a dry run's meta flags: every rank is taken to have what this one has
            used = present if flat.is_meta else flat[-len(bucket):].tolist()
        offset = 0
        for k, flag in zip(bucket, used):
            t = like[k]
            assert t is not None
            shape = values[k].shape if values[k] is not None else t.shape  # type: ignore[union-attr]
            numel = t.numel() if values[k] is None else values[k].numel()  # type: ignore[union-attr]
            if flag != 0:
                out[k] = flat.narrow(0, offset, numel).view(shape)
            offset += numel
    return out
