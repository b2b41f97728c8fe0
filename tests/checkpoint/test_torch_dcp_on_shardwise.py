"""torch's own `torch.distributed.checkpoint` (DCP) on shardwise DTensors: exact, or refused at once.

DCP knows torch's DTensor only; it took a shardwise DTensor for a whole tensor of its global
shape, so `dcp.save` wrote one rank's piece labelled as the whole tensor, `dcp.load` gave
wrong weights, a one-process read of such a checkpoint failed and a 2-rank load hung. A
DTensor now answers DCP's tensor-subclass hooks (`shardwise._tensor._dcp`).

A model with every kind of piece (colwise and rowwise splits of uneven sizes, a fused
projection whose piece is two boxes of the weight (`_StridedShard`), an FSDP unit whose
last rank holds empty pieces, replicated biases) and a dict of DTensors in other layouts
(split orders, a `_StridedShard` on a 2-D mesh, a scalar, a tensor with no elements, int64
and bfloat16) are saved by torch's `dcp.save` / `dcp.async_save` on mesh (4,) or (2, 2) and
loaded by `dcp.load` on the other mesh, in other layouts: every value equals the original
exactly, globally and piece by piece. The checkpoint's metadata is read back (every element
stored exactly once), and one process reads it into plain tensors (`no_dist=True`,
`dcp_to_torch_save`, a plain model). `get_model_state_dict` / `set_model_state_dict` round
trip. A Partial layout is refused on every rank at once, naming the redistribute that
fixes it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard
from shardwise._placement import _StridedShard
from shardwise.fsdp import fully_shard
from shardwise.parallel import ColwiseParallel, FusedColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

Layout = tuple[list[Placement], Optional[dict[int, tuple[int, ...]]]]  # placements, split order


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(10, 14)  # colwise on 4: weight rows 4, 4, 4, 2
        self.down = nn.Linear(14, 6)  # rowwise on 4: weight columns 4, 4, 4, 2; bias replicated
        self.fused = nn.Linear(10, 16)  # two projections of 8 side by side: two boxes per rank
        self.head = nn.Linear(10, 6)  # fully_shard on 4: rows 2, 2, 2, 0


def _net_on(mesh_shape: tuple[int, ...], seed: int) -> _Net:
    """The net, its values from `seed`, sharded on (4,) or, under another plan, on (2, 2)."""
    torch.manual_seed(seed)
    net = _Net()
    if mesh_shape == (4,):
        mesh = sw.init_device_mesh("cpu", (4,))
        parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                       "fused": FusedColwiseParallel(parts=2)})
        fully_shard(net.head, mesh=mesh)
    else:
        mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"up": RowwiseParallel(), "down": ColwiseParallel(), "fused": ColwiseParallel()})
        fully_shard(net.head, mesh=mesh["dp"])  # each tp rank's copy, sharded over dp: written once
    return net


def _model_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _Net().state_dict().items()}


# key: shape, dtype, layout on (4,), layout on (2, 2)
EXTRAS: dict[str, tuple[tuple[int, ...], torch.dtype, Layout, Layout]] = {
    "uneven": ((7, 5), torch.float32, ([Shard(0)], None), ([Shard(1), Shard(0)], None)),
    "small": ((3, 2), torch.float32, ([Shard(0)], None), ([Shard(0), Shard(0)], {0: (1, 0)})),
    "grid": ((9, 6), torch.float32, ([Shard(1)], None), ([Shard(0), Shard(1)], None)),
    "strided": ((8, 6), torch.float32, ([_StridedShard(0, split_factor=2)], None),
                ([Shard(1), _StridedShard(0, split_factor=2)], None)),
    "scalar": ((), torch.float32, ([Replicate()], None), ([Replicate(), Replicate()], None)),
    "empty": ((0, 4), torch.float32, ([Shard(1)], None), ([Shard(1), Replicate()], None)),
    "ints": ((9,), torch.int64, ([Shard(0)], None), ([Replicate(), Shard(0)], None)),
    "half": ((5, 3), torch.bfloat16, ([Shard(1)], None), ([Shard(0), Shard(1)], None)),
}


def _extra_reference() -> dict[str, torch.Tensor]:
    out = {}
    for i, (key, (shape, dtype, _, _)) in enumerate(EXTRAS.items()):
        g = torch.Generator().manual_seed(100 + i)
        out[key] = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return out


def _extras_on(mesh_shape: tuple[int, ...], zero: bool) -> dict[str, DTensor]:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    out = {}
    for key, full in _extra_reference().items():
        placements, order = EXTRAS[key][2 if mesh_shape == (4,) else 3]
        value = torch.zeros_like(full) if zero else full
        out[key] = sw.distribute_tensor(value, mesh, placements, src_data_rank=None, shard_order=order)
    return out


def _reference() -> dict[str, Any]:
    return {"model": _model_reference(), "extra": _extra_reference(), "step": 7}


def _check(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    """Every DTensor holds the reference: globally, and this rank's piece exactly where it belongs."""
    for key, t in got.items():
        assert isinstance(t, DTensor), key
        assert torch.equal(t.full_tensor(), want[key]), key
        piece = sw.distribute_tensor(want[key], t.device_mesh, t.placements, src_data_rank=None,
                                     shard_order=t.shard_order).to_local()
        assert torch.equal(t.to_local(), piece), key


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """DCP must not run ops on DTensors: no shardwise collective, no fallback warning."""
    with sw.comm_log() as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert log == [], log
    assert not [w for w in caught if "shardwise" in str(w.message)], [str(w.message) for w in caught]


