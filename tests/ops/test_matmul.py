"""Matmul-family and convolution strategies, checked in one process with the strategy simulator.

Every candidate of every strategy is simulated rank by rank on meshes (4,) and (2, 2), with
even shapes and uneven ones (a dim smaller than the mesh), Partial inputs included; the
propagator's choices are pinned where they encode a decision (Megatron's f/g, no invented
splits, a Partial output only with a Partial bias).
"""

from __future__ import annotations

import doctest
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._ops import Layout, OutputSharding, get_op_strategy, propagate
from shardwise._ops import _matmul
from shardwise._ops._matmul import CONTRACTIONS

from ..strategy_sim import check_op, schema_for

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
MESHES = [(4,), (2, 2)]
TOL: dict[str, Any] = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Thousands of tiny ops: intra-op threads only add contention on a shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 17 * len(shape) + sum(shape)))


def lay(*placements: Placement) -> Layout:
    return Layout(tuple(placements))


def chosen(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh_shape: tuple[int, ...],
           layouts: Sequence[Layout]) -> OutputSharding:
    """What the propagator picks for these input layouts."""
    return propagate(schema_for(op, args, kwargs or {}, AbstractMesh(mesh_shape), layouts))


def placements_of(result: OutputSharding, k: int | None = None) -> tuple[Placement, ...]:
    out = result.output_spec if k is None else result.output_spec[k]  # type: ignore[index]
    assert out is not None and not isinstance(out, tuple)
    return out.placements


def unmoved(result: OutputSharding) -> bool:
    return not result.needs_redistribute


# ---------------------------------------------------------------------------------------
# Every candidate simulated, default sample of Shard / Replicate / Partial(sum) inputs

def _with_nan(t: torch.Tensor) -> torch.Tensor:
    t[0, 0] = float("nan")  # beta == 0 ignores the bias entirely, NaN included
    return t


# (op, args, kwargs): even shapes, then shapes with a dim smaller than the 4-rank mesh
CASES = {
    "mm": (aten.mm.default, (rand(8, 12), rand(12, 4)), {}),
    "mm_uneven": (aten.mm.default, (rand(3, 5), rand(5, 2)), {}),
    "bmm": (aten.bmm.default, (rand(4, 6, 8), rand(4, 8, 2)), {}),
    "bmm_uneven": (aten.bmm.default, (rand(3, 5, 2), rand(3, 2, 7)), {}),
    "mv": (aten.mv.default, (rand(8, 4), rand(4)), {}),
    "mv_uneven": (aten.mv.default, (rand(3, 7), rand(7)), {}),
    "dot": (aten.dot.default, (rand(8), rand(8, seed=1)), {}),
    "dot_uneven": (aten.dot.default, (rand(3), rand(3, seed=1)), {}),
    "vdot": (aten.vdot.default, (rand(5), rand(5, seed=1)), {}),
    "addmm": (aten.addmm.default, (rand(4), rand(8, 4), rand(4, 4, seed=1)), {"beta": 2.0, "alpha": -0.5}),
    "addmm_uneven_full_bias": (aten.addmm.default, (rand(3, 6), rand(3, 5), rand(5, 6)), {"beta": 0.5, "alpha": 3}),
    "addmm_column_bias": (aten.addmm.default, (rand(6, 1), rand(6, 3), rand(3, 5)), {"beta": -1.5}),
    "addmm_beta0": (aten.addmm.default, (_with_nan(rand(8, 4)), rand(8, 6), rand(6, 4)), {"beta": 0, "alpha": 2}),
    "baddbmm": (aten.baddbmm.default, (rand(4, 1, 6), rand(4, 3, 8), rand(4, 8, 6)), {"beta": 2.0, "alpha": 0.5}),
    "baddbmm_uneven": (aten.baddbmm.default, (rand(3, 5, 2), rand(3, 5, 7), rand(3, 7, 2)), {"beta": 3}),
    "addbmm": (aten.addbmm.default, (rand(5, 6), rand(3, 5, 4), rand(3, 4, 6)), {"beta": 2.0, "alpha": 0.5}),
    "addmv": (aten.addmv.default, (rand(5), rand(5, 7), rand(7)), {"beta": 2.0, "alpha": 0.5}),
    "addr": (aten.addr.default, (rand(5, 8), rand(5), rand(8)), {"beta": 2.0, "alpha": -1}),
    "addmm_": (aten.addmm_.default, (rand(6, 4), rand(6, 5), rand(5, 4)), {"beta": 2.0, "alpha": 0.5}),
    "baddbmm_": (aten.baddbmm_.default, (rand(2, 3, 4), rand(2, 3, 5), rand(2, 5, 4)), {"beta": 0.5}),
}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_contraction_candidate_matches_the_full_op(case: str, mesh_shape: tuple[int, ...]) -> None:
    op, args, kwargs = CASES[case]
    assert check_op(op, args, kwargs, mesh_shape=mesh_shape, **TOL) > 0


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_avg_and_mixed_partials_stay_partial_through_a_linear_operand(mesh_shape: tuple[int, ...]) -> None:
    pa = Partial("avg")
    n = len(mesh_shape)
    a, b, bias = rand(6, 4), rand(4, 3), rand(3)
    cases = [
        (aten.mm.default, (a, b), {}, [lay(*[pa] * n), lay(*[R] * n)], (pa,) * n),
        (aten.mm.default, (a, b), {}, [lay(*[R] * n), lay(*[pa] * n)], (pa,) * n),
        (aten.addmm.default, (bias, a, b), {"beta": 2.0}, [lay(*[pa] * n), lay(*[pa] * n), lay(*[R] * n)], (pa,) * n),
    ]
    if n == 2:  # avg over one mesh dim, contraction (sum) over the other
        cases.append((aten.mm.default, (a, b), {}, [lay(pa, S(1)), lay(R, S(0))], (pa, P)))
    for op, args, kwargs, layouts, want in cases:
        assert check_op(op, args, kwargs, mesh_shape=mesh_shape, layouts=[layouts], **TOL) > 0
        result = chosen(op, args, kwargs, mesh_shape, layouts)
        assert placements_of(result) == want and unmoved(result), (op, result)


