"""`visualize_sharding` and `layout_table`: which rank holds which piece, for any mesh and tensor rank.

Pure layout math, so abstract meshes serve (a DTensor on one is a dry DTensor of meta
pieces). Every picture is checked cell by cell against the layout's own pieces.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.debug import layout_table, visualize_sharding


def _rows(text: str) -> list[list[str]]:
    """The cells of each table row of a drawn grid."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.rstrip().endswith("|")]


def test_a_2d_tensor_on_a_2d_mesh_is_a_grid_of_its_pieces() -> None:
    mesh = sw.AbstractMesh((2, 2), ("dp", "tp"))
    text = visualize_sharding((8, 6), mesh=mesh, placements=[Shard(0), Shard(1)], print_out=False)
    assert text.splitlines()[0] == "shape (8, 6) on mesh (2, 2) ('dp', 'tp'), (S(0), S(1))"
    assert _rows(text) == [["0", "1"], ["2", "3"]]
    assert "0:4 |" in text and "0:3" in text and "3:6" in text
    # replicated over dp: ranks (0, j) and (1, j) hold the same rows
    t = sw.distribute_tensor(torch.empty(8, 8, device="meta"), mesh, [Replicate(), Shard(0)])
    assert _rows(visualize_sharding(t, print_out=False)) == [["0,2"], ["1,3"]]


def test_uneven_pieces_partial_sums_and_scalars_are_said() -> None:
    text = visualize_sharding((3, 8), mesh=sw.AbstractMesh((4,)), placements=[Shard(0)], print_out=False)
    assert _rows(text) == [["0"], ["1"], ["2"]]
    assert text.splitlines()[-1] == "ranks 3 hold empty pieces (uneven split)"
    text = visualize_sharding((5,), mesh=sw.AbstractMesh((2, 4), ("tp", "dp")), placements=[Partial(), Shard(0)],
                              header="bias", print_out=False)
    # torch.chunk sizes: 2, 2, 1, 0
    assert text.startswith("bias: shape (5,)") and _rows(text) == [["0,4", "1,5", "2,6"]]
    assert "pending: Partial(sum) over tp" in text and text.endswith("ranks 3,7 hold empty pieces (uneven split)")
    scalar = visualize_sharding((), mesh=sw.AbstractMesh((8, 8)), placements=[Replicate(), Replicate()], print_out=False)
    assert "a scalar, held by ranks 0-63" in scalar


def test_any_tensor_rank_on_any_mesh_rank_lists_every_piece(tmp_path: Path) -> None:
    mesh = sw.AbstractMesh((2, 1, 2, 2))
    png = tmp_path / "layout.png"
    text = visualize_sharding((4, 6, 2, 5), mesh=mesh, placements=[Shard(0), Replicate(), Shard(1), Shard(3)],
                              png=png, print_out=False)
    listed = [line.split("]")[0].strip(" [") for line in text.splitlines()[1:]]
    ranks = [line.split("ranks ")[1] for line in text.splitlines()[1:]]
    assert listed == ["0:2, 0:3, 0:2, 0:3", "0:2, 0:3, 0:2, 3:5", "0:2, 3:6, 0:2, 0:3", "0:2, 3:6, 0:2, 3:5",
                      "2:4, 0:3, 0:2, 0:3", "2:4, 0:3, 0:2, 3:5", "2:4, 3:6, 0:2, 0:3", "2:4, 3:6, 0:2, 3:5"]
    assert ranks == [str(r) for r in range(8)]
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_models_layout_table_names_every_parameter_pattern(tmp_path: Path) -> None:
    from shardwise._demo.model import CharGPT, CharGPTConfig
    from shardwise._demo.train import manual_plan
    from shardwise.parallel import parallelize_module

    mesh = sw.AbstractMesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model = CharGPT(CharGPTConfig(vocab=16, d_model=32, seq=8))
    parallelize_module(model, mesh["tp"], manual_plan(), replicate_rest=True)
    text = layout_table(model, png=tmp_path / "model.png")
    assert text.splitlines()[0] == "CharGPT on mesh (2,) ('tp',)"
    assert "blocks.*.attn.proj.weight" in text and "blocks.0." not in text
    row = next(line for line in text.splitlines() if line.startswith("blocks.*.mlp.down.weight"))
    assert "(32, 128)" in row and "tp: S(1)" in row and row.endswith("|0000000011111111|")
    assert (tmp_path / "model.png").read_bytes().startswith(b"\x89PNG")
    assert layout_table(torch.nn.Linear(2, 2)) == "Linear has no DTensor parameters (2 plain)"


def test_bad_input_names_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"pass mesh= \(a DeviceMesh or an AbstractMesh\) and placements="):
        visualize_sharding((4, 4))
    with pytest.raises(TypeError, match=r"draws a DTensor, its spec, or a shape"):
        visualize_sharding("tensor")
    t = sw.distribute_tensor(torch.empty(4, device="meta"), sw.AbstractMesh((2,)), [Shard(0)])
    with pytest.raises(ValueError, match=r"the layout is the tensor's own"):
        visualize_sharding(t, placements=[Replicate()])
    with pytest.raises(TypeError, match=r"layout_table takes an nn.Module"):
        layout_table("model")  # type: ignore[arg-type]
