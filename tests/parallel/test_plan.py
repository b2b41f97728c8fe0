"""ShardingPlan values, their all-at-once validation, and shard_module applying them.

Validation is pure, so its messages are tested without processes on an AbstractMesh; the
multi-rank tests check that a bad plan fails before any collective runs, and that a plan
with parameter layouts (placements and partition specs), an output layout and a local
output computes what the single-device module computes, gradients included.
"""

from __future__ import annotations

import copy
import dataclasses
import doctest
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise._layout import Layout
from shardwise import AbstractMesh, DTensor, Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    Sharder,
    ShardingPlan,
    ShardingPlanner,
    shard_module,
)
from shardwise.parallel import _plan
from shardwise.testing import distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.q = nn.Linear(8, 8)
        self.small = nn.Linear(8, 3)  # 3 rows: an empty piece on 4 ranks
        self.proj = nn.Linear(8, 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.tok.weight


TP4 = AbstractMesh((4,), ("tp",))


# -- values ------------------------------------------------------------------------------------


def test_plans_are_canonical_frozen_hashable_values() -> None:
    a = ShardingPlan({"x.weight": Shard(0), "y.weight": [None, ("tp",)], "z": ColwiseParallel()}, {"z": [Replicate()]}, ["z"])
    b = ShardingPlan({"x.weight": (Shard(0),), "y.weight": (None, "tp"), "z": ColwiseParallel()}, {"z": (Replicate(),)}, ("z",))
    assert a == b and hash(a) == hash(b)
    assert a.plan["y.weight"] == (None, "tp") and a.return_local_tensor == ("z",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.plan = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.plan["w"] = (Shard(0),)  # type: ignore[index]
    assert eval(repr(a), {**vars(sw), "ShardingPlan": ShardingPlan, "ColwiseParallel": ColwiseParallel}) == a


def test_malformed_plans_are_type_errors_listing_every_entry() -> None:
    with pytest.raises(TypeError) as err:
        ShardingPlan({"a": 3, "b": (Shard(0), "tp"), 4: Shard(0)}, return_local_tensor="a")  # type: ignore[dict-item]
    msg = str(err.value)
    assert "plan['a'] = 3 is not a layout" in msg
    assert "plan['b'][0] = Shard(dim=0): a layout is all placements" in msg
    assert "plan key 4 is not a str" in msg
    assert "write ['a'] for one module" in msg


def test_sharders_and_planners_are_abstract() -> None:
    with pytest.raises(TypeError):
        Sharder()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        ShardingPlanner()  # type: ignore[abstract]


def test_patterns_match_atom_by_atom() -> None:
    assert _plan.match("blocks.*.q", "blocks.0.q") and _plan.match("blocks.*.q", "blocks.12.q")
    assert not _plan.match("blocks.*.q", "blocks.0.attn.q") and not _plan.match("blocks.*", "blocks")
    assert _plan.match("", "") and not _plan.match("", "blocks") and not _plan.match("*", "")


def test_partition_specs_map_to_placements_and_split_order() -> None:
    mesh = AbstractMesh((2, 2), ("dp", "tp"))
    assert _plan.to_layout((None, "tp"), mesh, 2) == Layout((Replicate(), Shard(1)))
    assert _plan.to_layout((("dp", "tp"),), mesh, 2) == Layout((Shard(0), Shard(0)))
    assert _plan.to_layout((("tp", "dp"),), mesh, 2) == Layout((Shard(0), Shard(0)), ((0, (1, 0)),))
    assert _plan.to_layout((), mesh, 3) == Layout((Replicate(), Replicate()))
    with pytest.raises(ValueError, match="uses mesh dim 'tp' for tensor dims 0 and 1"):
        _plan.to_layout(("tp", "tp"), mesh, 2)


def test_plan_module_doctests_pass() -> None:
    assert doctest.testmod(_plan).failed == 0


# -- validation ----------------------------------------------------------------------------------


def test_validation_reports_every_problem_at_once_with_its_path() -> None:
    plan = ShardingPlan({
        "blocks.*.qq": ColwiseParallel(),  # matches nothing
        "blocks.0.q.weight": (Shard(2),),  # tensor dim out of range
        "blocks.1.small.weight": (Shard(0),),  # 3 rows on 4 ranks: rank 3 gets nothing
        "blocks.*.ln": ColwiseParallel(),  # a style on a module type it cannot shard
        "blocks.0.proj.weight": (None, "dp"),  # a mesh dim that does not exist
    })
    with pytest.raises(ValueError) as err:
        plan.validate(Net(), TP4)
    msg = str(err.value)
    assert msg.startswith("ShardingPlan for Net on a mesh of shape (4,) ('tp',) has 6 problem(s):"), msg
    lines = msg.splitlines()[1:]
    assert len(lines) == 6
    assert lines[0].startswith("  - 'blocks.*.qq' matches no submodule of Net (did you mean ") and "'blocks.0.q'" in lines[0]
    assert lines[1].startswith("  - blocks.0.q.weight (shape (8, 8)): placements[0] = S(2) is out of range for a 2-D tensor")
    assert lines[2].startswith("  - blocks.1.small.weight (shape (3, 8)): (S(0)) splits tensor dim 0 of size 3 over mesh dim 'tp' of size 4, leaving the rank at 'tp'=3 an empty piece")
    assert "uneven but non-empty pieces are fine" in lines[2]
    for i, block in ((3, "blocks.0.ln"), (4, "blocks.1.ln")):
        assert lines[i].startswith(f"  - {block}: ColwiseParallel cannot apply to LayerNorm: it shards nn.Linear, nn.Embedding and Conv1D")
    assert lines[5].startswith("  - blocks.0.proj.weight (shape (8, 8)): partition spec (None, 'dp') names mesh dim 'dp', which does not exist: the mesh's dims are ('tp',)")


def test_uneven_but_non_empty_pieces_and_a_consistent_tied_weight_are_fine() -> None:
    plan = ShardingPlan({
        "blocks.*.small.weight": (Shard(0),),  # 3 rows on 2 ranks: 2 + 1
        "tok": RowwiseParallel(input_layouts=Replicate()),  # tok.weight S(0) ...
        "head": ColwiseParallel(),  # ... and head.weight (the same tensor) S(0) too
    })
    plan.validate(Net(), AbstractMesh((2,), ("tp",)))


def test_a_tied_weight_given_two_layouts_is_reported() -> None:
    plan = ShardingPlan({"tok": RowwiseParallel(), "head": RowwiseParallel()})  # S(0) vs S(1)
    with pytest.raises(ValueError, match=r"(?s)tok.weight: one parameter is given different layouts \(tok.weight \(S\(0\)\) from RowwiseParallel.*head.weight \(S\(1\)\) from RowwiseParallel"):
        plan.validate(Net(), TP4)


def test_names_of_the_wrong_kind_get_a_hint() -> None:
    with pytest.raises(ValueError) as err:
        ShardingPlan({"blocks.0.q": (Shard(0),), "blocks.0.q.weight": ColwiseParallel()}).validate(Net(), TP4)
    msg = str(err.value)
    assert "'blocks.0.q' matches no parameter of Net: it names a module: a layout applies to one parameter" in msg
    assert "'blocks.0.q.weight' matches no submodule of Net: it names a parameter: a Sharder applies to a module" in msg


def test_styles_need_a_one_dimensional_mesh() -> None:
    with pytest.raises(ValueError, match=r"ColwiseParallel needs a 1-D mesh, got shape \(2, 2\) with dims \('dp', 'tp'\): pass the tensor-parallel sub-mesh, e.g. mesh\['tp'\]"):
        ShardingPlan({"blocks.0.q": ColwiseParallel()}).validate(Net(), AbstractMesh((2, 2), ("dp", "tp")))


def test_output_plan_and_local_outputs_are_checked_too() -> None:
    plan = ShardingPlan({}, output_plan={"blocks.9": (Replicate(),), "head": ("dp",), "tok": (Replicate(), Replicate())},
                        return_local_tensor=["nope"])
    with pytest.raises(ValueError) as err:
        plan.validate(Net(), TP4)
    msg = str(err.value)
    assert "has 4 problem(s)" in msg
    assert "output_plan: 'blocks.9' matches no submodule" in msg
    assert "output_plan['head']: partition spec ('dp',) names mesh dim 'dp'" in msg
    assert "output_plan['tok']: (R, R) has 2 placements but the mesh has 1 dims" in msg
    assert "return_local_tensor: 'nope' matches no submodule" in msg


# -- multi-rank ------------------------------------------------------------------------------------


@distributed(world_size=4)
def test_an_invalid_plan_fails_before_any_collective() -> None:
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = Net()
    before = {n: p for n, p in model.named_parameters()}
    plan = ShardingPlan({"blocks.*.q": ColwiseParallel(), "blocks.0.small.weight": (Shard(0),)})
    with sw.comm_log() as log:
        with pytest.raises(ValueError, match="blocks.0.small.weight"):
            shard_module(model, plan, mesh)
    assert log == []
    assert {n: p for n, p in model.named_parameters()} == before  # nothing was touched


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 10)
        self.b = nn.Linear(10, 5)
        self.c = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@distributed(world_size=4)
def test_layouts_output_plan_and_local_outputs_match_single_device() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = Mlp()
    model = copy.deepcopy(ref)
    plan = ShardingPlan(
        {
            "a.weight": (("dp", "tp"), None),  # 10 rows split by dp, then tp: 3,2 | 3,2 (uneven)
            "b.weight": (None, "tp"),  # Shard(1) on tp
            "b.bias": (Shard(0), Replicate()),
        },
        output_plan={"b": ("dp",)},  # the output redistributed to rows split on dp
        return_local_tensor=["c"],
    )
    shard_module(model, plan, mesh)
    assert model.a.weight.placements == (Shard(0), Shard(0)) and model.a.weight.shard_order == ()  # mesh-dim order: nothing to name
    assert model.b.weight.placements == (Replicate(), Shard(1))
    assert model.c.weight.placements == (Replicate(), Replicate())

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    seen: list[Any] = []
    model.c.register_forward_pre_hook(lambda m, args: seen.append(args[0].placements))
    with sw.implicit_replication():
        got = model(sw.distribute_tensor(x, mesh, [Replicate(), Replicate()]))
    want = ref(x)
    assert seen == [(Shard(0), Replicate())]
    assert type(got) is torch.Tensor  # return_local_tensor: this rank's rows (split on dp)
    coord = mesh.get_coordinate()
    assert coord is not None
    rows = [(0, 3), (3, 2)][coord[0]]
    torch.testing.assert_close(got, want[rows[0] : rows[0] + rows[1]], atol=1e-6, rtol=1e-5)

    # the gradient of a local output flows back as Shard(0) on dp: each rank's rows
    got.sum().backward()
    want.sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad {name}: {m}")


@distributed(world_size=4)
def test_ranks_given_different_plans_all_raise_naming_them_instead_of_aborting_in_gloo() -> None:
    # regression: a layout solver stopped by its time limit on a loaded machine gave rank 3 another
    # plan; the first collective of shard_module then mismatched and gloo aborted the process
    import torch.distributed as dist

    mesh = sw.init_device_mesh("cpu", (4,))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    entry = (Shard(1),) if dist.get_rank() == 3 else (Shard(0),)
    with pytest.raises(ValueError, match=r"were given different plans \(rank\(s\) \[3\] differ from rank 0\)"):
        shard_module(model, ShardingPlan({"0.weight": entry}), mesh)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing was placed
    shard_module(model, ShardingPlan({"0.weight": (Shard(0),)}), mesh)  # the same plan everywhere: placed
