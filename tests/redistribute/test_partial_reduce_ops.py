"""Redistributing to `Partial(op)`, for every reduce op torch's `Partial` documents (issue 50).

torch's `Partial` takes sum, avg, min, max, product and, for integer tensors, band, bor,
bxor. torch's public `DTensor.redistribute` refuses every Partial target ("for internal use
only"); its `distribute_tensor(x, mesh, [Partial(op)])` makes terms for sum (each x / n),
avg, min and max (each x), and raises ValueError for the others. shardwise redistributes
Replicate and Shard (and a Partial of another op) to every one of them, with no collective
for the split into terms, and the terms reduce to the value exactly: for sum and bxor the
first rank holds x and the others 0 (the documented difference from torch's x / n), for
product the others 1, for avg, min, max, band, bor every rank x.

Side by side with torch's DTensor on 4 gloo ranks: where torch makes terms, the global
value (and for avg / min / max each rank's term) is torch's; everywhere, `full_tensor()`
and a redistribute back give the value the ranks started from, and a gradient through
Replicate -> Partial -> Replicate is the identity's.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard, comm_log
from shardwise.testing import distributed

TORCH_OPS = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")  # torch's Partial docstring
TORCH_TERMS = ("sum", "avg", "min", "max")  # what torch's distribute_tensor splits into terms
SHAPES = [(8, 4), (5, 3)]  # even; uneven (5 rows over 4 ranks)
SOURCES: list[Placement] = [Replicate(), Shard(0), Shard(1)]


def _value(op: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(TORCH_OPS.index(op) * 100 + shape[0])  # the same on every rank
    if op in ("band", "bor", "bxor"):
        return torch.randint(0, 256, shape, generator=g)
    if op == "product":
        return 0.5 + torch.rand(shape, generator=g, dtype=torch.float64)  # a product of 4 stays well scaled
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _expected_term(op: str, x: torch.Tensor, rank: int) -> torch.Tensor:
    """shardwise's term on `rank` of a 1-D mesh for value `x`."""
    if rank == 0 or op in ("avg", "min", "max", "band", "bor"):
        return x
    return torch.ones_like(x) if op == "product" else torch.zeros_like(x)


@distributed(world_size=4)
def test_every_torch_reduce_op_is_a_redistribute_target_from_replicate_and_shard_with_torchs_value() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    mesh, tmesh = sw.init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (4,))
    rank = mesh.get_coordinate()[0]
    problems: list[str] = []
    for op in TORCH_OPS:
        for shape in SHAPES:
            x = _value(op, shape)
            theirs = torch_distribute(x, tmesh, [TorchPartial(op)]) if op in TORCH_TERMS else None
            for src in SOURCES:
                case = f"{src} -> P({op}) on {shape}"
                start = sw.distribute_tensor(x, mesh, [src])
                with comm_log() as log:
                    terms = start.redistribute(mesh, [Partial(op)])
                if terms.placements != (Partial(op),) or terms.shape != x.shape:
                    problems.append(f"{case}: got {terms.placements} {tuple(terms.shape)}")
                if isinstance(src, Replicate) and log:
                    problems.append(f"{case}: splitting a replicated value into terms communicated: {log}")
                if not torch.equal(terms.to_local(), _expected_term(op, x, rank)):
                    problems.append(f"{case}: rank {rank}'s term is not the documented one")
                if not torch.equal(terms.full_tensor(), x):
                    problems.append(f"{case}: full_tensor() is not the value")
                for back in SOURCES:
                    if not torch.equal(terms.redistribute(mesh, [back]).full_tensor(), x):
                        problems.append(f"{case} -> {back}: not the value")
                if theirs is not None:
                    torch.testing.assert_close(terms.full_tensor(), theirs.full_tensor(), rtol=1e-12, atol=1e-12)
                    if op != "sum" and not torch.equal(terms.to_local(), theirs.to_local()):
                        problems.append(f"{case}: rank {rank}'s term differs from torch's")
    assert not problems, "\n".join(problems)