def _save(path: str, mesh_shape: tuple[int, ...], asynchronous: bool) -> None:
    net, extras = _net_on(mesh_shape, 0), _extras_on(mesh_shape, zero=False)
    state = {"model": net.state_dict(), "extra": extras, "step": 7}
    if not asynchronous:
        with _quietly():
            dcp.save(state, checkpoint_id=path)
        return
    with _quietly():
        done = dcp.async_save(state, checkpoint_id=path)
    with torch.no_grad():  # training goes on: the checkpoint holds the values async_save was given
        for p in net.parameters():
            p.zero_()
        for t in extras.values():
            t.zero_()
    done.result()


def _load(path: str, mesh_shape: tuple[int, ...]) -> None:
    net, extras = _net_on(mesh_shape, 1), _extras_on(mesh_shape, zero=True)
    state = {"model": net.state_dict(), "extra": extras, "step": 0}
    with _quietly():
        dcp.load(state, checkpoint_id=path)
    net.load_state_dict(state["model"])
    reference = _reference()
    _check(dict(net.state_dict()), reference["model"])
    _check(extras, reference["extra"])
    assert state["step"] == 7


def _check_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Each saved tensor's chunks tile it: every element stored exactly once."""
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    reference = _reference()
    for key, entry in tensors.items():
        group, name = key.split(".", 1)
        assert entry.size == reference[group][name].shape, key
        times = torch.zeros(entry.size, dtype=torch.int64)
        for chunk in entry.chunks:
            times[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] += 1
        assert bool((times == 1).all()), (key, entry.chunks)
    assert {k.split(".", 1)[1] for k in tensors} == set(_model_reference()) | set(EXTRAS)
    return tensors


def _read_in_one_process(path: Path) -> None:
    """This process, no process group: plain tensors, a plain model and a torch.save file."""
    reference = _reference()
    plain: dict[str, Any] = {group: {k: torch.zeros_like(v) for k, v in reference[group].items()}
                             for group in ("model", "extra")}
    plain["step"] = 0
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for group in ("model", "extra"):
        for key, want in reference[group].items():
            assert torch.equal(plain[group][key], want), (group, key)
    assert plain["step"] == 7

    with torch.no_grad():
        model = _Net()
        for p in model.parameters():
            p.zero_()
    weights = model.state_dict()
    dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
    model.load_state_dict(weights)
    for key, want in reference["model"].items():
        assert torch.equal(model.state_dict()[key], want), key

    dcp_to_torch_save(path, path / "whole.pt")
    whole = torch.load(path / "whole.pt", weights_only=False)
    for group in ("model", "extra"):
        for key, want in reference[group].items():
            assert torch.equal(whole[group][key], want), (group, key)
    assert whole["step"] == 7


