"""Loading a damaged checkpoint: a clear ValueError, and the state dict exactly as it was.

One checkpoint is saved by 4 ranks (a tensor-parallel model, its AdamW state, an uneven
DTensor, plain values); each case copies it and damages the copy: a truncated or emptied
data file, a flipped byte in a piece's data, a missing or swapped file, a table edited in
every field (with its checksum left stale, and forged to match), a table that is not
JSON. Loading the copy into a model and optimizer in this process must raise a ValueError
that says what is wrong and leave every tensor and value of the state dict as it was (a
never-stepped optimizer stays never-stepped). A flipped byte anywhere in a data file must
either be refused or change nothing the load returns. Under a process group, a piece only
some ranks need is damaged: every rank raises and no rank changes anything.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard, checkpoint
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

from .test_checkpoint import _resealed

EXTRA = torch.arange(35.0).view(7, 5)  # uneven over 4 ranks: rows 2, 2, 2, 1


def _trained(seed: int, mesh: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    if mesh is not None:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save_on_four(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    model, opt = _trained(0, mesh)
    extra = {"w": sw.distribute_tensor(EXTRA, mesh, [Shard(0)]), "step": 3, "name": "run-7"}
    checkpoint.save({"model": model, "optim": opt, "extra": extra}, checkpoint_id=path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved")
    run_distributed(_save_on_four, 4, str(path))
    return path


def _target(stepped: bool = True) -> dict[str, Any]:
    model, opt = _trained(1)
    if not stepped:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optim": opt, "extra": {"w": torch.zeros(7, 5), "step": 0, "name": ""}}


def _flat(value: Any, where: str = "") -> dict[str, Any]:
    if isinstance(value, (nn.Module, torch.optim.Optimizer)):
        value = value.state_dict()
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{where}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{where}.{i}").items()}
    return {where: value.clone() if isinstance(value, torch.Tensor) else value}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# -- damage -------------------------------------------------------------------------------------

def _table(path: Path) -> dict[str, Any]:
    return json.loads((path / "metadata.json").read_text())


def _write_table(path: Path, table: dict[str, Any], reseal: bool) -> None:
    (path / "metadata.json").write_text(json.dumps(_resealed(table) if reseal else table))


def _entry(table: dict[str, Any], *path: Any) -> dict[str, Any]:
    return next(e for e in table["entries"] if tuple(e["path"]) == path)


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("rank_*.pt"))


def _piece_offset(path: Path, file: Path, index: int) -> int:
    """Where the bytes of piece `index` of `file` start in it (stored uncompressed)."""
    piece = torch.load(file, weights_only=True)["values"][index]
    data, raw = piece.contiguous().view(torch.uint8).numpy().tobytes(), file.read_bytes()
    assert raw.count(data) == 1, "the piece's bytes must be findable in its file"
    return raw.index(data)


def _flip(file: Path, offset: int) -> None:
    raw = bytearray(file.read_bytes())
    raw[offset] ^= 0x10
    file.write_bytes(bytes(raw))


def _flip_piece(path: Path) -> None:
    piece = _entry(_table(path), "extra", "w")["pieces"][3]
    file = path / piece["file"]
    _flip(file, _piece_offset(path, file, piece["index"]) + 5)


def _truncate(path: Path) -> None:
    file = _files(path)[1]
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _empty(path: Path) -> None:
    _files(path)[2].write_bytes(b"")


def _missing(path: Path) -> None:
    _files(path)[3].unlink()


def _swapped(path: Path) -> None:
    files = _files(path)
    files[1].write_bytes(files[2].read_bytes())


def _edit(change: Callable[[dict[str, Any]], None], reseal: bool) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        table = _table(path)
        change(table)
        _write_table(path, table, reseal)
    return damage


def _set_shape(t: dict[str, Any]) -> None:
    _entry(t, "extra", "w")["shape"] = [8, 5]


def _set_box(t: dict[str, Any]) -> None:
    _entry(t, "extra", "w")["pieces"][1]["box"] = [[1, 2], [0, 5]]  # overlaps piece 0, leaves row 3


def _outside_box(t: dict[str, Any]) -> None:
    _entry(t, "extra", "w")["pieces"][3]["box"] = [[6, 2], [0, 5]]


def _drop_piece(t: dict[str, Any]) -> None:
    del _entry(t, "extra", "w")["pieces"][2]


def _twice(t: dict[str, Any]) -> None:
    pieces = _entry(t, "extra", "w")["pieces"]
    pieces.append(dict(pieces[0]))


def _set_dtype(t: dict[str, Any]) -> None:
    _entry(t, "extra", "w")["dtype"] = "float64"


def _set_index(t: dict[str, Any]) -> None:
    _entry(t, "model", "0.weight")["pieces"][0]["index"] += 1  # another value of the same file


def _index_past_end(t: dict[str, Any]) -> None:
    _entry(t, "model", "0.weight")["pieces"][0]["index"] = 999


def _set_checksum(t: dict[str, Any]) -> None:
    _entry(t, "model", "2.bias")["pieces"][0]["sha256"] = "0" * 64


def _set_value_type(t: dict[str, Any]) -> None:
    _entry(t, "extra", "step")["pieces"][0]["index"] = "3"


def _set_kind(t: dict[str, Any]) -> None:
    _entry(t, "extra", "step")["kind"] = "tensor"


def _set_file_size(t: dict[str, Any]) -> None:
    name = sorted(t["files"])[0]
    t["files"][name] += 1


def _not_json(path: Path) -> None:
    (path / "metadata.json").write_text('{"format": "shardwise.checkpoint", "ver')


def _a_list(path: Path) -> None:
    (path / "metadata.json").write_text("[1, 2]")


EDITS = {"shape": _set_shape, "box overlaps": _set_box, "box outside": _outside_box, "piece dropped": _drop_piece,
         "piece twice": _twice, "dtype": _set_dtype, "index moved": _set_index, "index past end": _index_past_end,
         "checksum": _set_checksum, "index a str": _set_value_type, "kind": _set_kind, "file size": _set_file_size}

DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated file": (_truncate, r"was truncated or replaced after saving|cannot read checkpoint data file"),
    "emptied file": (_empty, r"has 0 bytes, the table records"),
    "flipped byte in a piece": (_flip_piece, r"'extra.w': piece \d+ of .* does not match its SHA-256 checksum"),
    "missing file": (_missing, r"the checkpoint lists rank_3\.\w+\.pt, but .* does not exist"),
    "swapped file": (_swapped, r"truncated or replaced|does not match its SHA-256|the table says"),
    "not JSON": (_not_json, r"metadata.json' is not a shardwise checkpoint table \(Unterminated string"),
    "a JSON list": (_a_list, r"is not a shardwise checkpoint table \(it holds a JSON list"),
    **{f"edited {name}, stale checksum": (_edit(change, False), r"metadata.json' was changed after it was saved")
       for name, change in EDITS.items()},
}
FORGED = {  # the same edits with the checksum forged to match: the other checks must catch each
    "shape": r"'extra.w': elements in box \[\(7, 1\), \(0, 5\)\] are held by no piece",
    "box overlaps": r"'extra.w': pieces overlap: elements in box \[\(1, 1\), \(0, 5\)\] are held 2 times",
    "box outside": r"'extra.w': box \[\[6, 2\], \[0, 5\]\] reaches outside shape \(7, 5\)",
    "piece dropped": r"'extra.w': elements in box \[\(4, 2\), \(0, 5\)\] are held by no piece",
    "piece twice": r"'extra.w': pieces overlap",
    "dtype": r"'extra.w': the checkpoint holds torch.float64, the state dict torch.float32",
    "index moved": r"'model.0.weight': piece \d+ of .* is a tensor of shape \(2,\) and dtype float32, the table says",
    "index past end": r"'model.0.weight': piece 999 of .* does not exist \(the file holds \d+\)",
    "checksum": r"'model.2.bias': piece \d+ of .* does not match its SHA-256 checksum",
    "index a str": r"'extra.step': piece index '3' is not a non-negative int",
    "kind": r"'extra.step': shape None is not a list of non-negative ints",
    "file size": r"has \d+ bytes, the table records \d+: it was truncated or replaced",
}
for name, pattern in FORGED.items():
    DAMAGE[f"edited {name}, forged checksum"] = (_edit(EDITS[name], True), pattern)


def _copy(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    return copy


def test_the_undamaged_copy_loads(saved: Path, tmp_path: Path) -> None:
    # the positive control: the state the damage tests keep is really replaced by a good load
    state = _target()
    before = _flat(state)
    checkpoint.load(state, checkpoint_id=_copy(saved, tmp_path))
    assert not _same(before, _flat(state))
    assert torch.equal(state["extra"]["w"], EXTRA) and state["extra"]["step"] == 3
    reference, _ = _trained(0)
    for name, p in reference.state_dict().items():  # trained on 4 ranks: sums in another order
        torch.testing.assert_close(state["model"].state_dict()[name], p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_the_state_dict_is_untouched(saved: Path, tmp_path: Path,
                                                                        case: str) -> None:
    damage, pattern = DAMAGE[case]
    path = _copy(saved, tmp_path)
    damage(path)
    for stepped in (True, False):
        state = _target(stepped)
        before = _flat(state)
        with pytest.raises(ValueError, match=pattern):
            checkpoint.load(state, checkpoint_id=path)
        assert _same(before, _flat(state)), f"{case}: a failed load changed the state dict"
        if not stepped:
            assert not state["optim"].state, f"{case}: a failed load left a never-stepped optimizer with state"


def test_a_flipped_byte_anywhere_is_refused_or_changes_nothing_loaded(saved: Path, tmp_path: Path) -> None:
    reference = _target()
    checkpoint.load(reference, checkpoint_id=saved)
    good = _flat(reference)
    rng = random.Random(15)
    refused = 0
    for trial in range(40):
        path = tmp_path / f"flip{trial}"
        shutil.copytree(saved, path)
        file = rng.choice(_files(path))
        _flip(file, rng.randrange(file.stat().st_size))
        state = _target()
        before = _flat(state)
        try:
            checkpoint.load(state, checkpoint_id=path)
        except ValueError:
            refused += 1
            assert _same(before, _flat(state)), f"trial {trial}: a failed load changed the state dict"
        else:  # the byte was one nothing reads (zip padding, an unused record field)
            assert _same(good, _flat(state)), f"trial {trial}: a flipped byte in {file.name} loaded silently"
        shutil.rmtree(path)
    assert refused >= 20, refused  # most bytes of these small files are read; the zip's padding is not


def _load_with_one_damaged_piece(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    w = sw.distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0), Replicate()])  # ranks 2, 3 hold rows 4-6
    state = {"extra": {"w": w, "step": 0, "name": ""}}
    if rank in (2, 3):
        with pytest.raises(ValueError, match=r"'extra.w': piece \d+ of .* does not match its SHA-256"):
            checkpoint.load(state, checkpoint_id=path)
    else:  # this rank's pieces are intact, but another rank's are not: nothing loads anywhere
        with pytest.raises(RuntimeError, match=r"failed on ranks 2, 3 while checking .*: nothing was loaded, on any"):
            checkpoint.load(state, checkpoint_id=path)
    assert isinstance(state["extra"]["w"], DTensor) and not state["extra"]["w"].to_local().any()
    assert state["extra"]["step"] == 0
    if rank in (0, 1):  # alone (no_dist), a rank whose pieces are intact loads them
        checkpoint.load(state, checkpoint_id=path, no_dist=True)
        assert torch.equal(state["extra"]["w"].to_local(), EXTRA[:4]) and state["extra"]["step"] == 3


def test_under_a_process_group_a_load_that_fails_on_one_rank_changes_nothing_on_any(saved: Path,
                                                                                   tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    _flip_piece(path)  # rows 6 of extra.w: needed by ranks 2 and 3 of the (2, 2) load only
    run_distributed(_load_with_one_damaged_piece, 4, str(path), timeout=120)
