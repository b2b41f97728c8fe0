"""spmd meshes: Mesh as a value and its validation, HybridMesh device order on simulated hosts
(checked against a JAX-style np.block oracle and the one-host rule), get_1d_mesh, the global
mesh, and Mesh <-> DeviceMesh on four real processes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.spmd._mesh import HybridMesh, Mesh, get_1d_mesh, get_global_mesh, set_global_mesh
from shardwise.testing import distributed

LAUNCH_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    set_global_mesh(None)


# -- Mesh: a value ------------------------------------------------------------------------------


def test_mesh_size_shape_and_logical_mesh() -> None:
    mesh = Mesh(np.arange(8), (4, 2), ("x", "y"))
    assert mesh.size() == 8 and isinstance(mesh.size(), int)
    assert mesh.shape() == OrderedDict([("x", 4), ("y", 2)]) and list(mesh.shape()) == ["x", "y"]
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.get_axis_name_idx("y") == 1 and mesh.get_axis_name_idx("z") is None
    assert mesh.mesh_shape == (4, 2) and mesh.axis_names == ("x", "y")
    assert mesh.device_ids.tolist() == list(range(8))
    unnamed = Mesh([2, 0, 3, 1], [2, 2])
    assert unnamed.shape() == OrderedDict([(0, 2), (1, 2)]) and unnamed.axis_names is None
    assert unnamed.get_logical_mesh().tolist() == [[2, 0], [3, 1]]
    assert unnamed.get_axis_name_idx("x") is None
    assert mesh.abstract() == sw.AbstractMesh((4, 2), ("x", "y"))


def test_mesh_is_an_immutable_hashable_value() -> None:
    a = Mesh(range(4), (2, 2), ("dp", "tp"))
    b = Mesh(np.array([0, 1, 2, 3]), [2, 2], ["dp", "tp"])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Mesh([1, 0, 2, 3], (2, 2), ("dp", "tp")) and a != Mesh(range(4), (2, 2)) and a != Mesh(range(4), (4,))
    assert eval(repr(a)) == a and repr(a) == "Mesh([0, 1, 2, 3], (2, 2), ('dp', 'tp'))"
    with pytest.raises(AttributeError, match="immutable"):
        a.mesh_shape = (4,)  # type: ignore[misc]
    with pytest.raises(ValueError):
        a.device_ids[0] = 3  # read-only
    grid = a.get_logical_mesh()
    grid[0, 0] = 9
    assert a.get_logical_mesh()[0, 0] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ((range(4), (2, 2), ("x",)), r"axis_names \('x',\) has 1 names for the 2-D mesh_shape \(2, 2\)"),
        ((range(4), (2, 2), ("x", "x")), r"axis_names \('x', 'x'\) repeats \['x'\]"),
        ((range(6), (2, 2)), r"mesh_shape \(2, 2\) holds 4 devices but device_ids \[0, 1, 2, 3, 4, 5\] has 6"),
        (([0, 1, 1, 2], (2, 2)), r"device_ids \[0, 1, 1, 2\] repeats \[1\]"),
        (([0, 1, 2, 4], (2, 2)), r"device_ids \[0, 1, 2, 4\] has ids \[4\] outside \[0, 4\)"),
        (([0, 1, 2, -1], (4,)), r"has ids \[-1\] outside \[0, 4\)"),
        (([0, 1], (2, 0)), r"mesh_shape \(2, 0\) must have at least one axis, every size >= 1"),
    ],
)
def test_each_mesh_rule_raises_a_value_error_naming_the_values(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mesh(*args)  # type: ignore[arg-type]


def test_mesh_problems_are_collected_and_raised_once() -> None:
    with pytest.raises(ValueError) as err:
        Mesh([0, 0, 5], (2, 2), ("a", "a", "b"))
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid Mesh:" and len(lines) == 6  # names count, duplicate names, size, duplicate ids, range


def test_mesh_argument_kinds_raise_type_errors() -> None:
    with pytest.raises(TypeError, match="device_ids must be a flat list of int device ids"):
        Mesh(np.arange(4).reshape(2, 2), (2, 2))
    with pytest.raises(TypeError, match="device_ids must be a flat list"):
        Mesh([0.0, 1.0], (2,))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="mesh_shape must be a tuple of ints"):
        Mesh(range(4), 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"axis_names must be a tuple of str .* got 'x': write e.g. \('x',\)"):
        Mesh(range(4), (4,), "x")


# -- HybridMesh ----------------------------------------------------------------------------------


def block_oracle(ici: Sequence[int], dcn: Sequence[int], local: int) -> np.ndarray:
    """JAX's create_hybrid_device_mesh on hosts of `local` ranks: one ici block per host, np.block-tiled."""
    n_hosts = int(np.prod(dcn))
    blocks = [np.arange(h * local, (h + 1) * local).reshape(ici) for h in range(n_hosts)]
    nested = np.empty(n_hosts, dtype=object)
    nested[:] = blocks
    return np.block(nested.reshape(dcn).tolist())


