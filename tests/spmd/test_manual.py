"""Manual sharding and `shard_map` on real ranks, against a reference that loops over mesh coordinates.

The reference (`_reference`) runs the function once per mesh coordinate on plain tensors:
each input sliced as its in_spec says (by the torch.chunk oracle), the outputs assembled as
the out_specs say (replicated mesh dims read at index 0). Outputs and the gradients of every
input must match it, on meshes (4,) and (2, 2), even and uneven shapes, for functions that
mix split and replicated inputs, return concatenated and replicated outputs, and combine
pieces across ranks (partial sums returned and reduced outside, or `psum` inside).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Shard
from shardwise._partition_spec import to_placements
from shardwise.spmd._manual import disable_manual_sharding, enable_manual_sharding, psum, shard_map
from shardwise.spmd._mesh import Mesh, set_global_mesh
from shardwise.testing import distributed

from ..dist_helpers import seeded
from ..oracle import assemble, coordinates, local_piece

NAMES = {(4,): ("x",), (2, 2): ("x", "y")}
TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}


def _layout(spec: Sequence[Any], mesh_shape: Sequence[int], names: Sequence[str], ndim: int) -> Any:
    placements, order = to_placements(spec, mesh_shape, names, ndim, exact_length=False)
    return placements, dict(order)


def _reference(fn: Callable[..., Any], mesh_shape: tuple[int, ...], in_specs: Sequence[Any], out_specs: Sequence[Any],
               args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """fn per mesh coordinate on plain slices; outputs assembled (a tuple of out_specs: one per output)."""
    names = NAMES[mesh_shape]
    results = {}
    for c in coordinates(mesh_shape):
        pieces = []
        for a, s in zip(args, in_specs):
            placements, order = _layout(s, mesh_shape, names, a.ndim)
            pieces.append(local_piece(a, mesh_shape, placements, c, order))
        out = fn(*pieces)
        results[c] = out if isinstance(out, tuple) else (out,)
    assembled = []
    for i, spec in enumerate(out_specs):
        ndim = results[(0,) * len(mesh_shape)][i].ndim
        placements, order = _layout(spec, mesh_shape, names, ndim)
        assembled.append(assemble({c: r[i] for c, r in results.items()}, mesh_shape, placements, order))
    return assembled


def _loss(outs: Sequence[torch.Tensor]) -> torch.Tensor:
    # fixed weights so that every output element gets its own gradient
    return sum((o * seeded(*o.shape, seed=99 + i)).sum() for i, o in enumerate(outs))  # type: ignore[return-value]


def _check(fn: Callable[..., Any], mesh: sw.DeviceMesh, in_specs: tuple[Any, ...], out_specs: tuple[Any, ...],
           fulls: Sequence[torch.Tensor], as_dtensor: Sequence[bool], what: str,
           reference: Callable[..., list[torch.Tensor]] | None = None, after: Callable[[Any], Any] = lambda o: o) -> None:
    """shard_map(fn) vs the reference loop (or `reference(*inputs)`): outputs and input gradients."""
    mesh_shape = tuple(mesh.shape)
    refs = [t.clone().requires_grad_(True) for t in fulls]
    want = reference(*refs) if reference is not None else _reference(fn, mesh_shape, in_specs, out_specs, refs)
    want = [after(w) for w in want]
    _loss(want).backward()
    inputs = [sw.distribute_tensor(t.clone(), mesh, [Shard(0)] * mesh.ndim).requires_grad_(True) if dt
              else t.clone().requires_grad_(True) for t, dt in zip(fulls, as_dtensor)]
    # out_specs here: one spec per output; a function with one output takes that spec itself
    outs = shard_map(fn, mesh, in_specs, out_specs if len(out_specs) > 1 else out_specs[0])(*inputs)
    outs = [outs] if not isinstance(outs, tuple) else list(outs)
    for i, o in enumerate(outs):
        assert isinstance(o, DTensor), f"{what}: output {i} is a {type(o).__name__}"
        assert o.partition_spec == _named(out_specs[i], mesh.mesh_dim_names, o.ndim), f"{what}: {o.partition_spec}"
    got = [after(o) for o in outs]
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.full_tensor(), w, **TOL, msg=lambda m: f"{what}: output {i}\n{m}")
    _loss([g.full_tensor() for g in got]).backward()
    for k, (x, r) in enumerate(zip(inputs, refs)):
        grad = x.grad.full_tensor() if isinstance(x.grad, DTensor) else x.grad
        assert isinstance(x.grad, DTensor) == as_dtensor[k], f"{what}: grad {k} kind"
        torch.testing.assert_close(grad, r.grad, **TOL, msg=lambda m: f"{what}: grad of input {k}\n{m}")


def _named(spec: Sequence[Any], names: Any, ndim: int) -> tuple[Any, ...]:
    out: list[Any] = list(spec) + [None] * (ndim - len(spec))
    return tuple(names[e] if isinstance(e, int) else e for e in out)


# -- the functions (module level: they run on every rank) ------------------------------

def _rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * x.sum(1, keepdim=True)  # (rows, out): row-local, w replicated


def _partial_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w)[None]  # (1, rows, out): this rank's partial sum of the contraction


def _psum_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(psum(x @ w, "x"))  # (rows, out), the same on every rank


def _two_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, (w * w).sum(0, keepdim=True)  # split rows; replicated w reduced to one row


@pytest.mark.parametrize("mesh_shape", list(NAMES), ids=str)
@distributed(world_size=4)
def test_shard_map_matches_the_coordinate_loop(mesh_shape: tuple[int, ...]) -> None:
    names = NAMES[mesh_shape]
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    a = names[0]
    rows: tuple[Any, ...] = (names, None) if len(names) > 1 else (a, None)
    for n_rows, n_in in [(8, 4), (7, 5)]:  # even, then uneven (7 rows and 5 features over 4 or 2 ranks)
        x, w = seeded(n_rows, n_in, seed=1), seeded(n_in, 3, seed=2)
        for as_dt in [(False, False), (True, True)]:
            tag = f"{mesh_shape} {(n_rows, n_in)} dtensor={as_dt}"
            # split rows with a replicated weight (its gradient sums the rows' contributions)
            _check(_rows, mesh, (rows, (None, None)), (rows,), [x, w], as_dt, f"rows {tag}")
            # one output split, one promised equal on every rank
            _check(_two_outputs, mesh, (rows, ()), (rows, (None, None)), [x, w], as_dt, f"two outputs {tag}")
            # split contraction: partial sums returned under a named axis and reduced outside
            _check(_partial_products, mesh, ((None, a), (a, None)), ((a, None, None),), [x, w], as_dt,
                   f"partial sums {tag}", after=lambda o: o.sum(0))
            # split contraction reduced inside with psum: the reference is the single-device product
            _check(_psum_products, mesh, ((None, a), (a, None)), ((None, None),), [x, w], as_dt, f"psum {tag}",
                   reference=lambda x_, w_: [torch.sin(x_ @ w_)])
        if len(names) > 1:  # the other split order of rows over both mesh dims
            _check(_rows, mesh, ((names[::-1], None), (None, None)), ((names[::-1], None),), [x, w], (True, False),
                   f"rows y-major {(n_rows, n_in)}")


def _pytree_fn(batch: dict[str, Any], scale: float) -> dict[str, Any]:
    return {"y": batch["x"] * scale + batch["b"], "n": batch["n"]}


@distributed(world_size=4)
def test_shard_map_takes_pytrees_and_works_as_a_decorator() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    x, b = seeded(6, 3, seed=1), seeded(3, seed=2)

    @shard_map(mesh=mesh, in_specs=({"x": ("x", "y"), "b": ("y",), "n": None}, None), out_specs={"y": ("x", "y"), "n": None})
    def fn(batch: dict[str, Any], scale: float) -> dict[str, Any]:
        return _pytree_fn(batch, scale)

    out = fn({"x": x, "b": b, "n": "label"}, 3.0)
    assert out["n"] == "label" and isinstance(out["y"], DTensor)
    torch.testing.assert_close(out["y"].full_tensor(), x * 3.0 + b)
    assert fn.__name__ == "fn"


@distributed(world_size=4)
def test_shard_map_errors_name_the_spec_path() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    x = seeded(4, 4)
    with pytest.raises(ValueError, match=r"in_specs does not match the structure of the arguments .* in_specs=\(spec,\)"):
        shard_map(lambda t: t, mesh, ("x", None), ("x", None))(x)
    with pytest.raises(ValueError, match=r"- in_specs\[0\] is None for a tensor of shape \(4, 4\)"):
        shard_map(lambda t: t, mesh, (None,), ("x", None))(x)
    with pytest.raises(ValueError, match=r"in_specs\[1\]\['k'\] is \('x',\), but there is a int there"):
        shard_map(lambda t, d: t, mesh, ((), {"k": ("x",)}), ())(x, {"k": 3})
    with pytest.raises(ValueError, match=r"in_specs\[0\]: partition spec \('x', 'y', None\) has 3 entries for a 2-D tensor"):
        shard_map(lambda t: t, mesh, (("x", "y", None),), ())(x)
    with pytest.raises(ValueError, match=r"out_specs: the function returned a DTensor"):
        shard_map(lambda t: sw.distribute_tensor(t, mesh), mesh, ((),), ())(x)
    with pytest.raises(TypeError, match="shard_map needs in_specs="):
        shard_map(lambda t: t, mesh)


@pytest.mark.parametrize("mesh_shape", list(NAMES), ids=str)
@distributed(world_size=4)
def test_enable_and_disable_manual_sharding_round_trip_with_gradients(mesh_shape: tuple[int, ...]) -> None:
    names = NAMES[mesh_shape]
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    coord = mesh.get_coordinate()
    assert coord is not None
    specs: list[tuple[Any, ...]] = [(names[0], None), (None, names[-1])]
    if len(names) > 1:
        specs += [((names[1], names[0]), None), (names[1], names[0])]
    for shape in [(8, 4), (7, 3)]:
        full = seeded(*shape, seed=5)
        for spec in specs:
            for as_dtensor in (False, True):
                ref = full.clone().requires_grad_(True)
                _loss([torch.cos(ref)]).backward()
                t = sw.distribute_tensor(full.clone(), mesh, [Shard(1)] * mesh.ndim) if as_dtensor else full.clone()
                t.requires_grad_(True)
                local = enable_manual_sharding(t, spec, mesh=mesh)
                assert not isinstance(local, DTensor)
                placements, order = _layout(spec, mesh_shape, names, 2)
                assert torch.equal(local.detach(), local_piece(full, mesh_shape, placements, coord, order)), spec
                back = disable_manual_sharding(torch.cos(local), spec, shape, mesh=mesh)
                torch.testing.assert_close(back.full_tensor(), torch.cos(full))
                _loss([back.full_tensor()]).backward()
                grad = t.grad.full_tensor() if isinstance(t.grad, DTensor) else t.grad
                torch.testing.assert_close(grad, ref.grad, msg=lambda m: f"{spec} dtensor={as_dtensor}\n{m}")
    wrong = torch.zeros(9, 9)
    with pytest.raises(ValueError, match=r"has shape \(9, 9\), but full_shape \(8, 4\) laid out by"):
        disable_manual_sharding(wrong, specs[0], (8, 4), mesh=mesh)


@distributed(world_size=4)
def test_manual_sharding_uses_the_global_mesh_or_says_how_to_set_one() -> None:
    set_global_mesh(None)
    x = seeded(8, 4)
    with pytest.raises(ValueError, match=r"no mesh given and no global mesh set: pass mesh=, or call .*set_global_mesh"):
        enable_manual_sharding(x, ("x", None))
    set_global_mesh(Mesh([0, 1, 2, 3], (2, 2), ("x", "y")))
    try:
        local = enable_manual_sharding(x, ("x", "y"))
        assert tuple(local.shape) == (4, 2)
        back = disable_manual_sharding(local * 2, ("x", "y"), (8, 4))
        torch.testing.assert_close(back.full_tensor(), x * 2)
        out = shard_map(_rows, in_specs=(("x", None), ()), out_specs=("x", None))(x, seeded(4, 3))
        torch.testing.assert_close(out.full_tensor(), _rows(x, seeded(4, 3)))
    finally:
        set_global_mesh(None)
