"""Strategies for FFTs and complex reinterpretation: `_fft_*`, conjugation, `view_as_real/complex`.

Every `torch.fft.*` call reaches dispatch as one of three kernels, each transforming a
list of tensor dims (`dim`) of one input: `_fft_c2c` (complex to complex), `_fft_r2c`
(real to complex; `onesided` halves the last transformed dim to `n // 2 + 1`) and
`_fft_c2r` (complex to real; `last_dim_size` restores the last transformed dim). The
Hermitian variants (`hfft*`, `ihfft*`) add a conjugation (`_conj`, `_conj_physical`),
and the shifts (`fftshift`) arrive as `roll`, which `_shape` handles.

A transform mixes every element along its dims and nothing across the others, so:

| tensor dim | layout |
|---|---|
| transformed (in `dim`) | Replicate (a Shard there moves to a batch dim or is gathered) |
| any other | keeps its Shard: every rank transforms its own batch rows |

except where a split would leave some rank an empty piece (`torch.chunk` sizes: 6 rows
on 4 ranks are 2, 2, 2, 0): the FFT backends reject empty tensors, so such a split is
moved or gathered first.

All these ops are linear over the reals (conjugation too, `c2r` as well: it reads the
real part of a linear map), so a `Partial(sum)` or `Partial(avg)` input stays Partial
and is reduced after the transform, or never, if a later op absorbs it; `max`/`min` do
not commute with them and are reduced first. `normalization` scales by the sizes of the
transformed dims, which are whole on every rank, so it needs no rewriting.

`view_as_real` reinterprets a complex tensor as a real one with a trailing dim of 2 (the
real and imaginary parts); `view_as_complex` does the reverse, so the trailing dim of 2
must be whole on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .._spec import DTensorSpec
from ._registry import register_op_strategy
from ._schema import OpSchema, OpStrategy
from ._utils import normalize_dims
from ._view import LINEAR, ShardCheck, input_spec, local_sizes, single_input_strategy

__all__: list[str] = []

aten = torch.ops.aten


def _batch_dims(ndim: int, transformed: Sequence[int]) -> dict[int, int]:
    """Dims that stay where they are and may stay split: every dim not transformed."""
    return {d: d for d in range(ndim) if d not in transformed}


def _no_empty_piece(spec: DTensorSpec) -> ShardCheck:
    """Reject splits that leave a rank an empty piece: the FFT backends fail on empty tensors
    (as the single-device op does on an empty input, which is left to fail the same way)."""
    if math.prod(spec.shape) == 0:
        return lambda orders: True
    mesh_shape = tuple(spec.mesh.shape)

    def check(orders: Mapping[int, tuple[int, ...]]) -> bool:
        return all(n > 0 for d, ms in orders.items() for _, n in local_sizes(spec.shape[d], mesh_shape, ms))

    return check


@register_op_strategy([aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default])
def fft_strategy(schema: OpSchema) -> OpStrategy:
    """`_fft_*(self, dim, normalization, ...)`: transformed dims whole, others keep their split."""
    spec = input_spec(schema)
    dims = schema.arg(1, "dim")
    # `dim=[]` transforms nothing (an identity up to dtype), not every dim
    transformed = normalize_dims(dims, spec.ndim) if len(dims) else ()
    dim_map = _batch_dims(spec.ndim, transformed)
    return single_input_strategy(spec, dim_map, check=_no_empty_piece(spec), partials=LINEAR)


@register_op_strategy(
    [aten._conj.default, aten._conj_physical.default, aten.conj_physical.default, aten.conj_physical_.default]
)
def conj_strategy(schema: OpSchema) -> OpStrategy:
    """Conjugation is elementwise and linear over the reals: any split, P(sum)/P(avg) kept."""
    spec = input_spec(schema)
    return single_input_strategy(spec, _batch_dims(spec.ndim, ()), partials=LINEAR)


@register_op_strategy(aten.view_as_real.default)
def view_as_real_strategy(schema: OpSchema) -> OpStrategy:
    """(..., ) complex -> (..., 2) real: every dim keeps its split; the new trailing dim is whole."""
    spec = input_spec(schema)
    return single_input_strategy(spec, _batch_dims(spec.ndim, ()), partials=LINEAR)


@register_op_strategy(aten.view_as_complex.default)
def view_as_complex_strategy(schema: OpSchema) -> OpStrategy:
    """(..., 2) real -> (...) complex: the trailing pair must be whole, other dims keep their split."""
    spec = input_spec(schema)
    return single_input_strategy(spec, _batch_dims(spec.ndim - 1, ()), partials=LINEAR)
