"""Sharded checkpoints: save on one mesh, load onto other meshes, layouts and world sizes.

A state dict of DTensors in every kind of placement (Shard on each dim, Replicate, Partial
with genuinely different terms), even and uneven shapes, plain tensors and plain values is
saved by 4 ranks on mesh (4,), then loaded by 4 ranks onto (2, 2) in other layouts (split
orders included), by 2 ranks onto (2,), and by this process into plain tensors: every value
must equal the original exactly (the data are integers, so reductions are exact). The
table is read back to check that each element was written exactly once and that every
stored piece has its box's shape. A model and its AdamW state saved mid-training on (4,)
and resumed on (2, 2) under another plan must train on like a run that never stopped.
Failures: a directory without metadata.json is refused; a save that fails on one rank
(a value that cannot be saved, a writer that raises) raises on every rank and leaves no
metadata; mismatched state dicts get one ValueError listing every problem.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import DTensor, Partial, Placement, Replicate, Shard, checkpoint
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

from ..dist_helpers import expected_piece
from ..models import distribute_params

SHAPES = [(8, 12), (7, 5), (3, 1)]  # even, uneven, a dim smaller than the mesh
SAVED_LAYOUTS: dict[str, list[Placement]] = {
    "s0": [Shard(0)], "s1": [Shard(1)], "r": [Replicate()], "psum": [Partial("sum")], "pmax": [Partial("max")],
}
PLAIN = {"step": 3, "name": "run-7", "opts": {"betas": (0.9, 0.99), "flags": [True, None], "lr": 1e-3}}


def _resealed(table: dict[str, Any]) -> dict[str, Any]:
    """An edited table with its checksum made to match again (a deliberate forgery, which the
    other checks must still catch)."""
    from shardwise.checkpoint._metadata import _body_digest

    body = {k: v for k, v in table.items() if k != "sha256"}
    return {**body, "sha256": _body_digest(body)}


def _rank_file(name: str) -> str:
    """A data file's name without its save's generation: rank_2.0a1b2c3d.pt -> rank_2.pt."""
    return re.sub(r"\.[0-9a-f]{8}\.pt$", ".pt", name)


def _value(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer-valued, so sums of terms are exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _originals() -> dict[str, torch.Tensor]:
    """The global tensors the checkpoint holds, by key (the same in every process)."""
    out = {}
    for (i, shape), (j, name) in itertools.product(enumerate(SHAPES), enumerate(SAVED_LAYOUTS)):
        out[f"{name}_{'x'.join(map(str, shape))}"] = _value(shape, 10 * i + j)
    out["ints"] = _value((9,), 99, torch.int64)
    out["scalar"] = _value((), 98)
    out["half"] = _value((5, 3), 97, torch.bfloat16)
    return out


def _saved_layout(key: str) -> list[Placement]:
    others: dict[str, list[Placement]] = {"ints": [Shard(0)], "scalar": [Replicate()], "half": [Shard(1)]}
    return others[key] if key in others else SAVED_LAYOUTS[key.split("_")[0]]


def _on_mesh(full: torch.Tensor, mesh: sw.DeviceMesh, placements: list[Placement],
             order: Optional[dict[int, tuple[int, ...]]] = None) -> DTensor:
    """A DTensor of global value `full`; Partial mesh dims hold different, exactly reducing terms."""
    coord = mesh.get_coordinate()
    assert coord is not None
    piece = expected_piece(full, mesh.shape, placements, coord, order).clone()
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            n, c = mesh.shape[m], coord[m]
            terms = [_value(tuple(piece.shape), 500 + k, piece.dtype) for k in range(n - 1)]
            if p.reduce_op == "sum":  # the last term makes the sum exact
                piece = terms[c] if c < n - 1 else piece - sum(terms, torch.zeros_like(piece))
            else:  # max: one rank holds the value, the others hold less
                piece = piece if c == 0 else piece - terms[c - 1].abs() - 1
    return DTensor.from_local(piece, mesh, placements, shape=full.shape, stride=full.stride(), shard_order=order)


def _save_on_four(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    tensors = {k: _on_mesh(v, mesh, _saved_layout(k)) for k, v in _originals().items()}
    before = {k: (t.placements, t.to_local().clone()) for k, t in tensors.items()}
    state = {"tensors": tensors, "plain": torch.arange(5.0), **copy.deepcopy(PLAIN)}
    checkpoint.save(state, checkpoint_id=path)
    for k, t in tensors.items():  # saving reduces a copy: the state dict is unchanged
        assert t.placements == before[k][0] and torch.equal(t.to_local(), before[k][1]), k


def _check_loaded(state: dict[str, Any], layouts: dict[str, tuple[Any, Any]]) -> None:
    originals = _originals()
    for key, t in state["tensors"].items():
        placements, order = layouts[key]
        assert isinstance(t, DTensor) and t.placements == tuple(placements), key
        got = t.full_tensor()
        assert got.dtype == originals[key].dtype and torch.equal(got, originals[key]), key
        if not any(p.is_partial() for p in placements):
            mesh = t.device_mesh
            want = expected_piece(originals[key], mesh.shape, placements, mesh.get_coordinate(), order)  # type: ignore[arg-type]
            assert torch.equal(t.to_local(), want), key
    assert torch.equal(state["plain"], torch.arange(5.0))
    assert {k: state[k] for k in PLAIN} == PLAIN
    assert type(state["opts"]["betas"]) is tuple


def _load_onto(path: str, mesh_shape: tuple[int, ...], choices: list[tuple[list[Placement], Any]]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    layouts, tensors = {}, {}
    for i, (key, full) in enumerate(_originals().items()):
        placements, order = choices[i % len(choices)]
        if full.ndim < 2:
            placements, order = [Shard(0) if p == Shard(1) else p for p in placements], None
        if full.ndim == 0:
            placements = [Replicate()] * len(mesh_shape)
        layouts[key] = (placements, order)
        tensors[key] = sw.distribute_tensor(torch.zeros_like(full), mesh, placements, shard_order=order)
    state = {"tensors": tensors, "plain": torch.zeros(5), "step": 0, "name": "",
             "opts": {"betas": (0.0, 0.0), "flags": [False, False], "lr": 0.0}}
    with torch.no_grad():
        locals_before = {k: t.to_local() for k, t in tensors.items()}
    checkpoint.load(state, checkpoint_id=path)
    with torch.no_grad():  # filled in place
        assert all(state["tensors"][k] is t and t.to_local() is locals_before[k] for k, t in tensors.items())
    _check_loaded(state, layouts)


ON_2X2: list[tuple[list[Placement], Any]] = [
    ([Shard(1), Replicate()], None),
    ([Shard(0), Shard(0)], {0: (1, 0)}),  # a non-default split order
    ([Replicate(), Shard(0)], None),
    ([Shard(0), Shard(1)], None),
    ([Partial("sum"), Shard(0)], None),  # loading into a Partial target: its other terms are zeros
    ([Shard(1), Partial("prod")], None),  # ... ones (this loaded the value into every term: value ** 2)
]
ON_2: list[tuple[list[Placement], Any]] = [([Shard(0)], None), ([Shard(1)], None), ([Replicate()], None)]


def _check_table(path: Path) -> dict[str, Any]:
    """Each saved element once: the pieces of a tensor are disjoint, cover it, and match their files."""
    table = json.loads((path / "metadata.json").read_text())
    files = {name: torch.load(path / name, weights_only=True)["values"] for name in {
        p["file"] for e in table["entries"] for p in e["pieces"]}}
    for entry in table["entries"]:
        if entry["kind"] != "tensor":
            continue
        boxes = [tuple(map(tuple, p["box"])) for p in entry["pieces"]]
        assert sum(math.prod(n for _, n in b) for b in boxes) == math.prod(entry["shape"]), entry["path"]
        for a, b in itertools.combinations(boxes, 2):
            assert any(sa + la <= sb or sb + lb <= sa for (sa, la), (sb, lb) in zip(a, b)), (entry["path"], a, b)
        for p in entry["pieces"]:
            stored = files[p["file"]][p["index"]]
            assert tuple(stored.shape) == tuple(n for _, n in p["box"]) and str(stored.dtype) == f"torch.{entry['dtype']}"
    stored = sum(v.numel() for f in path.glob("rank_*.pt") for v in torch.load(f, weights_only=True)["values"]
                 if isinstance(v, torch.Tensor))
    assert stored == sum(math.prod(e["shape"]) for e in table["entries"] if e["kind"] == "tensor"), "written twice"
    return table


def test_save_on_4_ranks_loads_onto_2x2_onto_2_ranks_and_into_one_process(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save_on_four, 4, path)
    table = _check_table(tmp_path / "ckpt")
    by_key = {tuple(e["path"]): e for e in table["entries"]}
    assert len(by_key[("tensors", "r_8x12")]["pieces"]) == 1  # a replicated tensor: written by one rank
    assert len(by_key[("tensors", "s0_8x12")]["pieces"]) == 4
    assert len(by_key[("tensors", "s0_3x1")]["pieces"]) == 3  # the empty fourth piece is not written
    assert {_rank_file(p["file"]) for e in table["entries"] if e["kind"] == "object" for p in e["pieces"]} == {"rank_0.pt"}

    run_distributed(_load_onto, 4, path, (2, 2), ON_2X2)
    run_distributed(_load_onto, 2, path, (2,), ON_2)

    originals = _originals()  # no process group: whole plain tensors
    state = {"tensors": {k: torch.zeros_like(v) for k, v in originals.items()}, "plain": torch.zeros(5),
             "step": 0, "name": "", "opts": {"betas": (0.0, 0.0), "flags": [False, False], "lr": 0.0}}
    checkpoint.load(state, checkpoint_id=path)
    for k, v in originals.items():
        assert torch.equal(state["tensors"][k], v), k
    assert {k: state[k] for k in PLAIN} == PLAIN


def _replicas_save(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = _value((6, 4), 1)
    state = {
        "rr": _on_mesh(full, mesh, [Replicate(), Replicate()]),
        "rs": _on_mesh(full, mesh, [Replicate(), Shard(1)]),
        "sr": _on_mesh(full, mesh, [Shard(0), Replicate()]),
        "pr": _on_mesh(full, mesh, [Partial(), Replicate()]),
        "ps": _on_mesh(full, mesh, [Shard(1), Partial()]),
    }
    checkpoint.save(state, checkpoint_id=path)


def test_each_replicated_element_is_written_once(tmp_path: Path) -> None:
    run_distributed(_replicas_save, 4, str(tmp_path))
    table = _check_table(tmp_path)
    writers = {e["path"][0]: sorted(_rank_file(p["file"]) for p in e["pieces"]) for e in table["entries"]}
    # mesh (2, 2), row-major ranks: coordinate 0 on the mesh dims that do not split the tensor
    assert writers == {"rr": ["rank_0.pt"], "rs": ["rank_0.pt", "rank_1.pt"], "sr": ["rank_0.pt", "rank_2.pt"],
                       "pr": ["rank_0.pt"], "ps": ["rank_0.pt", "rank_2.pt"]}
    assert {(e["path"][0], e["layout"]) for e in table["entries"]} >= {("pr", "(R, R) on mesh (2, 2)")}
    state = {k: torch.zeros(6, 4) for k in writers}
    checkpoint.load(state, checkpoint_id=tmp_path)
    assert all(torch.equal(t, _value((6, 4), 1)) for t in state.values())


def _sub_mesh_save(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _value((6, 4), 1)
    state = {  # each tensor lives on one 1-D sub-mesh per replica: two meshes hold the same pieces
        "tp_s0": _on_mesh(full, mesh["tp"], [Shard(0)]),
        "tp_r": _on_mesh(full, mesh["tp"], [Replicate()]),
        "dp_s1": _on_mesh(full, mesh["dp"], [Shard(1)]),
        "dp_p": _on_mesh(full, mesh["dp"], [Partial()]),
    }
    checkpoint.save(state, checkpoint_id=path)


def test_pieces_held_on_several_sub_meshes_are_written_once(tmp_path: Path) -> None:
    run_distributed(_sub_mesh_save, 4, str(tmp_path))
    table = _check_table(tmp_path)
    writers = {e["path"][0]: sorted(_rank_file(p["file"]) for p in e["pieces"]) for e in table["entries"]}
    # the lowest rank holding a piece writes it: the dp = 0 row of the tp meshes, the tp = 0 column of the dp ones
    assert writers == {"tp_s0": ["rank_0.pt", "rank_1.pt"], "tp_r": ["rank_0.pt"],
                       "dp_s1": ["rank_0.pt", "rank_2.pt"], "dp_p": ["rank_0.pt"]}
    state = {k: torch.zeros(6, 4) for k in writers}
    checkpoint.load(state, checkpoint_id=tmp_path)
    assert all(torch.equal(t, _value((6, 4), 1)) for t in state.values())


# -- a model and its optimizer, resumed on another mesh under another plan ---------------------

STEPS = 4


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 5, generator=g, dtype=torch.float64)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _reference() -> list[dict[str, torch.Tensor]]:
    """Single-device parameters after each step."""
    torch.set_default_dtype(torch.float64)
    try:
        model = _mlp(0)
        opt = _adamw(model.parameters())
        out = []
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_and_save(path: str) -> dict[str, Any]:
    """Two steps on (4,) under a tensor-parallel plan, then save model and optimizer."""
    torch.set_default_dtype(torch.float64)
    mesh = sw.init_device_mesh("cpu", (4,))
    model = parallelize_module(  # 10 hidden units on 4 ranks: uneven, so DTensors between the layers
        _mlp(0), mesh, {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
    opt = _adamw(model.parameters())
    for step in range(2):
        x, y = _batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    checkpoint.save({"model": model, "optim": opt}, checkpoint_id=path)
    state = opt.state_dict()["state"]
    return {"params": {n: _full(p.detach()) for n, p in model.named_parameters()},
            "optim": {(i, k): _full(v) for i, s in state.items() for k, v in s.items()}}


PLAN_2X2: dict[str, list[Placement]] = {
    "0.weight": [Shard(1), Shard(0)], "0.bias": [Replicate(), Shard(0)],
    "2.weight": [Shard(0), Replicate()], "2.bias": [Replicate(), Replicate()],
}


def _resume(path: str, saved: dict[str, Any], reference: list[dict[str, torch.Tensor]]) -> None:
    """A fresh model and optimizer on (2, 2) under another plan: load, check, train two more steps."""
    torch.set_default_dtype(torch.float64)
    mesh = sw.init_device_mesh("cpu", (2, 2))
    model = distribute_params(_mlp(seed=1), mesh, lambda name, p: PLAN_2X2[name])
    opt = _adamw(model.parameters())
    assert not opt.state  # never stepped: load gives it its state (a step at lr 0), then the saved values
    checkpoint.load({"model": model, "optim": opt}, checkpoint_id=path)
    assert all(p.grad is None for p in model.parameters())  # the zero gradients of that step are gone

    assert opt.param_groups[0]["lr"] == 0.05  # plain values came back
    for name, p in model.named_parameters():
        assert p.placements == tuple(PLAN_2X2[name]) and torch.equal(p.full_tensor(), saved["params"][name]), name
    for (i, key), value in saved["optim"].items():
        got = opt.state[list(model.parameters())[i]][key]
        assert torch.equal(_full(got), value), (i, key)
        if key != "step":
            assert got.placements == tuple(PLAN_2X2[list(dict(model.named_parameters()))[i]]), (i, key)

    for step in range(2, STEPS):
        x, y = _batch(step)
        dx, dy = (sw.distribute_tensor(t, mesh, [Replicate(), Replicate()]) for t in (x, y))
        opt.zero_grad()
        with sw.implicit_replication():
            (model(dx) - dy).pow(2).mean().backward()
            opt.step()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.full_tensor(), reference[step][name], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"step {step} {name}: {m}")


def test_model_and_adamw_saved_on_4_resume_on_2x2_under_another_plan(tmp_path: Path) -> None:
    reference = _reference()
    saved = run_distributed(_train_and_save, 4, str(tmp_path))[0]
    for name, value in saved["params"].items():  # the distributed run itself matched before the save
        torch.testing.assert_close(value, reference[1][name], rtol=1e-12, atol=1e-12)
    run_distributed(_resume, 4, str(tmp_path), saved, reference)


# -- failures -----------------------------------------------------------------------------------

def test_a_directory_without_metadata_is_refused(tmp_path: Path) -> None:
    checkpoint.save({"w": torch.ones(3)}, checkpoint_id=tmp_path)
    (tmp_path / "metadata.json").unlink()
    with pytest.raises(ValueError, match="is not a complete checkpoint: it has no metadata.json, which save writes last"):
        checkpoint.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        checkpoint.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "nowhere")


def _save_with_one_bad_value(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    state: dict[str, Any] = {"w": _on_mesh(_value((8, 3), 2), mesh, [Shard(0)])}
    if dist.get_rank() == 2:
        state["hook"] = lambda: None  # cannot be pickled
        with pytest.raises(TypeError, match=r"(?s)'hook': function .*failed on rank 2 while checking the state dict"):
            checkpoint.save(state, checkpoint_id=path)
    else:
        with pytest.raises(RuntimeError, match="failed on rank 2 while checking the state dict: no new metadata.json"):
            checkpoint.save(state, checkpoint_id=path)


def _save_with_a_failing_writer(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    state = {"w": _on_mesh(_value((8, 3), 3), mesh, [Shard(0)])}
    if dist.get_rank() == 1:
        with mock.patch("shardwise.checkpoint._save.write_atomically", side_effect=OSError("No space left on device")):
            with pytest.raises(OSError, match="No space left"):
                checkpoint.save(state, checkpoint_id=path)
    else:
        with pytest.raises(RuntimeError, match="failed on rank 1 while writing the data files"):
            checkpoint.save(state, checkpoint_id=path)
    loaded = {"w": torch.zeros(8, 3)}  # on every rank: the earlier checkpoint, whole
    checkpoint.load(loaded, checkpoint_id=path)
    assert torch.equal(loaded["w"], torch.full((8, 3), 7.0))


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_earlier_checkpoint(tmp_path: Path) -> None:
    # Regression: a save removed the old metadata.json as it started, so a save that failed
    # (or was killed) on any rank left nothing loadable
    checkpoint.save({"w": torch.full((8, 3), 7.0)}, checkpoint_id=tmp_path)  # an earlier checkpoint
    run_distributed(_save_with_one_bad_value, 4, str(tmp_path), timeout=120)
    # refused before anything was written: the earlier checkpoint is intact
    state = {"w": torch.zeros(8, 3)}
    checkpoint.load(state, checkpoint_id=tmp_path)
    assert torch.equal(state["w"], torch.full((8, 3), 7.0))

    (tmp_path / ".rank_3.pt.4242.tmp").write_bytes(b"half")  # what a killed save leaves
    run_distributed(_save_with_a_failing_writer, 4, str(tmp_path), timeout=120)
    assert (tmp_path / "metadata.json").exists()
    checkpoint.load(state, checkpoint_id=tmp_path)
    assert torch.equal(state["w"], torch.full((8, 3), 7.0))
    # the next save that completes removes what no metadata names: older generations, temporary files
    checkpoint.save({"w": torch.full((8, 3), 9.0)}, checkpoint_id=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json"))[0].startswith("rank_0.")
    assert not list(tmp_path.glob(".*.tmp")) and len(list(tmp_path.glob("rank_*.pt"))) == 1
    checkpoint.load(state, checkpoint_id=tmp_path)
    assert torch.equal(state["w"], torch.full((8, 3), 9.0))


def _save_disagreeing_state_dicts(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    state: dict[str, Any] = {"w": _on_mesh(_value((8, 3), 2), mesh, [Shard(0)])}
    if rank == 3:
        state["w"] = _on_mesh(_value((8, 4), 2), mesh, [Shard(0)])
    if rank == 1:
        state["only_here"] = torch.ones(2)
    if rank == 0:
        with pytest.raises(ValueError) as info:
            checkpoint.save(state, checkpoint_id=path)
        message = str(info.value)
        assert "'w' is a DTensor (S(0)) on mesh (4,) of shape (8, 3) and dtype float32 on rank 0 but a DTensor " \
               "(S(0)) on mesh (4,) of shape (8, 4) and dtype float32 on rank 3" in message, message
        assert message.count("\n  - ") == 1 and "only_here" not in message, message  # (one rank's own key: fine)
    else:
        with pytest.raises(RuntimeError, match="failed on rank 0 while writing metadata.json"):
            checkpoint.save(state, checkpoint_id=path)


def _save_each_ranks_own_keys(path: str) -> None:
    # a pipeline's stages: each rank holds keys of its own (plain tensors, values, DTensors on its own
    # one-rank mesh), some keys every rank holds; the lowest holder of each plain leaf writes it
    rank = dist.get_rank()
    mine = sw.DeviceMesh("cpu", [rank])
    state: dict[str, Any] = {"shared": torch.arange(3.0), f"stage{rank}.w": torch.full((2, rank + 1), float(rank)),
                             f"stage{rank}.step": rank * 10, f"stage{rank}.d": _on_mesh(_value((4, 2), rank), mine,
                                                                                      [Shard(0)])}
    if rank >= 2:
        state["upper"] = torch.ones(2) * 5  # held by ranks 2 and 3: rank 2 writes it
    checkpoint.save(state, checkpoint_id=path)
    fresh = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) and not isinstance(v, sw.DTensor) else
                 _on_mesh(torch.zeros(4, 2), mine, [Shard(0)]) if isinstance(v, sw.DTensor) else 0)
             for k, v in state.items()}
    checkpoint.load(fresh, checkpoint_id=path)
    for k, v in state.items():
        got = fresh[k]
        if isinstance(v, sw.DTensor):
            assert isinstance(got, sw.DTensor) and torch.equal(got.full_tensor(), v.full_tensor()), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got, v), k
        else:
            assert got == v, k


def test_each_ranks_own_keys_are_saved_by_their_holder_and_load_back(tmp_path: Path) -> None:
    run_distributed(_save_each_ranks_own_keys, 4, str(tmp_path), timeout=120)
    files = {p.name: p.stat().st_size for p in tmp_path.glob("rank_*.pt")}
    assert len(files) == 4 and (tmp_path / "metadata.json").exists()


def test_ranks_that_disagree_on_the_state_dict_get_one_error_and_no_checkpoint(tmp_path: Path) -> None:
    run_distributed(_save_disagreeing_state_dicts, 4, str(tmp_path), timeout=120)
    assert not (tmp_path / "metadata.json").exists()


def test_mismatches_are_reported_together_and_nothing_is_loaded(tmp_path: Path) -> None:
    saved = {"a": torch.ones(4, 2), "b": torch.ones(3), "c": 1, "d": torch.ones(2), "e": torch.ones(3),
             "m": {"w": torch.ones(2), "old": torch.ones(2)}}
    checkpoint.save(saved, checkpoint_id=tmp_path)
    target = {"a": torch.zeros(2, 4), "d": torch.zeros(2, dtype=torch.float64), "c": torch.zeros(1),
              "extra": torch.zeros(1), "e": torch.zeros(3), "m": {"w": torch.zeros(2)}}
    with pytest.raises(ValueError) as info:
        checkpoint.load(target, checkpoint_id=tmp_path)
    message = str(info.value)
    for expected in [
        "missing from the checkpoint: 'extra': load a checkpoint saved from the same model",
        "in the checkpoint but not in the state dict: 'm.old': build the state dict with these paths",
        "'a': the checkpoint holds shape (4, 2), the state dict (2, 4): global shapes must match",
        "'d': the checkpoint holds torch.float32, the state dict torch.float64",
        "'c': the checkpoint holds a plain value, the state dict a tensor",
    ]:
        assert expected in message, message
    assert message.count("\n  - ") == 5, message
    assert torch.equal(target["e"], torch.zeros(3)), "a failed load changed the state dict"

    # top-level keys the state dict leaves out are not loaded (as DCP); within one it asks for, strict
    part = {"a": torch.zeros(4, 2)}
    checkpoint.load(part, checkpoint_id=tmp_path)
    assert torch.equal(part["a"], torch.ones(4, 2))
    inner = {"m": {"w": torch.zeros(2)}}
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the state dict: 'm.old'"):
        checkpoint.load(inner, checkpoint_id=tmp_path)
    checkpoint.load(inner, checkpoint_id=tmp_path, strict=False)  # only the paths both have
    assert torch.equal(inner["m"]["w"], torch.ones(2))


def test_the_model_alone_loads_from_a_model_and_optimizer_checkpoint(tmp_path: Path) -> None:
    # regression: loading {"model": model} from a {"model", "optim"} checkpoint was refused
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    checkpoint.save({"model": model, "optim": opt}, checkpoint_id=tmp_path)
    fresh = torch.nn.Linear(4, 3)
    checkpoint.load({"model": fresh}, checkpoint_id=tmp_path)
    for name, p in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name


def test_values_that_load_cannot_read_back_are_refused_by_name(tmp_path: Path) -> None:
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"(?s)'opt.hook': Custom .*convert these, or leave them out"):
        checkpoint.save({"w": torch.ones(1), "opt": {"hook": Custom(), "lr": 0.1}}, checkpoint_id=tmp_path)
    assert not (tmp_path / "metadata.json").exists()


def test_public_surface() -> None:
    assert checkpoint.__all__ == ["load", "save", "async_save", "save_pretrained", "HuggingFaceStorageWriter", "HuggingFaceStorageReader", "load_pretrained", "FileSystemReader", "FileSystemWriter"]


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/passwd", ".hidden.pt", "sub/rank_0.pt", ".."])
def test_a_table_naming_a_file_outside_the_checkpoint_directory_is_refused(tmp_path: Path, name: str) -> None:
    # Regression: a piece's file name was joined to the directory as it was, so `../` or an
    # absolute path in a damaged or hostile metadata.json read a file elsewhere
    checkpoint.save({"w": torch.ones(2, 3)}, checkpoint_id=tmp_path)
    table = json.loads((tmp_path / "metadata.json").read_text())
    table["entries"][0]["pieces"][0]["file"] = name
    (tmp_path / "metadata.json").write_text(json.dumps(_resealed(table)))
    state = {"w": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        checkpoint.load(state, checkpoint_id=tmp_path)
    assert torch.equal(state["w"], torch.zeros(2, 3))
