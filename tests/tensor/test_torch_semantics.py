"""torch.distributed.tensor's own semantics, item by item, in our own words.

Each test is named after what broke when code written for torch's DTensor ran on shardwise
with only its imports changed: mixed precision with `module.to(dtype)`, pickling, strides of
`from_local`, `run_check`, `to_empty`, `grad_placements`, ranks outside a mesh, and the
names torch has that we lacked. Values are checked against one process.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import distributed


def _mesh(shape: tuple[int, ...] = (4,)) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[2 - len(shape):])


def _tp(mesh: sw.DeviceMesh) -> sw.DeviceMesh:
    return mesh["tp"] if mesh.ndim == 2 else mesh


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


# -- mixed precision -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_module_to_dtype_casts_each_ranks_piece_not_only_the_wrapper(shape: tuple[int, ...]) -> None:
    mesh = _mesh(shape)
    torch.manual_seed(0)
    ref = _MLP()
    model = _MLP()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, _tp(mesh), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name
        assert p.dtype == torch.bfloat16 and p.to_local().dtype == torch.bfloat16, name
    x = torch.randn(3, 8).to(torch.bfloat16)
    out = model(x)
    expected = ref(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=2e-2)  # bf16: partial sums round apart
    out.float().sum().backward()
    expected.float().sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-2, rtol=2e-2)
    # and back: the pieces are the rounded values, in float32 again
    model.to(torch.float32)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.to_local().dtype == torch.float32 and p.grad.to_local().dtype == torch.float32
        assert torch.equal(p.full_tensor(), q.float()), name


@distributed(world_size=4)
def test_redistribute_forward_dtype_casts_before_moving_and_backward_dtype_casts_the_gradient() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    full = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    x = sw.distribute_tensor(full.detach(), mesh, [Shard(0)]).requires_grad_()
    with sw.comm_log() as log:
        y = x.redistribute(mesh, [Replicate()], forward_dtype=torch.float32, backward_dtype=torch.float16)
    assert y.dtype == torch.float32 and y.to_local().dtype == torch.float32
    assert torch.equal(y.to_local(), full.detach().float())
    # the float32 pieces travelled, not the float64 ones
    assert [r.op for r in log] == ["all_gather"] and log[0].bytes_received == 6 * 6 * 4
    weights = torch.randn(8, 6, dtype=torch.float32)
    (y * weights).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float64
    # the gradient went back through float16
    expected = weights.to(torch.float16).to(torch.float64)
    assert torch.equal(x.grad.full_tensor(), expected)


# -- pickling --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_torch_save_of_a_dtensor_and_a_state_dict_pickles_without_process_groups(shape: tuple[int, ...]) -> None:
    mesh = _mesh(shape)
    torch.manual_seed(1)
    full = torch.randn(5, 7)
    placements = [Shard(0)] if len(shape) == 1 else [Shard(1), Shard(0)]
    d = sw.distribute_tensor(full, mesh, placements)
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    back = torch.load(buffer)
    assert isinstance(back, DTensor) and back.device_mesh == mesh and back.placements == d.placements
    assert torch.equal(back.to_local(), d.to_local()) and torch.equal(back.full_tensor(), full)

    model = _MLP()
    parallelize_module(model, _tp(mesh), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    state = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    fresh = _MLP()
    parallelize_module(fresh, _tp(mesh), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fresh.load_state_dict(loaded)
    for (name, p), (_, q) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert type(p) is type(q), name
        if isinstance(p, DTensor):
            assert q.placements == p.placements and torch.equal(q.to_local(), p.to_local()), name
        else:
            assert torch.equal(p, q), name


# -- from_local ------------------------------------------------------------------------------


@distributed(world_size=4)
def test_from_local_of_a_transposed_piece_scales_the_local_strides() -> None:
    mesh = _mesh()
    rank = dist.get_rank()
    local = (torch.arange(32.0).view(4, 8) + 100 * rank).t()  # (8, 4), strides (1, 8)
    d = DTensor.from_local(local, mesh, [Shard(0)])
    assert d.shape == (32, 4) and d.stride() == (1, 32)
    full = torch.cat([(torch.arange(32.0).view(4, 8) + 100 * r).t() for r in range(4)])
    assert torch.equal(d.full_tensor(), full)
    assert torch.equal((d * 2).full_tensor(), full * 2)
    assert torch.equal(d.contiguous().view(-1).full_tensor(), full.reshape(-1))
    e = DTensor.from_local(local, mesh, [Shard(1)])
    assert e.shape == (8, 16) and e.stride() == (1, 8)


@pytest.mark.parametrize("field", ["dtype", "requires_grad", "stride", "placements", "ndim"])
@distributed(world_size=4)
def test_from_local_run_check_names_every_metadata_field_ranks_disagree_on(field: str) -> None:
    mesh = _mesh()
    rank = dist.get_rank()
    odd = rank == 2
    local = torch.randn(4, 6)
    placements: list[sw.Placement] = [Shard(0)]
    if field == "dtype" and odd:
        local = local.double()
    if field == "requires_grad" and odd:
        local.requires_grad_()
    if field == "stride" and odd:
        local = torch.randn(6, 4).t()
    if field == "placements" and odd:
        placements = [Replicate()]
    if field == "ndim" and odd:
        local = local.view(4, 6, 1)
    with pytest.raises(ValueError, match=field) as info:
        DTensor.from_local(local, mesh, placements, run_check=True)
    assert "rank 2" in str(info.value)


# -- modules ---------------------------------------------------------------------------------


@distributed(world_size=4)
def test_to_empty_keeps_a_partial_buffer_partial() -> None:
    mesh = _mesh()
    module = nn.Module()
    module.register_buffer("acc", DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    module.to_empty(device="cpu")
    assert module.acc.placements == (Partial(),) and module.acc.to_local().shape == (3,)
    assert torch.empty_like(module.acc).placements == (Partial(),)
    assert torch.zeros_like(module.acc).placements == (Replicate(),)


@pytest.mark.parametrize("make", ["distribute_tensor", "from_local", "parameter"])
@distributed(world_size=4)
def test_grad_placements_partial_still_leaves_a_replicate_leaf_a_reduced_replicate_grad(make: str) -> None:
    mesh = _mesh()
    rank = dist.get_rank()
    full = torch.arange(6.0)
    if make == "distribute_tensor":
        x = sw.distribute_tensor(full.clone().requires_grad_(), mesh, [Replicate()])
    elif make == "from_local":
        x = DTensor.from_local(full.clone(), mesh, [Replicate()]).detach().requires_grad_()
    else:
        x = nn.Parameter(sw.distribute_tensor(full.clone(), mesh, [Replicate()]))
    local = x.to_local(grad_placements=[Partial()])
    (local * (rank + 1)).sum().backward()  # rank r's term of the gradient: r + 1
    assert x.grad is not None and x.grad.placements == (Replicate(),)
    assert torch.equal(x.grad.to_local(), torch.full((6,), 10.0))


# -- names torch has -------------------------------------------------------------------------


@distributed(world_size=4)
def test_partial_prod_multiplies_the_ranks_terms() -> None:
    mesh = _mesh()
    rank = dist.get_rank()
    d = DTensor.from_local(torch.full((2, 3), float(rank + 1)), mesh, [Partial("prod")])
    assert str(d.placements[0]) == "P(prod)"
    assert torch.equal(d.full_tensor(), torch.full((2, 3), 24.0))
    assert torch.equal(d.redistribute(mesh, [Shard(1)]).full_tensor(), torch.full((2, 3), 24.0))


@distributed(world_size=4)
def test_is_same_size_takes_a_plain_tensor() -> None:
    mesh = _mesh()
    d = sw.distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    assert d.is_same_size(torch.randn(8, 3))
    assert not d.is_same_size(torch.randn(2, 3))
    assert d.is_same_size(d)


@distributed(world_size=4)
def test_foreach_norm_over_dtensors_on_different_meshes() -> None:
    mesh = _mesh((2, 2))
    torch.manual_seed(0)
    a_full, b_full = torch.randn(6, 4), torch.randn(5)
    a = sw.distribute_tensor(a_full, mesh, [Shard(0), Replicate()])
    b = sw.distribute_tensor(b_full, mesh["tp"], [Shard(0)])
    norms = torch._foreach_norm([a, b])
    torch.testing.assert_close(norms[0].full_tensor(), a_full.norm())
    torch.testing.assert_close(norms[1].full_tensor(), b_full.norm())


# -- ranks outside a mesh --------------------------------------------------------------------


@distributed(world_size=4)
def test_ranks_outside_a_mesh_hold_empty_pieces_and_compute_nothing() -> None:
    sw.init_device_mesh("cpu", (4,))
    sub = sw.DeviceMesh("cpu", [0, 1])
    rank = dist.get_rank()
    inside = rank < 2
    z = sw.zeros(4, 3, device_mesh=sub, placements=[Shard(0)])
    assert z.shape == (4, 3)
    assert z.to_local().shape == ((2, 3) if inside else (0,))
    torch.manual_seed(0)
    full = torch.randn(4, 3)
    d = sw.distribute_tensor(full.clone().requires_grad_(), sub, [Shard(0)])
    e = DTensor.from_local(torch.ones(2, 3), sub, [Shard(0)], run_check=True)
    with sw.comm_log() as log:
        s = ((d + 1) * e).sum()
        d.data.mul_(1.0)  # an in-place op returns its self, untouched outside
        whole = s.full_tensor()
    s.backward()
    assert d.grad is not None and d.grad.shape == (4, 3)
    if inside:
        torch.testing.assert_close(whole, (full + 1).sum())
        assert torch.equal(d.grad.full_tensor(), torch.ones(4, 3))
    else:
        assert d.to_local().shape == (0,) and e.to_local().shape == (0,)
        assert s.to_local().shape == () and float(s.to_local()) == 0.0 and whole.shape == ()
        assert d.grad.to_local().shape == (0,)
        assert log == []


# -- bytes and memory ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_distribute_tensor_sends_each_rank_only_its_piece(shape: tuple[int, ...]) -> None:
    mesh = _mesh(shape)
    torch.manual_seed(0)
    full = torch.randn(9, 5)
    placements = [Shard(0)] if len(shape) == 1 else [Shard(0), Shard(1)]
    with sw.comm_log() as log:
        d = sw.distribute_tensor(full, mesh, placements)
    received = sum(r.bytes_received for r in log)
    assert received <= d.to_local().numel() * full.element_size(), log
    assert torch.equal(d.full_tensor(), full)


@distributed(world_size=4)
def test_inference_mode_linear_on_a_split_batch_moves_nothing() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    linear = nn.Linear(6, 3)
    x_full = torch.randn(8, 6)
    w = sw.distribute_tensor(linear.weight.detach(), mesh, [Replicate()])
    b = sw.distribute_tensor(linear.bias.detach(), mesh, [Replicate()])
    x = sw.distribute_tensor(x_full, mesh, [Shard(0)])
    with torch.inference_mode():
        with sw.comm_log() as log:
            y = torch.nn.functional.linear(x, w, b)
        assert log == []
        assert y.placements == (Shard(0),)
        torch.testing.assert_close(y.full_tensor(), linear(x_full))


@distributed(world_size=4)
def test_new_empty_strided_of_a_split_tensor_allocates_only_the_piece() -> None:
    mesh = _mesh()
    d = sw.distribute_tensor(torch.randn(16, 4), mesh, [Shard(0)])
    e = d.new_empty_strided((16, 4), (4, 1))
    assert e.shape == (16, 4) and e.placements == (Shard(0),) and e.to_local().shape == (4, 4)
    t = d.new_empty_strided((16, 4), (1, 16))  # a transposed layout: the piece is laid out alike
    assert t.stride() == (1, 16) and t.to_local().shape == (4, 4) and t.to_local().stride() == (1, 4)
    p = DTensor.from_local(torch.ones(16, 4), mesh, [Partial()])
    assert p.new_empty_strided((16, 4), (4, 1)).placements == (Partial(),)
    assert d.new_empty_strided((3, 3), (3, 1)).placements == (Replicate(),)  # another shape: no layout to follow


@pytest.mark.parametrize("replacement", [True, False])
@distributed(world_size=4)
def test_multinomial_on_split_rows_draws_locally_and_equals_the_replicated_draw(replacement: bool) -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    probs = torch.rand(10, 6)
    probs[:, 2] = 0.0  # never drawn
    split = sw.distribute_tensor(probs, mesh, [Shard(0)])
    whole = sw.distribute_tensor(probs, mesh, [Replicate()])
    sw.rand(4, device_mesh=mesh)  # the ranks' one-time check that they share the seed
    torch.manual_seed(7)
    with sw.comm_log() as log:
        drawn = torch.multinomial(split, 4, replacement=replacement)
    assert log == [] and drawn.placements == (Shard(0),) and drawn.shape == (10, 4)
    torch.manual_seed(7)
    again = torch.multinomial(whole, 4, replacement=replacement)
    full = drawn.full_tensor()
    assert torch.equal(full, again.full_tensor())  # the same global draw under any layout
    assert not (full == 2).any() and bool(((full >= 0) & (full < 6)).all())
    if not replacement:
        assert all(len(set(row)) == 4 for row in full.tolist())


@distributed(world_size=4)
def test_partial_plus_replicate_and_extremes_of_partials_stay_partial_without_collectives() -> None:
    mesh = _mesh()
    rank = dist.get_rank()
    terms = torch.arange(24.0).view(6, 4) * (rank + 1)
    r_full = torch.full((6, 4), 0.5)
    total = torch.arange(24.0).view(6, 4) * 10
    p = DTensor.from_local(terms, mesh, [Partial()])
    r = sw.distribute_tensor(r_full, mesh, [Replicate()])
    with sw.comm_log() as log:
        s = p + r
        t = r - p
    assert log == [] and s.placements == (Partial(),) and t.placements == (Partial(),)
    assert torch.equal(s.full_tensor(), total + r_full) and torch.equal(t.full_tensor(), r_full - total)
    m = DTensor.from_local(terms, mesh, [Partial("max")])
    with sw.comm_log() as log:
        shifted = m + r
        top = torch.maximum(m, m)
        capped = torch.maximum(m, r)
    assert log == [] and {x.placements for x in (shifted, top, capped)} == {(Partial("max"),)}
    biggest = torch.arange(24.0).view(6, 4) * 4
    assert torch.equal(shifted.full_tensor(), biggest + 0.5)
    assert torch.equal(top.full_tensor(), biggest) and torch.equal(capped.full_tensor(), biggest.clamp(min=0.5))


@distributed(world_size=4)
def test_views_of_parameters_inside_inference_mode_are_normal_tensors() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    w_full, x_full = torch.randn(3, 6), torch.randn(8, 6)
    w = nn.Parameter(sw.distribute_tensor(w_full, mesh, [Shard(0)]))
    x = sw.distribute_tensor(x_full, mesh, [Shard(0)])
    with torch.inference_mode():
        y = x @ w.t()  # a tied head's `hidden @ embed.weight.T`: raised "Cannot set version_counter"
        z = w.T.view(6, 3)
        assert not w.t().is_inference() and y.is_inference()
    torch.testing.assert_close(y.full_tensor(), x_full @ w_full.t())
    assert torch.equal(z.full_tensor(), w_full.T)


@distributed(world_size=4)
def test_outside_ranks_answer_equal_true_and_is_same_size_by_the_shapes() -> None:
    sw.init_device_mesh("cpu", (4,))
    sub = sw.DeviceMesh("cpu", [0, 2])
    a = sw.distribute_tensor(torch.ones(4, 2), sub, [Shard(0)])
    assert a.equal(sw.distribute_tensor(torch.ones(4, 2), sub, [Shard(0)]))
    assert a.is_same_size(torch.ones(4, 2)) and not a.is_same_size(torch.ones(2, 4))


@distributed(world_size=4)
def test_distribute_tensor_refuses_a_non_leaf_and_a_dtensor_in_another_layout() -> None:
    mesh = _mesh()
    x = torch.randn(4, 4, requires_grad=True) + 2
    with pytest.raises(ValueError, match="leaf"):
        sw.distribute_tensor(x, mesh, [Shard(0)])
    d = sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    assert sw.distribute_tensor(d, mesh, [Shard(0)]) is d
    with pytest.raises(ValueError, match="redistribute"):
        sw.distribute_tensor(d, mesh, [Replicate()])
    assert Partial("product") == Partial("prod")  # torch's spelling


@distributed(world_size=4)
def test_stack_of_a_partial_and_a_replicated_tensor_stays_partial_without_collectives() -> None:
    mesh = _mesh((2, 2))
    rank = dist.get_rank()
    p = DTensor.from_local(torch.full((3,), float(rank // 2)), mesh, [Partial(), Replicate()])  # terms 0 and 1
    q = DTensor.from_local(torch.full((3,), float(rank)), mesh, [Partial(), Partial()])
    with sw.comm_log() as log:
        s = torch.stack([p, q])
    assert log == [] and s.placements == (Partial(), Partial())
    expected = torch.stack([torch.full((3,), 1.0), torch.full((3,), 6.0)])  # 0 + 1; 0 + 1 + 2 + 3
    assert torch.equal(s.full_tensor(), expected)