HYBRID_CASES = [
    # (hosts, ranks per host, ici, dcn)
    (2, 2, (1, 2), (2, 1)),
    (2, 2, (2, 1), (1, 2)),
    (2, 2, (2,), (2,)),
    (4, 2, (1, 2), (4, 1)),
    (4, 2, (2, 1), (2, 2)),
    (4, 2, (1, 2), (2, 2)),
    (4, 2, (1, 2, 1), (2, 1, 2)),
    (4, 2, (2, 1, 1), (1, 2, 2)),
    (1, 4, (2, 2), (1, 1)),
]


@pytest.mark.parametrize("hosts, local, ici, dcn", HYBRID_CASES)
def test_hybrid_mesh_tiles_one_ici_block_per_host(hosts: int, local: int, ici: tuple[int, ...], dcn: tuple[int, ...]) -> None:
    mesh = HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, hosts=hosts, local_world_size=local)
    grid = mesh.get_logical_mesh()
    assert mesh.mesh_shape == tuple(i * d for i, d in zip(ici, dcn))
    assert np.array_equal(grid, block_oracle(ici, dcn, local))
    assert (mesh.ici_mesh_shape, mesh.dcn_mesh_shape, mesh.hosts, mesh.local_world_size) == (ici, dcn, hosts, local)
    # every group along an ici-only axis (dcn size 1) lives inside one host
    for axis, d in enumerate(dcn):
        if d != 1:
            continue
        groups = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
        assert all(len({int(r) // local for r in g}) == 1 for g in groups), (axis, grid.tolist())
    # and each ici block is exactly one host's ranks
    for start in np.ndindex(*dcn):
        block = grid[tuple(slice(s * i, (s + 1) * i) for s, i in zip(start, ici))]
        assert len({int(r) // local for r in block.flat}) == 1


def test_hybrid_mesh_examples_and_value() -> None:
    m = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("dp", "tp"), hosts=2, local_world_size=2)
    assert m.get_logical_mesh().tolist() == [[0, 1], [2, 3]] and m.shape() == OrderedDict([("dp", 2), ("tp", 2)])
    assert m == Mesh(range(4), (2, 2), ("dp", "tp")) and eval(repr(m)) == m and isinstance(eval(repr(m)), HybridMesh)
    m2 = HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(1, 2), hosts=2, local_world_size=2)
    assert m2.get_logical_mesh().tolist() == [[0, 2], [1, 3]]
    with pytest.raises(TypeError):
        HybridMesh((1, 2), (2, 1))  # type: ignore[misc]  # keyword-only, like torch_xla


def test_hybrid_mesh_validation_names_the_numbers() -> None:
    with pytest.raises(ValueError) as err:
        HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1), hosts=3, local_world_size=2)
    msg = str(err.value)
    assert "ici_mesh_shape (2, 2) holds 4 ranks but each host runs 2" in msg
    assert "dcn_mesh_shape (2, 1) spans 2 host(s) but there are 3" in msg
    with pytest.raises(ValueError, match=r"give dcn_mesh_shape for a multi-host mesh"):
        HybridMesh(ici_mesh_shape=(2,), hosts=2, local_world_size=2)
    with pytest.raises(ValueError, match=r"ici_mesh_shape \(2,\) and dcn_mesh_shape \(1, 2\) have different ranks"):
        HybridMesh(ici_mesh_shape=(2,), dcn_mesh_shape=(1, 2))
    with pytest.raises(ValueError, match="local_world_size must be a positive int, got 0"):
        HybridMesh(ici_mesh_shape=(2,), local_world_size=0)
    with pytest.raises(ValueError, match=r"ici_mesh_shape must be a non-empty tuple of positive ints, got \(0, 2\)"):
        HybridMesh(ici_mesh_shape=(0, 2))


def test_hybrid_mesh_reads_the_host_layout_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    mesh = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(4, 1))
    assert (mesh.hosts, mesh.local_world_size) == (4, 2)
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"dcn_mesh_shape \(2, 1\) spans 2 host\(s\) but there are 4"):
        HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1))
    with pytest.raises(ValueError, match=r"ici_mesh_shape \(1, 4\) holds 4 ranks but each host runs 2"):
        HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(4, 1))
    # the launcher's rank order must be host-major, as the layout assumes
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GROUP_RANK", "1")
    HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(4, 1))
    monkeypatch.setenv("GROUP_RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=3, LOCAL_RANK=1 on host 2 with 2 ranks per host"):
        HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(4, 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="every host must run the same number of ranks"):
        HybridMesh(ici_mesh_shape=(3,), dcn_mesh_shape=(2,))


