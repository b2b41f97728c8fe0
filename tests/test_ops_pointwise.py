"""Pointwise strategies in one process (simulated ranks)."""

from __future__ import annotations

import pytest
import torch

from .strategy_sim import check_op

aten = torch.ops.aten


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("shape", [(6, 5), (7, 3), (3, 1)])
def test_multi_output_pointwise_op_shares_one_layout(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    # regression: frexp (mantissa, exponent) hit an assertion that every pointwise op has one output
    assert check_op(aten.frexp.Tensor, (torch.randn(*shape),), mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_binary_ops_with_broadcasting_and_partial_inputs(mesh_shape: tuple[int, ...]) -> None:
    a, row = torch.randn(6, 5), torch.randn(5)
    for op in (aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default, aten.atan2.default):
        assert check_op(op, (a, row), mesh_shape=mesh_shape) > 0