def test_a_plain_scalar_bias_blocks_a_partial_output_unless_beta_is_zero() -> None:
    # A plain 0-dim bias is a scalar on every rank: a Partial output would count it n times.
    bias, a, b = torch.tensor(1.5), rand(4, 8), rand(8, 4)
    layouts = [lay(S(1)), lay(S(0))]
    assert check_op(aten.addmm.default, (bias, a, b), {"beta": 2.0}, mesh_shape=(4,), layouts=[layouts], **TOL) > 0
    result = chosen(aten.addmm.default, (bias, a, b), {}, (4,), layouts)
    assert not any(isinstance(p, Partial) for p in placements_of(result))
    # with beta == 0 the bias is ignored, so the contraction may stay Partial
    assert placements_of(chosen(aten.addmm.default, (bias, a, b), {"beta": 0}, (4,), layouts)) == (P,)


# ---------------------------------------------------------------------------------------
# The propagator's choices that encode a decision


def test_megatron_column_then_row_parallel_needs_no_communication_until_the_reduction() -> None:
    x, w1t, b1, w2t = rand(8, 6), rand(6, 12), rand(12), rand(12, 6)
    # f: column parallel (weight rows split = columns of w^T), bias split with them
    col = chosen(aten.addmm.default, (b1, x, w1t), {}, (4,), [lay(S(0)), lay(R), lay(S(1))])
    assert placements_of(col) == (S(1),) and unmoved(col)
    # g: row parallel, contraction over the split hidden dim -> partial sums, nothing moved
    h = rand(8, 12)
    row = chosen(aten.mm.default, (h, w2t), {}, (4,), [lay(S(1)), lay(S(0))])
    assert placements_of(row) == (P,) and unmoved(row)


