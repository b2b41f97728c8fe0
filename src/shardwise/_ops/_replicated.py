"""Ops whose distributed meaning is "on the whole tensor, on every rank": replicated by design.

Their inputs are gathered, they run on every rank and their outputs are `Replicate`, with
no warning, in strict mode too:

| ops | why |
|---|---|
| item, equal, allclose, is_nonzero | the result is a Python value |
| nonzero, masked_select, unique*, histc, bincount, histogram* | the output's shape depends on the data |
| hash_tensor | an order-dependent hash of every element |
| linspace / logspace with tensor endpoints | the endpoints arrive as (replicated) 0-dim tensors |
| as_strided*, resize_, resize_as_ | defined on the storage of a contiguous tensor, which only the whole tensor has |
| rrelu_with_noise | draws from torch's generator in an order tied to the whole tensor (ranks share its state, so every rank draws the single-device values) |

The storage ops read elements in storage order, so the whole copy they run on must have
the global tensor's strides (a transposed DTensor gathers into a contiguous piece): their
local implementation re-lays the gathered piece first. `as_strided_`, `resize_` and
`resize_as_` give self the result's shape in place (`relayout`).
"""

from __future__ import annotations

from typing import Any

import torch

from ._local import LocalCall
from ._registry import OpKind, register_op_kind

__all__ = ["REPLICATED_OPS", "STORAGE_OPS"]

aten = torch.ops.aten

STORAGE_OPS = (
    aten.as_strided.default, aten.as_strided_.default, aten.as_strided_copy.default,
    aten.as_strided_scatter.default, aten.resize_.default, aten.resize_as_.default,
)

REPLICATED_OPS = (
    aten._local_scalar_dense.default, aten.equal.default, aten.allclose.default, aten.is_nonzero.default,
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten.unique_dim.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default, aten.histc.default, aten.bincount.default,
    aten.histogram.bin_ct, aten.histogram.bins_tensor, aten._histogramdd_bin_edges.default,
    aten._histogramdd_from_bin_cts.default, aten._histogramdd_from_bin_tensors.default,
    aten.hash_tensor.default, aten.linspace.Tensor_Scalar, aten.linspace.Tensor_Tensor,
    aten.linspace.Scalar_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Tensor_Tensor,
    aten.logspace.Scalar_Tensor,
    aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default,
) + STORAGE_OPS


def _storage_op(call: LocalCall) -> Any:
    """Run a storage op on a whole copy laid out with the global tensor's strides."""
    me, local = call.input_specs[0], call.args[0]
    if local.stride() != me.tensor_meta.stride:
        call.args[0] = torch.empty_strided(me.shape, me.tensor_meta.stride, dtype=local.dtype, device=local.device)
        call.args[0].copy_(local)
    return call.run_op()


register_op_kind(
    REPLICATED_OPS,
    OpKind.REPLICATED,
    local={op: _storage_op for op in STORAGE_OPS},
    relayout=[aten.as_strided_.default, aten.resize_.default, aten.resize_as_.default],
    outside_answers={aten.equal.default: True, aten.allclose.default: True},  # empty pieces compare equal
)
