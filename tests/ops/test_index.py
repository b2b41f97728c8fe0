"""Indexing op strategies, checked by simulating every rank (no processes).

Each case runs `check_op` on meshes (4,) and (2, 2): every candidate the strategy offers is
simulated for a sample of input layouts (Shard on each dim, Replicate, Partial) and its
reassembled output compared with the op on full tensors. Shapes mix even and uneven sizes
and dims smaller than the mesh. A few tests pin what the propagator picks: the common
layouts must run without gathering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._ops import Layout, OpSchema, ScalarTensor, get_op_strategy, propagate

from ..strategy_sim import check_op, schema_for

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]
R = Replicate()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


def randint(high: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=gen(seed))


def pick(op: Any, args: Sequence[Any], placements: Sequence[Sequence[Placement]], mesh_shape: Sequence[int] = (4,),
         kwargs: dict[str, Any] | None = None) -> Any:
    """What the propagator chooses for these input layouts."""
    schema = schema_for(op, args, kwargs or {}, AbstractMesh(tuple(mesh_shape)), [Layout(tuple(p)) for p in placements])
    return propagate(schema)


def no_moves(result: Any) -> bool:
    return all(s is None for s in result.input_specs)


# -- selections ------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape,dim,index", [
    ((6, 5), 1, [4, 0, 2, 2, 1]),
    ((7, 3), 0, [6, 1, 1]),          # uneven rows, index shorter than the mesh
    ((3, 2, 9), 2, [0, 8, 3, 3, 7, 5, 1, 2, 0]),
])
def test_index_select(mesh_shape: tuple[int, ...], shape: tuple[int, ...], dim: int, index: list[int]) -> None:
    x = randn(*shape, seed=1)
    assert check_op(aten.index_select.default, (x, dim, torch.tensor(index)), mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape,dim,ishape", [((6, 5), 1, (6, 3)), ((6, 5), 0, (6, 5)), ((5, 7), 0, (3, 7)), ((3, 4, 5), 2, (3, 4, 2))])
def test_gather(mesh_shape: tuple[int, ...], shape: tuple[int, ...], dim: int, ishape: tuple[int, ...]) -> None:
    x = randn(*shape, seed=2)
    index = randint(shape[dim], *ishape, seed=3)
    assert check_op(aten.gather.default, (x, dim, index), mesh_shape=mesh_shape) > 0


def test_gather_runs_without_gathering_for_batch_sharded_inputs() -> None:
    x, index = randn(8, 5), randint(5, 8, 3)
    got = pick(aten.gather.default, (x, 1, index), [(Shard(0),), (Shard(0),)])
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)
    # a sharded index along the gathered dim selects independent output columns
    got = pick(aten.gather.default, (x, 1, index), [(R,), (Shard(1),)])
    assert no_moves(got) and got.output_spec.placements == (Shard(1),)
    got = pick(aten.gather.default, (x, 1, index), [(Partial("max"),), (R,)])
    assert no_moves(got) and got.output_spec.placements == (Partial("max"),)


def test_gather_index_smaller_than_self_is_not_split_with_it() -> None:
    # index (3, 7) vs self (5, 7): splitting both on dim 0 would pair index row 1 with the
    # wrong self row on rank 1, so that option must not be offered
    x, index = randn(5, 7), randint(5, 3, 7)
    fn = get_op_strategy(aten.gather.default)
    assert fn is not None
    schema = schema_for(aten.gather.default, (x, 0, index), {}, AbstractMesh((2,)), [Layout((Shard(0),)), Layout((Shard(0),))])
    for cand in fn(schema).strategies:  # type: ignore[attr-defined]
        assert cand.input_specs[0] != Layout((Shard(0),)) or cand.input_specs[1] != Layout((Shard(0),))


# -- writes along a dim ----------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("op", [aten.scatter.src, aten.scatter_add.default, aten.scatter_.src, aten.scatter_add_.default])
@pytest.mark.parametrize("shape,dim,ishape", [((6, 5), 1, (6, 5)), ((5, 3), 0, (5, 3)), ((6, 5), 1, (4, 2))])
def test_scatter_src_and_add(mesh_shape: tuple[int, ...], op: Any, shape: tuple[int, ...], dim: int, ishape: tuple[int, ...]) -> None:
    x, src = randn(*shape, seed=4), randn(*ishape, seed=5)
    # a permutation per row: no duplicate targets, so overwriting scatters are deterministic
    perm = torch.stack([torch.randperm(shape[dim], generator=gen(k))[: ishape[dim]] for k in range(ishape[1 - dim])])
    index = perm if dim == 1 else perm.t()
    assert check_op(op, (x, dim, index.contiguous(), src), mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("value", [0.0, 2.5])
def test_scatter_value(mesh_shape: tuple[int, ...], value: float) -> None:
    x, index = randn(7, 4, seed=6), randint(4, 7, 2, seed=7)
    assert check_op(aten.scatter.value, (x, 1, index, value), mesh_shape=mesh_shape) > 0
    assert check_op(aten.scatter_.value, (x, 1, index, value), mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(mesh_shape: tuple[int, ...], reduce: str, include_self: bool) -> None:
    x, src, index = randn(6, 5, seed=8), randn(6, 4, seed=9), randint(5, 6, 4, seed=10)
    n = check_op(aten.scatter_reduce.two, (x, 1, index, src, reduce), {"include_self": include_self},
                 mesh_shape=mesh_shape, atol=1e-4, rtol=1e-4)
    assert n > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("reduce,placement", [("sum", Partial("sum")), ("amax", Partial("max")), ("amin", Partial("min"))])
def test_scatter_into_partial_self_keeps_index_rows_split(mesh_shape: tuple[int, ...], reduce: str, placement: Partial) -> None:
    # gradients accumulating into a Partial: each term scatters its own rows of src
    x, src, index = randn(6, 5, seed=11), randn(6, 5, seed=12), randint(5, 6, 5, seed=13)
    ps = tuple([placement] * len(mesh_shape))
    layouts = [[ps, (Shard(1),) * len(mesh_shape), (Shard(1),) * len(mesh_shape)],
               [ps, (R,) * len(mesh_shape), ps]]
    assert check_op(aten.scatter_reduce.two, (x, 1, index, src, reduce), mesh_shape=mesh_shape, layouts=layouts) > 0
    if reduce == "sum":
        assert check_op(aten.scatter_add.default, (x, 1, index, src), mesh_shape=mesh_shape, layouts=layouts) > 0
        got = pick(aten.scatter_add.default, (x, 1, index, src), layouts[0][:3], mesh_shape)
        assert no_moves(got) and got.output_spec.placements == ps


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape,dim,index", [((6, 5), 1, [4, 0, 2, 2, 1]), ((7, 3), 0, [6, 1, 1]), ((2, 9), 1, [8, 0])])
def test_index_add_copy_fill(mesh_shape: tuple[int, ...], shape: tuple[int, ...], dim: int, index: list[int]) -> None:
    x = randn(*shape, seed=14)
    idx = torch.tensor(index)
    src_shape = list(shape)
    src_shape[dim] = len(index)
    src = randn(*src_shape, seed=15)
    assert check_op(aten.index_add.default, (x, dim, idx, src), {"alpha": 2}, mesh_shape=mesh_shape) > 0
    assert check_op(aten.index_add_.default, (x, dim, idx, src), mesh_shape=mesh_shape) > 0
    unique = torch.tensor(sorted(set(index)))
    src_shape[dim] = len(unique)
    assert check_op(aten.index_copy.default, (x, dim, unique, randn(*src_shape, seed=16)), mesh_shape=mesh_shape) > 0
    assert check_op(aten.index_fill.int_Scalar, (x, dim, idx, 0.0), mesh_shape=mesh_shape) > 0
    assert check_op(aten.index_fill.int_Scalar, (x, dim, idx, -1.5), mesh_shape=mesh_shape) > 0


def test_index_add_into_partial_sum_splits_the_source() -> None:
    # index_select's backward: index_add(zeros, dim, index, grad) with grad split like the index
    x, idx, src = randn(6, 5), torch.tensor([4, 0, 2, 2, 1]), randn(6, 5, seed=2)
    layouts = [[(Partial(),), (Shard(0),), (Shard(1),)]]
    assert check_op(aten.index_add.default, (x, 1, idx, src), mesh_shape=(4,), layouts=layouts) > 0
    got = pick(aten.index_add.default, (x, 1, idx, src), layouts[0])
    assert no_moves(got) and got.output_spec.placements == (Partial(),)


# -- advanced indexing ---------------------------------------------------------------------------------


INDEX_CASES = [
    ((6, 5), [torch.tensor([5, 0, 2, 2, 1, 3, 4])]),                          # x[i]
    ((6, 5), [None, torch.tensor([[1, 2], [0, 4], [3, 3]])]),                # x[:, i2d]
    ((5, 3, 4), [torch.tensor([4, 0, 1]), None, torch.tensor([3, 0, 2])]),   # split advanced indices go first
    ((5, 3, 4), [None, torch.tensor([2, 0, 1, 1, 0]), torch.tensor([3])]),   # broadcast index tensors
    ((3, 7), [torch.tensor([[0], [2]]), torch.tensor([6, 1, 1, 0, 5])]),     # (2,1) x (5,) -> (2,5)
]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape,indices", INDEX_CASES)
def test_index_tensor(mesh_shape: tuple[int, ...], shape: tuple[int, ...], indices: list[Any]) -> None:
    x = randn(*shape, seed=17)
    assert check_op(aten.index.Tensor, (x, indices), mesh_shape=mesh_shape) > 0


def test_index_with_sharded_indices_splits_the_output() -> None:
    x, i = randn(6, 5), randint(6, 8, 3)
    got = pick(aten.index.Tensor, (x, [i]), [(R,), (Shard(0),)])
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)
    got = pick(aten.index.Tensor, (x, [None, torch.tensor([4, 1])]), [(Shard(0),), (R,)])
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("op", [aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default])
def test_index_put(mesh_shape: tuple[int, ...], accumulate: bool, op: Any) -> None:
    x = randn(5, 3, 4, seed=18)
    cases: list[tuple[list[Any], torch.Tensor]] = [
        ([torch.tensor([4, 0, 1])], randn(3, 3, 4, seed=19)),                  # x[i] = v
        ([None, torch.tensor([2, 0])], randn(5, 2, 4, seed=20)),               # x[:, i] = v
        ([None, torch.tensor([2, 0])], randn(4, seed=21)),                     # broadcast values
        ([torch.tensor([4, 0, 1]), None, torch.tensor([3, 0, 2])], randn(3, 3, seed=22)),
    ]
    for indices, values in cases:
        n = check_op(op, (x, indices, values, accumulate), mesh_shape=mesh_shape, atol=1e-5)
        assert n > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_index_put_with_a_bool_mask(mesh_shape: tuple[int, ...]) -> None:
    x = randn(6, 5, seed=23)
    mask = x > 0.3
    assert check_op(aten.index_put.default, (x, [mask], torch.tensor([1.5]), False), mesh_shape=mesh_shape) > 0


# -- masks ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("op", [aten.masked_fill.Scalar, aten.masked_fill_.Scalar])
@pytest.mark.parametrize("value", [0.0, -3.0])
@pytest.mark.parametrize("mshape", [(6, 5), (5,), (6, 1)])
def test_masked_fill(mesh_shape: tuple[int, ...], op: Any, value: float, mshape: tuple[int, ...]) -> None:
    x = randn(6, 5, seed=24)
    mask = randn(*mshape, seed=25) > 0
    assert check_op(op, (x, mask, value), mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_masked_fill_broadcasting_self_and_tensor_value(mesh_shape: tuple[int, ...]) -> None:
    x = randn(5, seed=26)
    mask = randn(3, 5, seed=27) > 0
    assert check_op(aten.masked_fill.Scalar, (x, mask, 1.0), mesh_shape=mesh_shape) > 0


def test_masked_fill_with_a_plain_scalar_tensor_value_follows_the_data() -> None:
    # the dispatcher passes a plain 0-dim value as a ScalarTensor (replicated); the simulator
    # would hand it over as a CPU tensor, which the meta kernel rejects, so build the schema here
    mesh = AbstractMesh((4,))
    x, mask = randn(7, 3), randn(7, 3, seed=1) > 0
    schema = schema_for(aten.masked_fill.Tensor, (x, mask), {}, mesh, [Layout((Shard(0),)), Layout((Shard(0),))])
    schema = OpSchema(schema.op, schema.args_schema + (ScalarTensor(torch.float32, "cpu"),))
    got = propagate(schema)
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)


def test_masked_fill_keeps_partials_that_commute_with_a_fill() -> None:
    x, mask = randn(6, 5), randn(6, 5, seed=1) > 0
    for placement, value, kept in [(Partial("max"), -1e4, True), (Partial("avg"), 3.0, True),
                                   (Partial("sum"), 0.0, True), (Partial("sum"), 1.0, False)]:
        got = pick(aten.masked_fill.Scalar, (x, mask, value), [(placement,), (R,)])
        assert (got.output_spec.placements == (placement,)) is kept, (placement, value)
    got = pick(aten.masked_fill.Scalar, (x, mask, 0.0), [(Shard(1),), (R,)])
    assert got.output_spec.placements == (Shard(1),)  # the mask follows the data's layout


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_masked_scatter_and_its_backward(mesh_shape: tuple[int, ...]) -> None:
    x = randn(6, 5, seed=28)
    mask = randn(6, 5, seed=29) > 0
    src = randn(6, 5, seed=30)
    assert check_op(aten.masked_scatter.default, (x, mask, src), mesh_shape=mesh_shape) > 0
    assert check_op(aten.masked_scatter_.default, (x, mask, src), mesh_shape=mesh_shape) > 0
    assert check_op(aten.masked_scatter_backward.default, (x, mask, [6, 5]), mesh_shape=mesh_shape) > 0


# -- sort, topk ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape,dim", [((6, 5), 1), ((7, 3), 0), ((3, 2, 9), -1), ((2, 9), 0)])
def test_sort_and_topk(mesh_shape: tuple[int, ...], shape: tuple[int, ...], dim: int) -> None:
    x = randn(*shape, seed=31)
    assert check_op(aten.sort.default, (x, dim), mesh_shape=mesh_shape) > 0
    assert check_op(aten.sort.default, (x, dim, True), mesh_shape=mesh_shape) > 0
    assert check_op(aten.sort.stable, (x,), {"stable": True, "dim": dim}, mesh_shape=mesh_shape) > 0
    k = min(2, shape[dim])
    assert check_op(aten.topk.default, (x, k, dim), mesh_shape=mesh_shape) > 0
    assert check_op(aten.topk.default, (x, k, dim, False), mesh_shape=mesh_shape) > 0


def test_sort_keeps_other_dims_split_and_gathers_the_sorted_dim() -> None:
    x = randn(8, 6)
    got = pick(aten.sort.default, (x, 1), [(Shard(0),)])
    assert no_moves(got) and [o.placements for o in got.output_spec] == [(Shard(0),), (Shard(0),)]
    # split along the sorted dim: moved off it (to the other dim: an all-to-all, not a gather)
    got = pick(aten.sort.default, (x, 1), [(Shard(1),)])
    assert got.input_specs[0] is not None and got.input_specs[0].placements == (Shard(0),)