@distributed(world_size=4)
def test_torch_refuses_what_shardwise_redistributes_to_partial() -> None:
    # pinned so the README's difference stays true: torch's public redistribute refuses every
    # Partial target, and its distribute_tensor refuses product and the bitwise ops
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    tmesh, mesh = init_device_mesh("cpu", (4,)), sw.init_device_mesh("cpu", (4,))
    for op in TORCH_OPS:
        x = _value(op, (8, 4))
        with pytest.raises(RuntimeError, match="redistributing to Partial is for internal use only"):
            torch_distribute(x, tmesh, [TorchReplicate()]).redistribute(tmesh, [TorchPartial(op)])
        if op not in TORCH_TERMS:
            with pytest.raises(ValueError, match=rf"Replicate to Partial\({op}\) conversion is not supported"):
                torch_distribute(x, tmesh, [TorchPartial(op)])
        ours = sw.distribute_tensor(x, mesh, [Partial(op)])
        assert torch.equal(ours.full_tensor(), x), op


@distributed(world_size=4)
def test_partial_targets_on_a_2d_mesh_and_from_a_partial_of_another_op() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = tuple(mesh.get_coordinate())
    x = _value("sum", (6, 4))
    for src in [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate())]:
        for dst in [(Partial("sum"), Partial("sum")), (Partial("max"), Shard(0)), (Shard(1), Partial("avg"))]:
            terms = sw.distribute_tensor(x, mesh, list(src)).redistribute(mesh, list(dst))
            assert terms.placements == dst
            assert torch.equal(terms.full_tensor(), x), (src, dst)
    both = sw.distribute_tensor(x, mesh, [Replicate(), Replicate()]).redistribute(mesh, [Partial(), Partial()])
    assert torch.equal(both.to_local(), x if coordinate == (0, 0) else torch.zeros_like(x))  # one term holds x
    # P(sum) -> P(max): reduced, then split into the new op's terms
    sums = sw.distribute_tensor(x, mesh, [Partial("sum"), Replicate()])
    maxes = sums.redistribute(mesh, [Partial("max"), Replicate()])
    assert maxes.placements == (Partial("max"), Replicate()) and torch.equal(maxes.full_tensor(), x)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@distributed(world_size=4)
def test_a_gradient_through_a_partial_target_is_the_identitys(op: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = _value(op, (8, 4)).requires_grad_(True)
    weight = torch.arange(32, dtype=torch.float64).view(8, 4)
    dx = sw.distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_(True)
    out = dx.redistribute(mesh, [Partial(op)]).redistribute(mesh, [Replicate()]).to_local()
    (out * weight).sum().backward()
    assert isinstance(dx.grad, DTensor)
    assert torch.equal(dx.grad.full_tensor(), weight)


@distributed(world_size=4)
def test_bitwise_partials_of_floating_tensors_and_unknown_ops_are_refused_with_the_fix() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    floats = sw.distribute_tensor(torch.ones(8, 4), mesh, [Replicate()])
    for op in ("band", "bor", "bxor"):
        with pytest.raises(ValueError, match=rf"redistribute: placements\[0\] = P\({op}\) reduces bit by bit, which a "
                                             r"torch.float32 tensor cannot: use an integer or bool tensor"):
            floats.redistribute(mesh, [Partial(op)])
        with pytest.raises(ValueError, match=rf"distribute_tensor: placements\[0\] = P\({op}\)"):
            sw.distribute_tensor(torch.ones(8, 4), mesh, [Partial(op)])
        with pytest.raises(ValueError, match=rf"from_local: placements\[0\] = P\({op}\)"):
            DTensor.from_local(torch.ones(2, 4), mesh, [Partial(op)])
    with pytest.raises(ValueError, match=r"Partial\(reduce_op='premul_sum'\) is not supported: use one of sum, avg, "
                                         r"max, min, prod, band, bor, bxor"):
        Partial("premul_sum")


def test_product_is_torchs_spelling_of_prod() -> None:
    assert Partial("product") == Partial("prod") and str(Partial("product")) == "P(prod)"


@distributed(world_size=4)
def test_ops_on_bitwise_partials_reduce_before_a_cast_and_keep_them_through_data_movement() -> None:
    # a cast of each term is not a cast of the combined bits (band of 5 and 2 is 0; of 5.0 and 2.0 nothing)
    mesh = sw.init_device_mesh("cpu", (4,))
    x = torch.tensor([[5, 6, 7], [9, 3, 1]])
    for op in ("band", "bor", "bxor"):
        terms = sw.distribute_tensor(x, mesh, [Partial(op)])
        assert terms.view(3, 2).placements == (Partial(op),) and torch.equal(terms.view(3, 2).full_tensor(), x.view(3, 2))
        for dtype in (torch.float32, torch.bool, torch.int32):
            cast = terms.to(dtype)
            assert not cast._spec.has_partial() and torch.equal(cast.full_tensor(), x.to(dtype)), (op, dtype)