def test_hybrid_mesh_with_no_processes_takes_the_layout_from_the_shapes() -> None:
    if dist.is_initialized():
        pytest.skip("this process runs a process group: the layout comes from it")
    mesh = HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(1, 2))
    assert (mesh.hosts, mesh.local_world_size) == (2, 2)
    assert mesh.get_logical_mesh().tolist() == [[0, 2], [1, 3]]


# -- get_1d_mesh, the global mesh -----------------------------------------------------------------


def test_get_1d_mesh_spans_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    n = dist.get_world_size() if dist.is_initialized() else 4
    assert get_1d_mesh() == Mesh(range(n), (n,))
    named = get_1d_mesh("data")
    assert named.mesh_shape == (n,) and named.axis_names == ("data",) and named.device_ids.tolist() == list(range(n))


def test_global_mesh_is_set_got_and_unset() -> None:
    assert get_global_mesh() is None
    mesh = Mesh(range(4), (2, 2), ("dp", "tp"))
    set_global_mesh(mesh)
    assert get_global_mesh() is mesh
    set_global_mesh(None)
    assert get_global_mesh() is None
    with pytest.raises(TypeError, match=r"convert a DeviceMesh with Mesh.from_device_mesh"):
        set_global_mesh((2, 2))  # type: ignore[arg-type]


# -- Mesh <-> DeviceMesh on four processes ----------------------------------------------------------


@distributed(world_size=4)
def test_to_device_mesh_and_back_on_four_ranks() -> None:
    rank = dist.get_rank()
    mesh = Mesh(range(4), (2, 2), ("dp", "tp"))
    dm = mesh.to_device_mesh()
    assert isinstance(dm, sw.DeviceMesh) and dm.device_type == "cpu"
    assert dm.mesh.tolist() == [[0, 1], [2, 3]] and dm.mesh_dim_names == ("dp", "tp")
    assert dm.get_coordinate() == [rank // 2, rank % 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=dm.get_group("tp"))
    assert t.item() == sum(dm.ranks_along("tp")) == 2 * (rank // 2) * 2 + 1
    # cached per (mesh, device type): an equal mesh gets the same DeviceMesh, no new groups
    made: list[object] = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: made.append(a) or real(*a, **k)  # type: ignore[assignment]
    try:
        assert Mesh([0, 1, 2, 3], [2, 2], ["dp", "tp"]).to_device_mesh() is dm
    finally:
        dist.new_group = real  # type: ignore[assignment]
    assert made == []
    # a custom device order is the rank grid
    flipped = Mesh([3, 1, 2, 0], (2, 2)).to_device_mesh()
    assert flipped.mesh.tolist() == [[3, 1], [2, 0]] and flipped.mesh_dim_names is None
    assert flipped.get_coordinate() == {3: [0, 0], 1: [0, 1], 2: [1, 0], 0: [1, 1]}[rank]
    # back: a DeviceMesh over every rank is a Mesh, and that Mesh gives the same DeviceMesh
    assert Mesh.from_device_mesh(dm) == mesh
    other = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("d",))
    assert Mesh.from_device_mesh(other) == Mesh(range(4), (4,), ("d",))
    assert Mesh.from_device_mesh(other).to_device_mesh() is other
    # a HybridMesh over a launch with no host information: one host of four ranks
    assert HybridMesh(ici_mesh_shape=(2, 2), axis_names=("a", "b")).to_device_mesh().mesh.tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"dcn_mesh_shape \(2, 1\) spans 2 host\(s\) but there are 1"):
        HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1))
    with pytest.raises(ValueError, match="has 2 devices but the world has 4 processes"):
        Mesh(range(2), (2,)).to_device_mesh()
    with pytest.raises(ValueError, match=r"holds ranks \[\d, \d\], 2 of the world's 4 processes: a Mesh spans every process"):
        Mesh.from_device_mesh(dm["tp"])
