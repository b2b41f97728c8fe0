"""p-norms over sharded dims move only each rank's term, and equal the single-device norm.

What broke: `clip_grad_norm_` / `get_total_norm` (`_foreach_norm(grads, 2)` then
`vector_norm(stack(norms))`) all-gathered every gradient to take its 2-norm, a whole model's
worth of bytes per step, because no Partial placement combines 2-norms. Now a rank raises its
piece's norm to p and the terms are all-reduced (one all_reduce per mesh dim for a whole
`_foreach_norm` list): a few bytes per tensor. Values are checked against one process,
float64 to 1e-12; bytes against what the gather moved and against torch's DTensor.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise.debug import CommCounter
from shardwise.testing import distributed

from ..dist_helpers import make_dtensor, seeded

aten = torch.ops.aten
F64 = dict(atol=1e-12, rtol=1e-12)

# (global shape, placements) on mesh (4,) and (2, 2): even, uneven, and empty pieces ((3, 5) on 4 ranks)
LAYOUTS: dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[Placement, ...]]]] = {
    (4,): [((16, 8), (Shard(0),)), ((10, 7), (Shard(0),)), ((10, 7), (Shard(1),)), ((3, 5), (Shard(0),)),
           ((2048,), (Shard(0),)), ((6, 5, 3), (Shard(2),))],
    (2, 2): [((16, 8), (Shard(0), Shard(1))), ((10, 7), (Shard(0), Shard(0))), ((3, 5), (Shard(1), Shard(0))),
             ((10, 7), (Replicate(), Shard(1))), ((6, 5, 3), (Shard(2), Shard(0)))],
}


def _mesh(shape: tuple[int, ...]) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


def _moved(counter: CommCounter) -> dict[str, tuple[int, int]]:
    return counter.totals()


def _expect_terms_only(counter: CommCounter) -> None:
    """Only all_reduces of terms: never a gather of the input."""
    kinds = _moved(counter)
    assert set(kinds) <= {"all_reduce"}, f"a sharded norm moved its input: {kinds}"


def _expected_placements(x: DTensor, dims: tuple[int, ...], keepdim: bool) -> tuple[Placement, ...]:
    out: list[Placement] = []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim not in dims:
            out.append(Shard(p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim)))
        else:
            out.append(Replicate())
    return tuple(out)


# -- values --------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_vector_norm_of_sharded_dims_equals_one_device_and_moves_only_terms(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(mesh_shape)
    for k, (shape, placements) in enumerate(LAYOUTS[mesh_shape]):
        for dtype, tol in ((torch.float64, F64), (torch.float32, dict(atol=1e-6, rtol=1e-5))):
            full = seeded(*shape, seed=k, dtype=dtype)
            x = sw.distribute_tensor(full, mesh, placements)
            for p in (2, 3, 2.5, 0.5):
                for dims, keepdim in ((None, False), ((0,), False), ((len(shape) - 1,), True)):
                    dim_list = tuple(range(len(shape))) if dims is None else dims
                    with CommCounter() as counter:
                        got = torch.linalg.vector_norm(x, p, dim=dims, keepdim=keepdim)
                    want = torch.linalg.vector_norm(full, p, dim=dims, keepdim=keepdim)
                    what = f"{shape} {placements} {dtype} p={p} dim={dims}"
                    torch.testing.assert_close(got.full_tensor(), want, **tol, msg=lambda m: f"{what}: {m}")
                    assert got.placements == _expected_placements(x, dim_list, keepdim), what
                    _expect_terms_only(counter)
            for p in (0, 1, math.inf, -math.inf):  # these combine as Partials, as before
                ranked = full.relu() if p == 0 else full
                got = torch.linalg.vector_norm(sw.distribute_tensor(ranked, mesh, placements), p)
                torch.testing.assert_close(got.full_tensor(), torch.linalg.vector_norm(ranked, p), **tol)


@distributed(world_size=4)
def test_legacy_norm_overloads_combine_terms_too() -> None:
    mesh = _mesh((2, 2))
    full = seeded(10, 7, seed=3, dtype=torch.float64)
    x = sw.distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    cases: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (aten.norm.Scalar, (3,), {}), (aten.norm.ScalarOpt_dtype, (None,), {"dtype": torch.float64}),
        (aten.norm.ScalarOpt_dim, (2, [1], True), {}), (aten.norm.ScalarOpt_dim_dtype, (3, [0], False),
                                                        {"dtype": torch.float64}),
    ]
    for op, args, kwargs in cases:
        with CommCounter() as counter:
            got = op(x, *args, **kwargs)
        torch.testing.assert_close(got.full_tensor(), op(full, *args, **kwargs), **F64)
        _expect_terms_only(counter)


@distributed(world_size=4)
def test_half_precision_norms_sum_their_terms_in_float32_as_one_device_does() -> None:
    mesh = _mesh((4,))
    full = torch.full((1000,), 300.0, dtype=torch.float16)  # each square overflows float16
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    with CommCounter() as counter:
        got = torch.linalg.vector_norm(x)
    _expect_terms_only(counter)
    torch.testing.assert_close(got.full_tensor(), torch.linalg.vector_norm(full))
    assert math.isfinite(float(got.full_tensor()))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_partial_inputs_are_reduced_before_their_norm(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(mesh_shape)
    full = seeded(10, 7, seed=5, dtype=torch.float64)
    layouts = [(Partial("sum"),), (Partial("avg"),)] if len(mesh_shape) == 1 else \
        [(Partial("sum"), Shard(0)), (Shard(1), Partial("sum")), (Partial("sum"), Partial("sum"))]
    for placements in layouts:
        x = make_dtensor(full, mesh, placements)
        for p in (2, 3):
            with CommCounter() as counter:
                got = torch.linalg.vector_norm(x, p)
            torch.testing.assert_close(got.full_tensor(), torch.linalg.vector_norm(full, p), **F64)
            # reduced onto shards (a reduce_scatter) and the terms all-reduced: less than all-reducing
            # the whole tensor (840 B here), and no gather
            moved = _moved(counter)
            assert "all_gather" not in moved, moved
            assert sum(b for _, b in moved.values()) < 2 * 3 / 4 * full.numel() * 8, moved
            norms = torch._foreach_norm([x, x * 2], p)
            for n, w in zip(norms, (full, full * 2)):
                torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm(w, p), **F64)


# -- _foreach_norm -------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_foreach_norm_all_reduces_every_term_at_once(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(mesh_shape)
    fulls, xs = [], []
    for k, (shape, placements) in enumerate(LAYOUTS[mesh_shape]):
        for dtype in (torch.float64, torch.float32):
            full = seeded(*shape, seed=k, dtype=dtype)
            fulls.append(full)
            xs.append(sw.distribute_tensor(full, mesh, placements))
    fulls.append(seeded(5, seed=9, dtype=torch.float64))
    xs.append(sw.distribute_tensor(fulls[-1], mesh, [Replicate()] * len(mesh_shape)))
    for p in (2, 3):
        with CommCounter() as counter:
            norms = torch._foreach_norm(xs, p)
        for n, full, x in zip(norms, fulls, xs):
            tol = F64 if full.dtype == torch.float64 else dict(atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm(full, p), **tol)
            assert n.placements == (Replicate(),) * mesh.ndim
        count, nbytes = _moved(counter).get("all_reduce", (0, 0))
        _expect_terms_only(counter)
        assert count <= 2 * mesh.ndim, f"one all_reduce per mesh dim and dtype, got {count}"
        assert nbytes <= 8 * 2 * len(xs) * mesh.ndim, nbytes
    for p in (1, math.inf):  # these combine as Partials, as before
        for n, full in zip(torch._foreach_norm(xs, p), fulls):
            torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm(full, p), atol=1e-6, rtol=1e-5)


@distributed(world_size=4)
def test_foreach_norm_over_dtensors_on_several_meshes_moves_only_terms() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a_full, b_full = seeded(6, 4, seed=1, dtype=torch.float64), seeded(5, seed=2, dtype=torch.float64)
    a = sw.distribute_tensor(a_full, mesh, [Shard(0), Shard(1)])
    b = sw.distribute_tensor(b_full, mesh["tp"], [Shard(0)])
    for p in (3, 1, math.inf):
        with CommCounter() as counter:
            norms = torch._foreach_norm([a, b], p)
            got = [n.full_tensor() for n in norms]
        torch.testing.assert_close(got[0], torch.linalg.vector_norm(a_full, p), **F64)
        torch.testing.assert_close(got[1], torch.linalg.vector_norm(b_full, p), **F64)
        _expect_terms_only(counter)


# -- gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_vector_norm_backward_on_shards_equals_one_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(mesh_shape)
    for k, (shape, placements) in enumerate(LAYOUTS[mesh_shape]):
        full = seeded(*shape, seed=k, dtype=torch.float64)
        for p, dims in ((2, None), (3, None), (2, (0,))):
            ref = full.clone().requires_grad_(True)
            out_shape = torch.linalg.vector_norm(full, p, dim=dims).shape
            weight = seeded(math.prod(out_shape), seed=11, dtype=torch.float64).reshape(out_shape)
            (torch.linalg.vector_norm(ref, p, dim=dims) * weight).sum().backward()
            x = sw.distribute_tensor(full, mesh, placements).requires_grad_(True)
            with CommCounter() as counter:
                out = torch.linalg.vector_norm(x, p, dim=dims)
            w = sw.distribute_tensor(weight, mesh, out.placements) if out.ndim else weight
            with CommCounter() as backward:
                (out * w).sum().backward()
            _expect_terms_only(counter)
            assert not backward.totals(), backward.totals()  # pointwise on the shards and the whole norm
            assert x.grad is not None
            torch.testing.assert_close(x.grad.full_tensor(), ref.grad, **F64, msg=lambda m: f"{shape} {p}: {m}")


@distributed(world_size=4)
def test_clip_grad_norm_scales_sharded_grads_as_one_device_does() -> None:
    mesh = _mesh((4,))
    shapes = [(16, 8), (10, 7), (3, 5), (8,)]
    fulls = [seeded(*s, seed=k, dtype=torch.float64) for k, s in enumerate(shapes)]
    for foreach in (True, False):
        ref = [torch.nn.Parameter(torch.zeros_like(f)) for f in fulls]
        ours = [torch.nn.Parameter(sw.distribute_tensor(torch.zeros_like(f), mesh, [Shard(0)])) for f in fulls]
        for r, o, f in zip(ref, ours, fulls):
            r.grad = f.clone()
            o.grad = sw.distribute_tensor(f, mesh, [Shard(0)])
        want = torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=foreach)
        with CommCounter() as counter:
            got = torch.nn.utils.clip_grad_norm_(ours, 1.0, foreach=foreach)
        torch.testing.assert_close(got.full_tensor(), want, **F64)
        for r, o in zip(ref, ours):
            assert o.grad is not None
            torch.testing.assert_close(o.grad.full_tensor(), r.grad, **F64)
        _expect_terms_only(counter)


# -- bytes: a model's worth of gradients ---------------------------------------------------


def _llama_shapes(layers: int = 4, dim: int = 256, hidden: int = 768, vocab: int = 2048) -> list[tuple[int, ...]]:
    """A small Llama's parameter shapes: embedding, per layer wq/wk/wv/wo, w1/w3/w2 and two
    norms, the final norm and the output; plus two uneven ones (one with empty pieces on 4 ranks)."""
    layer = [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden), (dim,), (dim,)]
    return [(vocab, dim)] + layer * layers + [(dim,), (vocab, dim), (10, 7), (3, 5)]


class _TorchBytes:
    """Counts torch DTensor's functional collectives and the bytes each rank receives, in the
    cost model shardwise's records use (all_reduce: 2(n-1)/n of the tensor, ring)."""

    def __init__(self, n: int) -> None:
        import torch.distributed._functional_collectives as funcol

        self.funcol, self.count, self.bytes = funcol, 0, 0.0
        self.saved = {name: getattr(funcol, name) for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor")}
        costs = {"all_reduce": 2 * (n - 1) / n, "all_gather_tensor": n - 1, "reduce_scatter_tensor": (n - 1) / n}

        def counting(name: str) -> Any:
            def run(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.count += 1
                self.bytes += costs[name] * t.numel() * t.element_size()
                return self.saved[name](t, *args, **kwargs)
            return run

        for name in self.saved:
            setattr(funcol, name, counting(name))

    def undo(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.funcol, name, fn)


@pytest.mark.parametrize("foreach", [True, False])
@distributed(world_size=4)
def test_get_total_norm_of_a_models_grads_moves_a_few_bytes_per_tensor_not_the_grads(foreach: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    n = 4
    mesh = _mesh((n,))
    shapes = _llama_shapes()
    fulls = [seeded(*s, seed=k) for k, s in enumerate(shapes)]
    grads = [sw.distribute_tensor(f, mesh, [Shard(0)]) for f in fulls]
    with CommCounter() as counter:
        total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach).full_tensor()
    want = torch.nn.utils.get_total_norm(fulls, 2.0, foreach=foreach)
    torch.testing.assert_close(total, want, atol=0, rtol=1e-5)
    _expect_terms_only(counter)
    count, ours = _moved(counter)["all_reduce"]
    # what the all-gather of every gradient moved: (n-1) times the largest piece, per tensor
    gathered = sum((n - 1) * math.ceil(s[0] / n) * math.prod(s[1:]) * 4 for s in shapes)
    assert ours <= 8 * len(shapes), f"{ours} B for {len(shapes)} tensors: more than a few bytes each"
    assert ours * 10_000 < gathered, (ours, gathered)  # 246 B against 13,376,568 B (41 tensors)
    assert count == (1 if foreach else len(shapes))  # foreach: one all_reduce for the whole list

    tmesh = torch_mesh("cpu", (n,))
    theirs = [torch_distribute(f, tmesh, [TorchShard(0)]) for f in fulls]
    counting = _TorchBytes(n)
    try:
        torch_total = torch.nn.utils.get_total_norm(theirs, 2.0, foreach=foreach).full_tensor()
    finally:
        counting.undo()
    torch.testing.assert_close(total, torch_total, atol=0, rtol=2e-6)
    # torch's DTensor: one all_reduce of the stacked partial norms (41 float32: 246 B), either way;
    # ours moves the same bytes (foreach=False: in one all_reduce per tensor, 6 B each)
    assert ours <= counting.bytes * 1.5, (ours, counting.bytes)
