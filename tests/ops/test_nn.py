"""NN op strategies (embedding, nll_loss, CPU flash attention, dropout, pooling), checked by
simulating every rank in one process.

`check_nn` is `strategy_sim.check_op` with two additions this family needs: 0-dim tensors
are DTensor inputs too (a loss, a total weight), and the ops whose pieces run a masked local
computation (vocab-sharded embedding, split mean loss) run it on each simulated rank, with
that rank's coordinate, exactly as the tensor layer does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import shardwise._ops._nn as nn_ops
from shardwise import AbstractMesh, Partial, Placement, Replicate, Shard
from shardwise._layout import contiguous_strides
from shardwise._ops import Layout, LocalCall, LocalFn, OpSchema, OpStrategy, PlacementStrategy, get_op_strategy, propagate, rule_for
from shardwise._spec import DTensorSpec, TensorMeta

from ..strategy_sim import SimRank, _terms, assemble_output, coordinates, default_layouts, first_time

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]
R = Replicate()

# What runs instead of the aten op on the pieces: each op rule's local implementation.
LOCAL: dict[Any, Optional[LocalFn]] = {
    op: rule_for(op).local for op in (aten.embedding.default, aten.embedding_dense_backward.default,
                                      aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed))


def randint(high: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=gen(seed))


# -- the simulator variant ---------------------------------------------------------------------


def _tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _swap(values: Sequence[Any], it: Any) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(next(it))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            out.append(type(v)(next(it) if isinstance(x, torch.Tensor) else x for x in v))
        else:
            out.append(tuple(v) if isinstance(v, list) else v)
    return out


def _spec(mesh: AbstractMesh, t: Any, layout: Layout) -> DTensorSpec:
    return DTensorSpec(mesh, layout.placements, TensorMeta(t.shape, contiguous_strides(t.shape), t.dtype), layout.shard_order)


def _schema(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh: AbstractMesh, layouts: Sequence[Layout]) -> OpSchema:
    tensors = _tensors(list(args) + list(kwargs.values()))
    specs = iter([_spec(mesh, t, lay) for t, lay in zip(tensors, layouts)])
    values = _swap(list(args) + list(kwargs.values()), specs)
    return OpSchema(op, tuple(values[: len(args)]), tuple(zip(kwargs, values[len(args):])))


def _simulate(op: Any, args: Sequence[Any], kwargs: dict[str, Any], mesh_shape: Sequence[int],
              cand: PlacementStrategy, current: Sequence[Layout], want: Any) -> Any:
    mesh = AbstractMesh(tuple(mesh_shape))
    tensors = _tensors(list(args) + list(kwargs.values()))
    wanted = [lay if lay is not None else cur for lay, cur in zip(cand.input_specs, current)]
    pieces = [_terms(t, mesh_shape, lay, 100 + k) for k, (t, lay) in enumerate(zip(tensors, wanted))]
    in_specs = [_spec(mesh, t, lay) for t, lay in zip(tensors, wanted)]
    outs = cand.output_specs if isinstance(cand.output_specs, tuple) else (cand.output_specs,)
    wants = want if isinstance(want, tuple) else (want,)
    out_specs = [_spec(mesh, w, lay) if lay is not None else None for w, lay in zip(wants, outs)]
    per_rank = {}
    for c in coordinates(mesh_shape):
        values = _swap(list(args) + list(kwargs.values()), iter([p[c] for p in pieces]))
        largs, lkw = list(values[: len(args)]), dict(zip(kwargs, values[len(args):]))
        local = LOCAL.get(op)
        out_spec = out_specs[0] if len(out_specs) == 1 else tuple(out_specs)
        call = LocalCall(op, largs, lkw, tuple(in_specs), out_spec, SimRank(c))
        result = op(*largs, **lkw) if local is None else local(call)
        per_rank[c] = result if isinstance(result, tuple) else (result,)
    got = tuple(assemble_output({c: r[k] for c, r in per_rank.items()}, mesh_shape, lay) if lay is not None else None
                for k, lay in enumerate(outs))
    return got if isinstance(cand.output_specs, tuple) else got[0]


def check_nn(op: Any, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, *, mesh_shape: Sequence[int] = (2, 2),
             layouts: Optional[Sequence[Sequence[Sequence[Placement]]]] = None, atol: float = 1e-5, rtol: float = 1e-5) -> int:
    """Simulate every candidate for each input layout combination; returns how many ran."""
    kwargs = kwargs or {}
    fn = get_op_strategy(op)
    assert fn is not None, f"no strategy registered for {op}"
    want = op(*args, **kwargs)
    tensors = _tensors(list(args) + list(kwargs.values()))
    combos = ([[Layout(tuple(p)) for p in combo] for combo in layouts] if layouts
              else default_layouts(tensors, len(mesh_shape)))
    mesh = AbstractMesh(tuple(mesh_shape))
    count, seen = 0, set()
    for combo in combos:
        schema = _schema(op, args, kwargs, mesh, combo)
        strategy = fn(schema)
        assert isinstance(strategy, OpStrategy)
        for cand in strategy.strategies:
            if not first_time(seen, cand, combo):  # the same simulation as one already checked
                count += 1
                continue
            got = _simulate(op, args, kwargs, mesh_shape, cand, combo, want)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                if g is not None:
                    torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True,
                                               msg=lambda m: f"{op} inputs {[str(c) for c in combo]} candidate {cand}\n{m}")
            count += 1
        propagate(schema)
    return count


def pick(op: Any, args: Sequence[Any], placements: Sequence[Sequence[Placement]], mesh_shape: Sequence[int] = (4,),
         kwargs: Optional[dict[str, Any]] = None) -> Any:
    schema = _schema(op, args, kwargs or {}, AbstractMesh(tuple(mesh_shape)), [Layout(tuple(p)) for p in placements])
    return propagate(schema)


def no_moves(result: Any) -> bool:
    return all(s is None for s in result.input_specs)


def test_check_nn_catches_a_wrong_candidate() -> None:
    # the checker itself: the vocab-sharded lookup run as a plain aten op must be caught
    w, ids = randn(10, 4), randint(10, 3, 5)
    cand = PlacementStrategy(Layout((Partial(),)), (Layout((Shard(0),)), Layout((R,))))
    saved = LOCAL.pop(aten.embedding.default)
    try:
        with pytest.raises((AssertionError, IndexError)):
            got = _simulate(aten.embedding.default, (w, ids), {}, (2,), cand, [Layout((R,)), Layout((R,))], F.embedding(ids, w))
            torch.testing.assert_close(got, F.embedding(ids, w))
    finally:
        LOCAL[aten.embedding.default] = saved


# -- embedding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("vocab,dim,ids_shape", [(10, 4, (3, 5)), (7, 6, (6,)), (3, 5, (2, 3)), (9, 3, (4, 2))])
def test_embedding(mesh_shape: tuple[int, ...], vocab: int, dim: int, ids_shape: tuple[int, ...]) -> None:
    w, ids = randn(vocab, dim, seed=1), randint(vocab, *ids_shape, seed=2)
    assert check_nn(aten.embedding.default, (w, ids), mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("padding_idx,by_freq", [(-1, False), (2, False), (-1, True), (5, True)])
@pytest.mark.parametrize("vocab,ids_shape", [(10, (3, 5)), (7, (6,))])
def test_embedding_dense_backward(mesh_shape: tuple[int, ...], padding_idx: int, by_freq: bool, vocab: int,
                                  ids_shape: tuple[int, ...]) -> None:
    ids = randint(vocab, *ids_shape, seed=3)
    grad = randn(*ids_shape, 4, seed=4)
    n = check_nn(aten.embedding_dense_backward.default, (grad, ids, vocab, padding_idx, by_freq), mesh_shape=mesh_shape)
    assert n > 0


def test_embedding_layouts_run_without_gathering() -> None:
    w, ids = randn(12, 8), randint(12, 4, 6)
    got = pick(aten.embedding.default, (w, ids), [(R,), (Shard(0),)])  # (a) replicated table, split ids
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)
    got = pick(aten.embedding.default, (w, ids), [(Shard(1),), (R,)])  # (b) split embedding dim
    assert no_moves(got) and got.output_spec.placements == (Shard(2),)
    got = pick(aten.embedding.default, (w, ids), [(Shard(0),), (R,)])  # (c) split vocab
    assert no_moves(got) and got.output_spec.placements == (Partial(),)
    grad = randn(4, 6, 8)
    got = pick(aten.embedding_dense_backward.default, (grad, ids, 12, -1, False), [(R,), (R,)])
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)  # lands on the vocab-split weight
    got = pick(aten.embedding_dense_backward.default, (grad, ids, 12, -1, False), [(Shard(0),), (Shard(0),)])
    assert no_moves(got) and got.output_spec.placements == (Partial(),)
    got = pick(aten.embedding_dense_backward.default, (grad, ids, 12, -1, False), [(Shard(2),), (R,)])
    assert no_moves(got) and got.output_spec.placements == (Shard(1),)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("mode", [0, 1, 2])  # sum, mean, max
@pytest.mark.parametrize("dim", [8, 6])  # 6 columns on 4 ranks: an empty piece, which the kernel rejects
def test_embedding_bag_forward_and_backward(mesh_shape: tuple[int, ...], mode: int, dim: int) -> None:
    w, ids, offsets = randn(10, dim, seed=5), randint(10, 8, seed=6), torch.tensor([0, 3, 3, 5])
    n = len(mesh_shape)
    splits = not (dim == 6 and mesh_shape == (4,))
    split = [(Shard(1),) * n] + [(R,) * n] * 4
    for op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default):
        ran = check_nn(op, (w, ids, offsets, False, mode), mesh_shape=mesh_shape, layouts=[split[:3]])
        assert ran == (2 ** n if splits else 1)
    out, offset2bag, bag_size, max_ix = aten._embedding_bag.default(w, ids, offsets, False, mode)
    args = (randn(*out.shape, seed=7), ids, offsets, offset2bag, bag_size, max_ix, 10, False, mode, False, None)
    split = split[:1] + [(R,) * n] * 5
    ran = check_nn(aten._embedding_bag_backward.default, args, mesh_shape=mesh_shape, layouts=[split])
    assert ran == (2 ** n if splits else 1)
    got = pick(aten._embedding_bag.default, (w, ids, offsets, False, mode), split[:3], mesh_shape)
    # a column-split table stays split (where every rank holds a column)
    assert no_moves(got) == splits and got.output_spec[0].placements == (split[0] if splits else (R,) * n)


def test_masked_candidates_come_with_their_local_implementations_whatever_is_imported() -> None:
    # regression: the vocab-split lookup and the split-sample mean loss were offered only once
    # the tensor layer had registered their masked computations (`_ops` answered differently
    # depending on imports); the rule now carries its local implementation, so the candidate
    # and the computation that makes it right always come together
    for op in (aten.embedding.default, aten.embedding_dense_backward.default, aten.nll_loss_forward.default):
        assert rule_for(op).local is not None, op
    w, ids = randn(12, 8), randint(12, 4, 6)
    schema = _schema(aten.embedding.default, (w, ids), {}, AbstractMesh((4,)), [Layout((Shard(0),)), Layout((R,))])
    strategy = rule_for(aten.embedding.default).strategy(schema)  # type: ignore[misc]
    assert isinstance(strategy, OpStrategy)
    assert any(c.input_specs[0] == Layout((Shard(0),)) for c in strategy.strategies)
    lp, t = randn(8, 5), randint(5, 8)
    schema = _schema(aten.nll_loss_forward.default, (lp, t, None, 1, -100), {}, AbstractMesh((4,)),
                     [Layout((Shard(0),)), Layout((Shard(0),))])
    strategy = rule_for(aten.nll_loss_forward.default).strategy(schema)  # type: ignore[misc]
    assert isinstance(strategy, OpStrategy)
    assert any(c.input_specs[0] == Layout((Shard(0),)) for c in strategy.strategies)


# -- nll_loss -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("n,weighted", [(8, False), (7, True), (3, True)])
def test_nll_loss_forward_and_backward(mesh_shape: tuple[int, ...], reduction: int, weighted: bool, n: int) -> None:
    lp = randn(n, 5, seed=5).log_softmax(1)
    target = randint(5, n, seed=6)
    target[1] = -100  # an ignored sample
    weight = torch.rand(5, generator=gen(7)) + 0.5 if weighted else None
    args = (lp, target, weight, reduction, -100)
    assert check_nn(aten.nll_loss_forward.default, args, mesh_shape=mesh_shape) > 0
    out, tw = aten.nll_loss_forward.default(*args)
    grad = randn(*out.shape, seed=8)
    back = (grad, lp, target, weight, reduction, -100, tw)
    assert check_nn(aten.nll_loss_backward.default, back, mesh_shape=mesh_shape) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss2d(mesh_shape: tuple[int, ...], reduction: int) -> None:
    lp = randn(3, 4, 5, 2, seed=9).log_softmax(1)
    target = randint(4, 3, 5, 2, seed=10)
    target[0, 0, 0] = 1  # keep the total weight nonzero whatever the split
    args = (lp, target, None, reduction, 2)
    assert check_nn(aten.nll_loss2d_forward.default, args, mesh_shape=mesh_shape) > 0
    out, tw = aten.nll_loss2d_forward.default(*args)
    back = (randn(*out.shape, seed=11), lp, target, None, reduction, 2, tw)
    assert check_nn(aten.nll_loss2d_backward.default, back, mesh_shape=mesh_shape) > 0


def test_nll_loss_single_sample() -> None:
    lp, t = randn(5).log_softmax(0), torch.tensor(3)
    for reduction in (0, 1, 2):
        assert check_nn(aten.nll_loss_forward.default, (lp, t, None, reduction, -100), mesh_shape=(4,)) > 0


def test_batch_split_mean_loss_moves_only_the_target() -> None:
    lp, t = randn(16, 50).log_softmax(1), randint(50, 16)
    got = pick(aten.nll_loss_forward.default, (lp, t, None, 1, -100), [(Shard(0),), (Shard(0),)])
    assert got.input_specs[0] is None  # the logits stay where they are
    assert got.input_specs[1] is not None and got.input_specs[1].placements == (R,)
    assert [o.placements for o in got.output_spec] == [(Partial(),), (R,)]
    got = pick(aten.nll_loss_forward.default, (lp, t, None, 2, -100), [(Shard(0),), (Shard(0),)])
    assert no_moves(got) and [o.placements for o in got.output_spec] == [(Partial(),), (Partial(),)]
    out, tw = aten.nll_loss_forward.default(lp, t, None, 1, -100)
    got = pick(aten.nll_loss_backward.default, (torch.tensor(1.0), lp, t, None, 1, -100, tw),
               [(R,), (Shard(0),), (Shard(0),), (R,)])
    assert no_moves(got) and got.output_spec.placements == (Shard(0),)


# -- attention ----------------------------------------------------------------------------------


def _qkv(b: int, h: int, lq: int, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return randn(b, h, lq, e, seed=12), randn(b, h, s, e, seed=13), randn(b, h, s, e, seed=14)


ATTENTION_SHAPES = [(2, 4, 6, 5, 8), (3, 2, 5, 7, 4), (1, 3, 2, 2, 4)]


def _attention_layouts(mesh_ndim: int, n_inputs: int) -> list[list[tuple[Placement, ...]]]:
    """Batch-split, head-split, query-row-split, replicated and value-Partial inputs."""
    found = []
    for p in [Shard(0), Shard(1), Shard(2), R]:
        found.append([(p,) * mesh_ndim] * n_inputs)
    found.append([(Shard(0),) + (Shard(1),) * (mesh_ndim - 1)] * n_inputs)
    return found


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward_and_backward(mesh_shape: tuple[int, ...], shape: tuple[int, ...], causal: bool) -> None:
    q, k, v = _qkv(*shape)
    op, back = aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    nd = len(mesh_shape)
    lays = _attention_layouts(nd, 3) + [[(R,) * nd, (R,) * nd, (Partial(),) * nd]]
    assert check_nn(op, (q, k, v, 0.0, causal), mesh_shape=mesh_shape, layouts=lays, atol=1e-4, rtol=1e-4) > 0
    out, lse = op(q, k, v, 0.0, causal)
    g = randn(*out.shape, seed=15)
    lays = _attention_layouts(nd, 6) + [[(Partial(),) * nd] + [(R,) * nd] * 5]
    assert check_nn(back, (g, q, k, v, out, lse, 0.0, causal), mesh_shape=mesh_shape, layouts=lays, atol=1e-4, rtol=1e-4) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("mask_shape", [(6, 5), (2, 1, 6, 5), (2, 4, 6, 5), (1, 5)])
def test_flash_attention_with_a_mask(mesh_shape: tuple[int, ...], mask_shape: tuple[int, ...]) -> None:
    q, k, v = _qkv(2, 4, 6, 5, 8)
    mask = randn(*mask_shape, seed=16)
    op, back = aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    nd = len(mesh_shape)
    lays = [lay + [(R,) * nd] for lay in _attention_layouts(nd, 3)]
    assert check_nn(op, (q, k, v), {"attn_mask": mask}, mesh_shape=mesh_shape, layouts=lays, atol=1e-4, rtol=1e-4) > 0
    out, lse = op(q, k, v, attn_mask=mask)
    g = randn(*out.shape, seed=17)
    lays = [lay + [(R,) * nd] for lay in _attention_layouts(nd, 6)]
    n = check_nn(back, (g, q, k, v, out, lse, 0.0, False), {"attn_mask": mask}, mesh_shape=mesh_shape, layouts=lays,
                 atol=1e-4, rtol=1e-4)
    assert n > 0


def test_attention_runs_without_gathering_for_batch_and_head_splits() -> None:
    q, k, v = _qkv(4, 8, 6, 6, 4)
    op, back = aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = op(q, k, v, 0.0, True)
    for d in (0, 1):
        got = pick(op, (q, k, v, 0.0, True), [(Shard(d),)] * 3)
        assert no_moves(got) and [o.placements for o in got.output_spec] == [(Shard(d),), (Shard(d),)]
        got = pick(back, (out, q, k, v, out, lse, 0.0, True), [(Shard(d),)] * 6)
        assert no_moves(got) and [o.placements for o in got.output_spec] == [(Shard(d),)] * 3
    # causal attention cannot keep query rows split (the mask is aligned to global positions)
    got = pick(op, (q, k, v, 0.0, True), [(Shard(2),)] * 3)
    assert got.input_specs[0] is not None and got.input_specs[0].placements != (Shard(2),)


# -- dropout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_native_dropout_strategies(mesh_shape: tuple[int, ...]) -> None:
    x = randn(8, 4, seed=18)
    # p = 0 makes the op deterministic: the check is about layouts, the mask values are the
    # random-ops layer's job. (No empty pieces: aten returns a float mask for an empty input.)
    assert check_nn(aten.native_dropout.default, (x, 0.0, True), mesh_shape=mesh_shape) > 0
    mask = randn(8, 4, seed=19) > 0
    assert check_nn(aten.native_dropout_backward.default, (x, mask, 2.0), mesh_shape=mesh_shape) > 0
    got = pick(aten.native_dropout.default, (x, 0.5, True), [(Partial(),)])
    # x * mask / (1 - p) is linear in x: the partial terms are scaled by one replicated mask
    assert got.input_specs[0] is None and got.output_spec[0].placements == (Partial(),)
    got = pick(aten.native_dropout_backward.default, (x, mask, 2.0), [(Partial(),), (R,)])
    assert no_moves(got) and got.output_spec.placements == (Partial(),)


# -- pooling ------------------------------------------------------------------------------------


def _pool_cases(x: torch.Tensor) -> list[tuple[Any, tuple[Any, ...]]]:
    spatial = x.ndim - 2 if x.ndim in (4, 5) else x.ndim - 1
    two = spatial == 2
    return [
        (aten.max_pool2d_with_indices.default if two else aten.max_pool3d_with_indices.default, (x, [2] * spatial)),
        (aten.avg_pool2d.default if two else aten.avg_pool3d.default, (x, [2] * spatial, [1] * spatial, [1] * spatial)),
        (aten._adaptive_avg_pool2d.default if two else aten._adaptive_avg_pool3d.default, (x, [3] * spatial)),
        (aten.adaptive_max_pool2d.default if two else aten.adaptive_max_pool3d.default, (x, [3] * spatial)),
    ]


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("shape", [(2, 3, 6, 6), (5, 3, 7, 5), (3, 6, 6), (2, 3, 4, 4, 4)])
def test_pooling_forward_and_backward(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> None:
    x = randn(*shape, seed=20)
    for op, args in _pool_cases(x):
        assert check_nn(op, args, mesh_shape=mesh_shape) > 0, op
        out = op(*args)
        g = randn(*(out[0] if isinstance(out, tuple) else out).shape, seed=21)
        name = str(op).split(".")[1]
        if name.startswith("max_pool"):
            back: Any = getattr(aten, name + "_backward").default
            bargs: tuple[Any, ...] = (g, x, args[1], [], [0] * len(args[1]), [1] * len(args[1]), False, out[1])
        elif name.startswith("adaptive_max"):
            back, bargs = getattr(aten, name + "_backward").default, (g, x, out[1])
        elif name.startswith("avg"):
            back, bargs = getattr(aten, name + "_backward").default, (g, x, *args[1:], False, True, None)
        else:
            back, bargs = getattr(aten, name + "_backward").default, (g, x)
        assert check_nn(back, bargs, mesh_shape=mesh_shape) > 0, back


def test_pooling_keeps_batch_and_channel_splits() -> None:
    x = randn(4, 8, 6, 6)
    for d in (0, 1):
        got = pick(aten.max_pool2d_with_indices.default, (x, [2, 2]), [(Shard(d),)])
        assert no_moves(got) and [o.placements for o in got.output_spec] == [(Shard(d),), (Shard(d),)]
    got = pick(aten.avg_pool2d.default, (x, [2, 2]), [(Partial(),)])
    assert no_moves(got) and got.output_spec.placements == (Partial(),)
    got = pick(aten.avg_pool2d.default, (x, [2, 2]), [(Shard(2),)])
    assert got.input_specs[0] is not None and got.input_specs[0].placements != (Shard(2),)  # spatial dims whole


# -- activations: the tagged ones are the pointwise family's; the untagged ones are here -----------


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[Any, ...]]] = {
    # op name -> args from (grad, x)
    "gelu_backward": lambda g, x: (g, x), "silu_backward": lambda g, x: (g, x),
    "threshold_backward": lambda g, x: (g, x, 0.0), "tanh_backward": lambda g, x: (g, x.tanh()),
    "sigmoid_backward": lambda g, x: (g, x.sigmoid()),
    "hardtanh_backward": lambda g, x: (g, x, -1.0, 1.0), "leaky_relu_backward": lambda g, x: (g, x, 0.01, False),
    "elu_backward": lambda g, x: (g, 1.0, 1.0, 1.0, False, x), "softplus_backward": lambda g, x: (g, x, 1.0, 20.0),
    "hardsigmoid_backward": lambda g, x: (g, x), "hardswish_backward": lambda g, x: (g, x),
    "mish_backward": lambda g, x: (g, x), "softshrink_backward": lambda g, x: (g, x, 0.5),
    "hardshrink_backward": lambda g, x: (g, x, 0.5),
    "log_sigmoid_backward": lambda g, x: (g, x, aten.log_sigmoid_forward.default(x)[1]),
    "rrelu_with_noise_backward": lambda g, x: (g, x, torch.rand(x.shape, generator=gen(1)), 0.1, 0.3, True, False),
    "hardswish": lambda g, x: (x,), "log_sigmoid_forward": lambda g, x: (x,),
}


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_and_their_backwards(mesh_shape: tuple[int, ...], name: str) -> None:
    g, x = randn(6, 5, seed=22), randn(6, 5, seed=23)
    op = getattr(aten, name).default
    args = ACTIVATIONS[name](g, x)
    assert check_nn(op, args, mesh_shape=mesh_shape) > 0
    got = pick(op, args, [(Shard(0),)] * len(_tensors(args)))
    outs = got.output_spec if isinstance(got.output_spec, tuple) else (got.output_spec,)
    assert no_moves(got) and all(o.placements == (Shard(0),) for o in outs)
    if name.endswith("_backward") and torch.Tag.pointwise not in op.tags:
        # the untagged backwards are registered here, linear in the incoming gradient: a
        # partial gradient stays partial (the tagged ones belong to the pointwise family)
        got = pick(op, args, [(Partial(),)] + [(R,)] * (len(_tensors(args)) - 1))
        assert no_moves(got) and got.output_spec.placements == (Partial(),)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_glu_and_its_backward(mesh_shape: tuple[int, ...]) -> None:
    x = randn(6, 4, 3, seed=24)
    for dim in (1, -1, 0):
        if x.shape[dim] % 2:
            continue
        assert check_nn(aten.glu.default, (x, dim), mesh_shape=mesh_shape) > 0
        g = randn(*aten.glu.default(x, dim).shape, seed=25)
        assert check_nn(aten.glu_backward.default, (g, x, dim), mesh_shape=mesh_shape) > 0


def test_attention_and_pooling_never_give_a_rank_an_empty_piece_their_kernel_rejects() -> None:
    # regression: the CPU flash kernel dies with SIGFPE on an empty head or query-row piece,
    # and the pooling kernels reject an empty channel piece; uneven splits give trailing ranks
    # such pieces (3 heads over 4 ranks). Checked against every rank's local shape.
    q, k, v = _qkv(2, 3, 5, 5, 4)
    x = randn(5, 3, 4, 4)
    cases = [(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), {0: (1, 2), 1: (1, 2), 2: (1, 2)}),
             (aten.max_pool2d_with_indices.default, (x, [2, 2]), {0: (1,)}),
             (aten.avg_pool2d_backward.default, (randn(5, 3, 2, 2), x, [2, 2], [2, 2], [0, 0], False, True, None), {1: (1,)})]
    for op, args, guarded in cases:
        fn = get_op_strategy(op)
        assert fn is not None
        for mesh_shape in MESHES:
            mesh = AbstractMesh(mesh_shape)
            for d in (0, 1, 2):
                lay = Layout((Shard(d),) * len(mesh_shape))
                schema = _schema(op, args, {}, mesh, [lay] * len(_tensors(args)))
                strategy = fn(schema)
                assert isinstance(strategy, OpStrategy) and strategy.strategies
                specs = schema.input_specs()
                for cand in strategy.strategies:
                    for k, dims in guarded.items():
                        want = cand.input_specs[k] or Layout(specs[k].placements)
                        spec = specs[k].with_placements(want.placements)
                        for c in coordinates(mesh_shape):
                            shape = spec.local_shape_and_offset(c)[0]
                            assert all(shape[dd] > 0 for dd in dims), (op, cand, c, shape)


def test_piece_sizes_match_torch_chunk() -> None:
    def chunked(size: int, parts: Sequence[int]) -> set[int]:
        pieces = [torch.empty(size)]
        for n in parts:
            pieces = [c for p in pieces for c in list(torch.chunk(p, n)) + [torch.empty(0)] * (n - len(torch.chunk(p, n)))]
        return {len(p) for p in pieces}

    for size in range(20):
        for parts in [(2,), (3,), (4,), (2, 2), (2, 3), (4, 2)]:
            assert nn_ops._piece_sizes(size, parts) == chunked(size, parts), (size, parts)