def test_a_replicated_bias_joins_partial_sums_on_one_rank_only() -> None:
    # out = beta * bias + m1 @ m2 with k split: the replicated bias is partialized (kept on
    # one rank, zero elsewhere: free), never added n times, and no operand is gathered.
    bias, a, b = rand(4), rand(8, 12), rand(12, 4)
    layouts = [lay(R), lay(S(1)), lay(S(0))]
    result = chosen(aten.addmm.default, (bias, a, b), {"beta": 2.0}, (4,), layouts)
    assert placements_of(result) == (P,)
    assert result.input_specs[1] is None and result.input_specs[2] is None
    assert result.input_specs[0] is not None and result.input_specs[0].placements == (P,)
    assert check_op(aten.addmm.default, (bias, a, b), {"beta": 2.0}, mesh_shape=(4,), layouts=[layouts], **TOL) > 0
    # a Partial bias rides along with the partial sums
    result = chosen(aten.addmm.default, (bias, a, b), {"beta": 2.0}, (4,), [lay(P), lay(S(1)), lay(S(0))])
    assert placements_of(result) == (P,) and unmoved(result)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_replicated_inputs_give_a_replicated_output_not_an_invented_split(mesh_shape: tuple[int, ...]) -> None:
    # Regression: chunking replicated inputs is free, so a replicated mm used to come out split
    # (or as partial sums) and the next op paid the gather.
    rs = lay(*[R] * len(mesh_shape))
    for op, args in [
        (aten.mm.default, (rand(2, 64), rand(64, 64))),
        (aten.bmm.default, (rand(4, 2, 64), rand(4, 64, 64))),
        (aten.addmm.default, (rand(64), rand(2, 64), rand(64, 64))),
        (aten.dot.default, (rand(64), rand(64))),
    ]:
        result = chosen(op, args, {}, mesh_shape, [rs] * len(args))
        assert placements_of(result) == rs.placements and unmoved(result), op


def test_bmm_split_on_batch_rows_or_contraction_runs_in_place() -> None:
    q, k = rand(4, 8, 6), rand(4, 6, 8)
    for layouts, want in [
        ([lay(S(0), R), lay(S(0), R)], (S(0), R)),  # batch split on the first mesh dim
        ([lay(S(0), S(1)), lay(S(0), R)], (S(0), S(1))),  # plus query rows on the second
        ([lay(R, S(2)), lay(R, S(1))], (R, P)),  # contraction split: partial sums
    ]:
        result = chosen(aten.bmm.default, (q, k), {}, (2, 2), layouts)
        assert placements_of(result) == want and unmoved(result), layouts


def test_dot_of_split_vectors_is_a_partial_sum() -> None:
    result = chosen(aten.dot.default, (rand(10), rand(10)), {}, (4,), [lay(S(0)), lay(S(0))])
    assert placements_of(result) == (P,) and unmoved(result)


# ---------------------------------------------------------------------------------------
# Convolution

conv, conv_bwd = aten.convolution.default, aten.convolution_backward.default


def conv_args(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *, stride: int = 1, padding: int = 1,
              transposed: bool = False, groups: int = 1) -> tuple[Any, ...]:
    k = x.ndim - 2
    return (x, w, bias, [stride] * k, [padding] * k, [1] * k, transposed, [0] * k, groups)


def conv_bwd_args(go: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, bias: bool = True, stride: int = 1,
                  padding: int = 1, transposed: bool = False, groups: int = 1,
                  mask: tuple[bool, bool, bool] | None = None) -> tuple[Any, ...]:
    k = x.ndim - 2
    mask = mask or (True, True, bias)  # autograd asks for a bias grad only when there is a bias
    c_out = w.shape[1] * groups if transposed else w.shape[0]
    return (go, x, w, [c_out] if bias else None, [stride] * k, [padding] * k, [1] * k, transposed, [0] * k,
            groups, list(mask))


def _grad_output(args: tuple[Any, ...]) -> torch.Tensor:
    out = conv(*args)
    return rand(*out.shape, seed=5)


