"""A `Partial(sum)` is not rounded rank by rank: an op whose output has another dtype reduces it first.

One device rounds a sum once, to the output's dtype. Kept Partial through such an op, each
rank would round its own term and the terms would be summed after: `sum(dtype=)`, `mean(dtype=)`
and `cumsum(dtype=)` kept a float64 Partial into float32 terms, `add_` into a float32 tensor
added each rank's float64 term and rounded it there, and a float32 Partial times a float64
tensor summed float64 products of the terms, not the float32 sum times the factor (issue 45).
The terms here are float64 numbers on a grid whose sums are exact but which float32 cannot
hold, so any rounding of a term shows, and the result must equal one device's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import AbstractMesh, Partial, Replicate
from shardwise._ops import OpSchema, propagate
from shardwise._spec import DTensorSpec, TensorMeta
from shardwise.testing import distributed

aten = torch.ops.aten
F32, F64 = torch.float32, torch.float64


def _terms(n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`n` float64 terms on the 2^-20 grid below 2^21: their sums are exact, float32 rounds them."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(-2**41, 2**41, (n, *shape), generator=g).to(F64) * 2.0**-20


# name -> (one device's op on the whole value, the dtype of the Partial input)
CASES: dict[str, tuple[Callable[[Any, Any], Any], torch.dtype]] = {
    "sum(dtype=float32)": (lambda x, other: x.sum(-1, dtype=F32), F64),
    "mean(dtype=float32)": (lambda x, other: x.mean(-1, dtype=F32), F64),
    "cumsum(dtype=float32)": (lambda x, other: x.cumsum(-1, dtype=F32), F64),
    "float32.add_(float64)": (lambda x, other: other.to(F32).add_(x), F64),
    "float32 * float64": (lambda x, other: x * other, F32),
}


@pytest.mark.parametrize("case", list(CASES))
@distributed(world_size=2)
def test_a_partial_sum_reaching_another_dtype_is_reduced_first_as_on_one_device(case: str) -> None:
    fn, dtype = CASES[case]
    mesh = sw.init_device_mesh("cpu", (2,))
    terms = _terms(2, (6, 5)).to(dtype)
    other = _terms(1, (6, 5))[0]
    want = fn(terms.sum(0), other)
    rank = torch.distributed.get_rank()
    got = fn(sw.DTensor.from_local(terms[rank].clone(), mesh, (Partial(),)),
             sw.distribute_tensor(other, mesh, (Replicate(),)))
    assert isinstance(got, sw.DTensor)
    whole = got.full_tensor()
    assert whole.dtype == want.dtype and torch.equal(whole, want), (case, (whole.double() - want.double()).abs().max())


def _spec(dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(AbstractMesh((4,)), (Partial(),), TensorMeta(torch.Size([8, 6]), (6, 1), dtype))


def test_the_propagator_keeps_a_partial_sum_only_into_its_own_dtype() -> None:
    # pure: the layouts chosen, on an abstract mesh
    same = propagate(OpSchema(aten.sum.dim_IntList, (_spec(F64), (1,)), (("dtype", F64),)))
    assert same.output_spec.placements == (Partial(),)  # nothing to round: the sum stays pending
    cast = propagate(OpSchema(aten.sum.dim_IntList, (_spec(F64), (1,)), (("dtype", F32),)))
    assert not isinstance(cast.output_spec.placements[0], Partial)
    promoted = propagate(OpSchema(aten.mul.Tensor, (_spec(F32), DTensorSpec(
        AbstractMesh((4,)), (Replicate(),), TensorMeta(torch.Size([8, 6]), (6, 1), F64)))))
    assert not isinstance(promoted.output_spec.placements[0], Partial)
    kept = propagate(OpSchema(aten.mul.Tensor, (_spec(F64), DTensorSpec(
        AbstractMesh((4,)), (Replicate(),), TensorMeta(torch.Size([8, 6]), (6, 1), F32)))))
    assert kept.output_spec.placements == (Partial(),)  # float64 terms times float32 weights: float64 terms
