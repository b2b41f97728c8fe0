"""Pointwise strategies in one process (simulated ranks)."""

from __future__ import annotations

import pytest
import torch

from ..strategy_sim import check_op

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


def test_regression_elementwise_ops_kept_a_non_default_split_order() -> None:
    # A dim split by mesh dims 1 then 0 (shard_order {0: (1, 0)}) came out of detach, mul,
    # add, clone in the default order, so every such op (and nn.Parameter(), and each
    # optimizer step) re-laid the tensor out with an all_gather.
    from shardwise import AbstractMesh, Replicate, Shard
    from shardwise._ops import Layout, propagate

    from ..strategy_sim import schema_for

    aten = torch.ops.aten
    mesh = AbstractMesh((2, 2))
    ordered = Layout((Shard(0), Shard(0)), ((0, (1, 0)),))
    x, b = torch.randn(6, 4), torch.randn(4)
    for op, args, layouts in [
        (aten.detach.default, (x,), [ordered]),
        (aten.mul.Tensor, (x, 2.0), [ordered]),
        (aten.add.Tensor, (x, x), [ordered, ordered]),
        (aten.add.Tensor, (x, b), [ordered, Layout((Replicate(), Replicate()))]),
        (aten.lerp.Scalar, (x, x, 0.5), [ordered, ordered]),
    ]:
        got = propagate(schema_for(op, args, {}, mesh, layouts))
        assert got.input_specs[0] is None, (op, got)  # the ordered input stays where it is
        assert got.output_spec.placements == ordered.placements and got.output_spec.shard_order == ordered.shard_order