CONV_CASES = {
    "conv2d_bias": conv_args(rand(4, 6, 5, 5), rand(8, 6, 3, 3), rand(8)),
    "conv2d_uneven": conv_args(rand(3, 5, 4, 4), rand(3, 5, 3, 3), rand(3)),
    "conv1d_stride": conv_args(rand(3, 5, 9), rand(6, 5, 3), None, stride=2, padding=0),
    "conv_transpose2d": conv_args(rand(2, 4, 4, 4), rand(4, 6, 3, 3), rand(6), padding=0, transposed=True),
    "conv2d_groups": conv_args(rand(2, 4, 5, 5), rand(6, 2, 3, 3), rand(6), groups=2),
}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_every_convolution_candidate_matches_the_full_op(case: str, mesh_shape: tuple[int, ...]) -> None:
    args = CONV_CASES[case]
    assert check_op(conv, args, mesh_shape=mesh_shape, **TOL) > 0


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_every_convolution_backward_candidate_matches_the_full_op(case: str, mesh_shape: tuple[int, ...]) -> None:
    x, w, bias, stride, padding, _, transposed, _, groups = CONV_CASES[case]
    go = _grad_output(CONV_CASES[case])
    args = conv_bwd_args(go, x, w, bias=bias is not None, stride=stride[0], padding=padding[0],
                         transposed=transposed, groups=groups)
    assert check_op(conv_bwd, args, mesh_shape=mesh_shape, **TOL) > 0


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, True), (False, True, False)])
def test_convolution_backward_promises_nothing_for_grads_not_asked_for(mask: tuple[bool, bool, bool]) -> None:
    x, w = rand(4, 3, 5, 5), rand(4, 3, 3, 3)
    go = _grad_output(conv_args(x, w, None))
    args = conv_bwd_args(go, x, w, bias=mask[2], mask=mask)
    assert check_op(conv_bwd, args, mesh_shape=(2, 2), **TOL) > 0
    result = chosen(conv_bwd, args, {}, (4,), [lay(S(0)), lay(S(0)), lay(R)])
    assert isinstance(result.output_spec, tuple)
    assert [o is not None for o in result.output_spec] == list(mask)


def test_convolution_data_parallel_and_channel_parallel_run_in_place() -> None:
    x, w, b = rand(8, 6, 5, 5), rand(8, 6, 3, 3), rand(8)
    fwd = conv_args(x, w, b)
    go = _grad_output(fwd)
    bwd = conv_bwd_args(go, x, w)
    # data parallel: batch split, weights replicated -> weight and bias grads are partial sums
    result = chosen(conv, fwd, {}, (4,), [lay(S(0)), lay(R), lay(R)])
    assert placements_of(result) == (S(0),) and unmoved(result)
    result = chosen(conv_bwd, bwd, {}, (4,), [lay(S(0)), lay(S(0)), lay(R)])
    assert [placements_of(result, k) for k in range(3)] == [(S(0),), (P,), (P,)] and unmoved(result)
    # output channels split: weight and bias split on C_out, output on channels, grad_input partial
    result = chosen(conv, fwd, {}, (4,), [lay(R), lay(S(0)), lay(S(0))])
    assert placements_of(result) == (S(1),) and unmoved(result)
    result = chosen(conv_bwd, bwd, {}, (4,), [lay(S(1)), lay(R), lay(S(0))])
    assert [placements_of(result, k) for k in range(3)] == [(P,), (S(0),), (S(0),)] and unmoved(result)
    # input channels split, no bias: partial sums; its backward gives grads split the same way
    x, w = rand(8, 8, 5, 5), rand(8, 8, 3, 3)
    bwd = conv_bwd_args(_grad_output(conv_args(x, w, None)), x, w)
    result = chosen(conv, conv_args(x, w, None), {}, (4,), [lay(S(1)), lay(S(1))])
    assert placements_of(result) == (P,) and unmoved(result)
    result = chosen(conv_bwd, bwd, {}, (4,), [lay(R), lay(S(1)), lay(S(1))])
    assert [placements_of(result, k) for k in range(3)] == [(S(1),), (S(1),), (R,)] and unmoved(result)
    # both at once on a 2-D mesh: batch over mesh dim 0, output channels over mesh dim 1
    result = chosen(conv, fwd, {}, (2, 2), [lay(S(0), R), lay(R, S(0)), lay(R, S(0))])
    assert placements_of(result) == (S(0), S(1)) and unmoved(result)


