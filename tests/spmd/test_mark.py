"""`spmd.mark_sharding` and kin on real ranks, against the single-device tensors.

For every partition spec tried (names, indices, multi-axis tuples in both orders, even and
uneven shapes, meshes (4,) and (2, 2)): the marked tensor's full value is the input, each
rank's piece is the slice the layout math gives and the slice the naive chunk oracle gives,
and `DTensor.partition_spec` gives the spec back. Parameters are sharded in place (the
module keeps the same object); a module marked from a dict trains 5 steps with SGD and
AdamW to the same losses as single-process training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise._layout import local_shape_and_offset
from shardwise._partition_spec import to_placements
from shardwise.spmd._mark import clear_sharding, mark_sharding, mark_sharding_module, mark_sharding_with_gradients
from shardwise.spmd._mesh import Mesh
from shardwise.spmd._sharding_spec import ShardingSpec
from shardwise.testing import distributed

from ..dist_helpers import seeded
from ..oracle import local_piece

NAMES = {(4,): ("x",), (2, 2): ("x", "y")}

# (tensor shape, partition spec) per mesh; shapes with 5 and 3 rows split unevenly over 4 and 2 ranks
SPECS: dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[Any, ...]]]] = {
    (4,): [
        ((8, 4), ("x", None)),
        ((5, 3), ("x", None)),
        ((5, 3), (None, "x")),  # 3 columns over 4 ranks: the last piece is empty
        ((5, 3), (0, None)),
        ((5, 3), (("x",), None)),
        ((5, 3), (None, None)),
        ((2, 5, 3), (None, "x", None)),
    ],
    (2, 2): [
        ((8, 4), ("x", "y")),
        ((5, 3), ("y", "x")),
        ((8, 4), (("x", "y"), None)),
        ((5, 3), (("x", "y"), None)),
        ((5, 3), (("y", "x"), None)),
        ((5, 3), (None, ("y", "x"))),
        ((5, 3), ((0, 1), None)),
        ((5, 3), (None, 1)),
        ((5, 3), ("x", None)),
        ((2, 5, 3), (None, "x", "y")),
        ((2, 5, 3), (("y", "x"), None, None)),
    ],
}


def _canonical(spec: Sequence[Any], names: Sequence[str]) -> tuple[Any, ...]:
    """The spec as DTensor.partition_spec writes it: axis names, a one-axis tuple unwrapped."""
    out: list[Any] = []
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        named = tuple(names[a] if isinstance(a, int) else a for a in axes)
        out.append(None if not named else named[0] if len(named) == 1 else named)
    return tuple(out)


def _check_layout(d: DTensor, full: torch.Tensor, spec: Sequence[Any], mesh: sw.DeviceMesh, what: str) -> None:
    names = mesh.mesh_dim_names
    assert names is not None
    assert isinstance(d, DTensor), what
    assert torch.equal(d.full_tensor(), full), f"{what}: full_tensor() is not the input"
    placements, order = to_placements(spec, mesh.shape, names, full.ndim)
    assert d.placements == placements, f"{what}: placements {d.placements} != {placements}"
    coord = mesh.get_coordinate()
    assert coord is not None
    shape, offset = local_shape_and_offset(full.shape, mesh.shape, placements, coord, order)
    by_math = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    by_oracle = local_piece(full, mesh.shape, placements, coord, dict(order))
    local = d.to_local()
    assert torch.equal(local, by_math), f"{what}: piece {tuple(local.shape)} is not the layout-math slice {shape}@{offset}"
    assert torch.equal(local, by_oracle), f"{what}: piece is not the torch.chunk oracle's"
    assert d.partition_spec == _canonical(spec, names), f"{what}: partition_spec {d.partition_spec}"


@pytest.mark.parametrize("mesh_shape", list(SPECS), ids=str)
@distributed(world_size=4)
def test_mark_sharding_pieces_full_value_and_partition_spec_round_trip(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=NAMES[mesh_shape])
    previous: dict[tuple[int, ...], DTensor] = {}
    for k, (shape, spec) in enumerate(SPECS[mesh_shape]):
        full = seeded(*shape, seed=k)
        _check_layout(mark_sharding(full, mesh, spec), full, spec, mesh, f"plain {shape} {spec}")
        # a DTensor is re-laid out from whatever layout it had (the previous spec of this shape)
        source = previous.get(shape)
        if source is not None:
            prev_full = source.full_tensor()
            _check_layout(mark_sharding(source, mesh, spec), prev_full, spec, mesh, f"re-mark {shape} {spec}")
        previous[shape] = mark_sharding(full, mesh, spec)


@distributed(world_size=4)
def test_mark_sharding_errors_name_the_spec_and_the_rule() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    t = seeded(4, 4)
    with pytest.raises(ValueError, match=r"mark_sharding: partition spec \('x',\) has 1 entries for a 2-D tensor"):
        mark_sharding(t, mesh, ("x",))
    with pytest.raises(ValueError, match=r"names mesh dim 'z', which does not exist: the mesh's dims are \('x', 'y'\)"):
        mark_sharding(t, mesh, ("z", None))
    with pytest.raises(ValueError, match=r"uses mesh dim 'x' for tensor dims 0 and 1"):
        mark_sharding(t, mesh, ("x", "x"))
    with pytest.raises(TypeError, match="mesh must be a shardwise DeviceMesh or a shardwise.spmd Mesh, got .* \\(str\\)"):
        mark_sharding(t, "mesh", ("x", None))
    partial = DTensor.from_local(torch.ones(4, 4), mesh, [Partial(), Replicate()])
    with pytest.raises(ValueError, match=r"pending reduction P\(sum\) on mesh dim 0"):
        partial.partition_spec


@distributed(world_size=4)
def test_mark_sharding_accepts_an_spmd_mesh() -> None:
    mesh = Mesh([0, 1, 2, 3], (2, 2), ("x", "y"))
    full = seeded(5, 3)
    d = mark_sharding(full, mesh, (("y", "x"), None))
    _check_layout(d, full, (("y", "x"), None), mesh.to_device_mesh(), "spmd Mesh")


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@distributed(world_size=4)
def test_mark_sharding_changes_a_parameter_in_place_and_clear_sharding_undoes_it() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    torch.manual_seed(0)
    model = _MLP()
    w = model.fc1.weight
    w.note = "kept"  # type: ignore[attr-defined]  # a user attribute survives the swap
    before = w.detach().clone()
    out = mark_sharding(model.fc1.weight, mesh, (None, "model"))
    assert out is w and model.fc1.weight is w and dict(model.named_parameters())["fc1.weight"] is w
    assert isinstance(w, DTensor) and isinstance(w, nn.Parameter) and w.requires_grad
    assert w.note == "kept"  # type: ignore[attr-defined]
    assert w.partition_spec == (None, "model") and torch.equal(w.full_tensor(), before)
    # re-marking a DTensor parameter re-lays it out, still in place
    assert mark_sharding(w, mesh, ("data", None)) is w and w.partition_spec == ("data", None)
    assert torch.equal(w.full_tensor(), before)
    # requires_grad=False is kept
    b = model.fc1.bias
    b.requires_grad_(False)
    assert mark_sharding(b, mesh, ("model",)) is b and isinstance(b, DTensor) and not b.requires_grad
    # clear_sharding: the same object, plain again
    assert clear_sharding(w) is w and model.fc1.weight is w
    assert not isinstance(w, DTensor) and isinstance(w, nn.Parameter) and w.requires_grad
    assert torch.equal(w.detach(), before)
    # clear_sharding on a non-parameter DTensor gives the full tensor; a plain tensor is returned as is
    t = seeded(5, 3)
    assert torch.equal(clear_sharding(mark_sharding(t, mesh, ("data", "model"))), t)
    assert clear_sharding(t) is t


@distributed(world_size=4)
def test_mark_sharding_module_checks_every_name_before_changing_anything() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    model = _MLP()
    bad = {"fc1.weight": (None, "model"), "fc3.weight": (None, None), "fc2.weight": ("model",), "nope": (None,)}
    with pytest.raises(ValueError) as info:
        mark_sharding_module(model, mesh, bad)
    msg = str(info.value)
    assert "2 problems (nothing was changed)" in msg, msg
    assert "no parameter named 'fc3.weight', 'nope'" in msg and "fc1.weight, fc1.bias, fc2.weight, fc2.bias" in msg, msg
    assert "partition_specs['fc2.weight']: partition spec ('model',) has 1 entries for a 2-D tensor" in msg, msg
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    specs = {"fc1.weight": (None, "model"), "fc1.bias": (None,), "fc2.weight": ("data", None), "fc2.bias": ("data",)}
    assert mark_sharding_module(model, mesh, specs) is model
    assert {n: p.partition_spec for n, p in model.named_parameters()} == specs


@pytest.mark.parametrize("mesh_shape", list(SPECS), ids=str)
@distributed(world_size=4)
def test_mark_sharding_with_gradients_gives_the_gradient_the_marked_layout(mesh_shape: tuple[int, ...]) -> None:
    names = NAMES[mesh_shape]
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    last = names[-1]
    for shape in [(8, 4), (5, 3)]:
        full, weight = seeded(*shape, seed=1), seeded(*shape, seed=2)

        def loss_of(t: torch.Tensor) -> torch.Tensor:
            return (t * t * weight).sum()

        ref = full.clone().requires_grad_(True)
        loss_of(ref).backward()
        # a DTensor input split on dim 0 is re-marked split on dim 1: forward and gradient in that layout
        x = sw.distribute_tensor(full.clone(), mesh, [Shard(0)] * len(mesh_shape)).requires_grad_(True)
        y = mark_sharding_with_gradients(x, mesh, (None, last))
        assert y.partition_spec == (None, last)
        loss_of(y.full_tensor()).backward()
        assert isinstance(x.grad, DTensor) and x.grad.partition_spec == (None, last), x.grad
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad)
        # a plain input (the same on every rank) gets its whole gradient back
        p = full.clone().requires_grad_(True)
        z = mark_sharding_with_gradients(p, mesh, (names, None) if len(names) > 1 else (last, None))
        loss_of(z.full_tensor()).backward()
        assert not isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad, ref.grad)


# -- training -----------------------------------------------------------------------

def _train(model: nn.Module, opt_name: str, x: torch.Tensor, target: torch.Tensor, steps: int) -> list[float]:
    opt: torch.optim.Optimizer
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
    return losses


MODELS: dict[str, tuple[Any, dict[str, tuple[Any, ...]]]] = {
    "linear": (lambda: nn.Linear(6, 4), {"weight": (None, "model"), "bias": (None,)}),
    "mlp": (_MLP, {"fc1.weight": (None, "model"), "fc1.bias": (None,), "fc2.weight": ("data", None), "fc2.bias": (None,)}),
}


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@distributed(world_size=4)
def test_marked_models_train_to_single_process_losses(opt_name: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    for name, (make, specs) in MODELS.items():
        torch.manual_seed(0)
        reference = make()
        torch.manual_seed(0)
        model = make()
        x, target = seeded(7, 6, seed=3), seeded(7, 4, seed=4)  # 7 rows over 2 data ranks: uneven
        want = _train(reference, opt_name, x, target, steps=5)
        mark_sharding_module(model, mesh, specs)
        got = _train(model, opt_name, mark_sharding(x, mesh, ("data", None)), mark_sharding(target, mesh, ("data", None)), 5)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, f"{name}/{opt_name}: losses {got} != {want}"
        for (pname, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert isinstance(p, DTensor) and p.partition_spec == specs[pname]
            torch.testing.assert_close(p.full_tensor(), q.detach(), atol=1e-5, rtol=1e-5, msg=f"{name}/{opt_name} {pname}")


# -- ShardingSpec (the other helper's module) -----------------------------------------

def _tile_index(tile: Any, device: int) -> Optional[tuple[int, ...]]:
    import numpy as np

    where = np.argwhere(np.asarray(tile) == device)
    return None if len(where) == 0 else tuple(int(i) for i in where[0])


@distributed(world_size=4)
def test_sharding_spec_tile_assignment_agrees_with_the_pieces() -> None:
    """The tile assignment (device ids; leading axes = the split tensor dims in spec order,
    trailing = mesh axes the spec leaves out) puts each rank's piece where mark_sharding does.
    Even shapes only: for uneven sizes a tile assignment (one split of the dim into
    prod(sizes) tiles) and the nested torch.chunk layout (split by the first axis, then each
    piece by the next) differ, e.g. 5 rows over (2, 2): tiles 2,2,1,0 against pieces 2,1,1,1."""
    mesh = Mesh([0, 1, 2, 3], (2, 2), ("x", "y"))
    dm = mesh.to_device_mesh()
    rank = torch.distributed.get_rank()
    for shape, spec in [((8, 4), ("x", "y")), ((8, 4), ("y", "x")), ((8, 4), (("y", "x"), None)), ((8, 4), (None, "y"))]:
        full = seeded(*shape)
        tile = ShardingSpec(mesh, spec).tile_assignment
        index = _tile_index(tile, rank)
        assert index is not None, f"rank {rank} not in tile assignment {tile}"
        piece = full
        tiled = [d for d, entry in enumerate(spec) if entry is not None]
        tile_shape = torch.tensor(tile).shape
        for axis, d in enumerate(tiled):
            piece = torch.chunk(piece, tile_shape[axis], dim=d)[index[axis]]
        assert torch.equal(mark_sharding(full, dm, spec).to_local(), piece), f"{spec}: tile {index} of {tile}"


@distributed(world_size=4)
def test_mark_sharding_of_an_activation_keeps_its_graph() -> None:
    mesh = Mesh([0, 1, 2, 3], (2, 2), ("x", "y"))
    w = torch.arange(12.0).view(4, 3).requires_grad_()
    h = w * 2  # an activation: distribute_tensor refuses it, mark_sharding keeps its graph
    d = mark_sharding(h, mesh, ("x", None))
    assert d.placements == (Shard(0), Replicate())
    d.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.full((4, 3), 2.0))