@pytest.mark.parametrize("saved_on, loaded_on", [((4,), (2, 2)), ((2, 2), (4,))])
def test_torch_dcp_save_then_load_on_another_mesh_and_layout_is_exact(tmp_path: Path, saved_on: tuple[int, ...],
                                                                      loaded_on: tuple[int, ...]) -> None:
    run_distributed(_save, 4, str(tmp_path), saved_on, False)
    tensors = _check_metadata(tmp_path)
    if saved_on == (4,):
        assert len(tensors["model.fused.weight"].chunks) == 8  # 4 ranks, a box per fused part
        assert len(tensors["model.down.bias"].chunks) == 1  # 4 replicas, written once
        assert len(tensors["model.head.weight"].chunks) == 3  # the 4th rank's piece is empty
    run_distributed(_load, 4, str(tmp_path), loaded_on)
    _read_in_one_process(tmp_path)


def test_torch_dcp_async_save_stages_the_values_it_was_given_and_loads_back_exactly(tmp_path: Path) -> None:
    run_distributed(_save, 4, str(tmp_path), (4,), True)
    _check_metadata(tmp_path)
    run_distributed(_load, 4, str(tmp_path), (2, 2))
    _read_in_one_process(tmp_path)


def _state_dict_api(path: str) -> None:
    net = _net_on((4,), 0)
    reference = _model_reference()
    state = get_model_state_dict(net)
    _check(state, reference)
    other = _net_on((4,), 1)
    set_model_state_dict(other, state)
    _check(dict(other.state_dict()), reference)

    with _quietly():
        dcp.save(get_model_state_dict(net), checkpoint_id=path)
    elsewhere = _net_on((2, 2), 1)  # another mesh and plan
    state = get_model_state_dict(elsewhere)
    with _quietly():
        dcp.load(state, checkpoint_id=path)
    set_model_state_dict(elsewhere, state)
    _check(dict(elsewhere.state_dict()), reference)

    last = _net_on((2, 2), 2)  # a full (plain) state dict into a sharded model
    set_model_state_dict(last, reference, options=StateDictOptions(full_state_dict=True))
    _check(dict(last.state_dict()), reference)


def test_get_and_set_model_state_dict_round_trip_through_torch_dcp(tmp_path: Path) -> None:
    run_distributed(_state_dict_api, 4, str(tmp_path))


def _partial_is_refused(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    terms = DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0), Partial("sum")], shape=(3, 2), stride=(2, 1))
    fix = "redistribute(placements=[Shard(dim=0), Replicate()])"
    with pytest.raises(CheckpointException, match="Partial") as caught:  # DCP gathers every rank's error
        dcp.save({"w": terms}, checkpoint_id=path)
    assert fix in str(caught.value), str(caught.value)
    reduced = terms.redistribute(placements=[Shard(0), Replicate()])
    dcp.save({"w": reduced}, checkpoint_id=path)  # the fix works
    with pytest.raises(CheckpointException, match="Partial") as caught:  # DCP gathers every rank's error
        dcp.load({"w": terms}, checkpoint_id=path)
    assert fix in str(caught.value), str(caught.value)
    target = sw.distribute_tensor(torch.zeros(3, 2), mesh, [Replicate(), Shard(1)])
    dcp.load({"w": target}, checkpoint_id=path)
    assert torch.equal(target.full_tensor(), torch.full((3, 2), 2.0))


def test_a_partial_layout_is_refused_on_every_rank_at_once_naming_the_redistribute(tmp_path: Path) -> None:
    run_distributed(_partial_is_refused, 4, str(tmp_path), timeout=60)