def test_input_channel_split_with_a_replicated_bias_is_not_partial() -> None:
    x, w, b = rand(2, 8, 5, 5), rand(4, 8, 3, 3), rand(4)
    result = chosen(conv, conv_args(x, w, b), {}, (4,), [lay(S(1)), lay(S(1)), lay(R)])
    assert not any(isinstance(p, Partial) for p in placements_of(result))


def test_channel_splits_that_leave_a_rank_without_channels_are_not_offered() -> None:
    # Regression: torch rejects a weight with zero output channels, and with zero input channels
    # returns an output with zero channels; 3 channels over 4 ranks leaves rank 3 empty.
    x, w, b = rand(2, 3, 5, 5), rand(3, 3, 3, 3), rand(3)
    mesh = AbstractMesh((4,))
    fn = get_op_strategy(conv)
    assert fn is not None
    schema = schema_for(conv, conv_args(x, w, b), {}, mesh, [lay(R), lay(S(0)), lay(S(0))])
    for cand in fn(schema).strategies:  # type: ignore[attr-defined]
        assert all(p == R for p in cand.input_specs[1].placements), cand
    schema = schema_for(conv, conv_args(x, w, None), {}, mesh, [lay(S(1)), lay(S(1))])
    for cand in fn(schema).strategies:  # type: ignore[attr-defined]
        assert all(p == R for p in cand.input_specs[1].placements), cand
    result = propagate(schema)
    assert result.output_spec is not None and check_op(
        conv, conv_args(x, w, b), mesh_shape=(4,), layouts=[[lay(R), lay(S(0)), lay(S(0))]], **TOL) > 0


# ---------------------------------------------------------------------------------------
# What arrives at dispatch


class _Trace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


# ops of other families (views, reductions, pointwise) that these programs also produce
_OTHER_FAMILIES = {
    "view", "_unsafe_view", "t", "transpose", "permute", "unsqueeze", "squeeze", "squeeze_", "expand", "clone",
    "sum", "ones_like", "detach", "mul", "copy_", "new_empty_strided", "add",
}

PROGRAMS = {
    "matmul_2d": (lambda a, b: a @ b, (3, 4), (4, 5)),
    "matmul_3d_2d": (lambda a, b: a @ b, (2, 3, 4), (4, 5)),
    "matmul_2d_3d": (lambda a, b: a @ b, (3, 4), (2, 4, 5)),
    "matmul_batched_broadcast": (lambda a, b: a @ b, (2, 2, 3, 4), (2, 4, 5)),
    "matmul_vector": (lambda a, b: a @ b, (3, 4), (4,)),
    "matmul_dot": (lambda a, b: a @ b, (4,), (4,)),
    "linear_3d": (lambda a, b: torch.nn.functional.linear(a, b, b.sum(1)), (2, 3, 4), (5, 4)),
    "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), (2, 3, 4), (2, 4, 5)),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=([1], [0])), (3, 4), (4, 5)),
    "outer": (lambda a, b: torch.outer(a, b), (3,), (4,)),
    "conv2d": (lambda a, b: torch.nn.functional.conv2d(a, b, b.sum((1, 2, 3)), padding=1), (2, 3, 5, 5), (4, 3, 3, 3)),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_what_matmul_linear_einsum_and_conv_decompose_into_has_a_strategy(name: str) -> None:
    fn, sa, sb = PROGRAMS[name]
    a, b = rand(*sa).requires_grad_(True), rand(*sb).requires_grad_(True)
    with _Trace() as trace:
        fn(a, b).sum().backward()
    ours = {op for op in trace.ops if op._schema.name.split("::")[1].split(".")[0] not in _OTHER_FAMILIES}
    missing = {op for op in ours if get_op_strategy(op) is None or op not in set(CONTRACTIONS) | {conv, conv_bwd}}
    assert not missing, f"{name} reaches dispatch with {missing}: register a matmul-family strategy for it"


def test_matmul_module_doctests_pass() -> None:
    result = doctest.testmod(_matmul)
    assert result.attempted > 0 and result.failed == 0
