"""Local computations for ops whose pieces cannot run the plain aten op.

A vocab-sharded embedding holds rows [start, start + n) of the weight on each rank while
the ids stay global; a mean loss over samples split across ranks must divide by the total
weight of all samples. The masking math lives, pure, in `shardwise._ops._nn`; this module
hands it each rank's coordinate and the specs the inputs have as the op runs, and then
tells the strategies that those candidates are safe to offer (`use_masked_local`).

Storage ops (as_strided, resize_) run replicated, on a whole copy of the tensor; they read
its elements in storage order, so that copy must have the global tensor's strides (a
transposed DTensor gathers into a contiguous piece).
"""

from __future__ import annotations

from typing import Any

import torch

from .._ops._nn import (
    MASKED_LOCAL_OPS,
    embedding_backward_local,
    embedding_local,
    nll_loss_local,
    use_masked_local,
)
from .._spec import DTensorSpec
from ._dispatch import register_local_impl

__all__: list[str] = []

aten = torch.ops.aten


def _coordinate(spec: Any) -> tuple[int, ...]:
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this process is not part of the mesh {spec.mesh!r} of the DTensor it computes on")
    return tuple(coordinate)


@register_local_impl(aten.embedding.default, with_input_specs=True)
def _embedding(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
               input_specs: tuple[DTensorSpec, ...]) -> torch.Tensor:
    weight = input_specs[0]
    return embedding_local(func, args, kwargs, weight, _coordinate(weight))


@register_local_impl(aten.embedding_dense_backward.default)
def _embedding_backward(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    return embedding_backward_local(func, args, kwargs, output_spec, _coordinate(output_spec))


@register_local_impl([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default], with_input_specs=True)
def _nll_loss(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
              input_specs: tuple[DTensorSpec, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    me, target = input_specs[0], input_specs[1]
    return nll_loss_local(func, args, kwargs, me, target, _coordinate(me))


use_masked_local(MASKED_LOCAL_OPS)


_STORAGE_OPS = [
    aten.as_strided.default, aten.as_strided_.default, aten.as_strided_copy.default,
    aten.as_strided_scatter.default, aten.resize_.default, aten.resize_as_.default,
]


@register_local_impl(_STORAGE_OPS, with_input_specs=True)
def _storage_op(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any, *,
                input_specs: tuple[DTensorSpec, ...]) -> Any:
    me, local = input_specs[0], args[0]
    if local.stride() != me.tensor_meta.stride:
        args[0] = torch.empty_strided(me.shape, me.tensor_meta.stride, dtype=local.dtype, device=local.device)
        args[0].copy_(local)
    return func(*args, **kwargs)
