"""Tensor-parallel styles: frozen values, the placements they give, and single-device parity through their hooks.

Every multi-rank test runs on a 1-D mesh of 4 ranks and on the tp sub-mesh of a (2, 2)
(dp, tp) mesh, with sizes that do not divide the mesh (uneven, non-empty pieces), and
checks outputs and the gradients of parameters and inputs against the single-device module.
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
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from shardwise.parallel import _style
from shardwise.testing import distributed

TOL = {"atol": 1e-5, "rtol": 1e-5}


class Conv1D(nn.Module):
    """Hugging Face GPT-2's linear layer: weight (in, out), `nf` output features, addmm forward."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class Mlp(nn.Module):
    def __init__(self, conv1d: bool, hidden: int = 8) -> None:
        super().__init__()
        self.up = Conv1D(hidden, 4) if conv1d else nn.Linear(4, hidden)
        self.down = Conv1D(4, hidden) if conv1d else nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_mesh(shape: tuple[int, ...]) -> sw.DeviceMesh:
    if len(shape) == 1:
        return sw.init_device_mesh("cpu", shape, mesh_dim_names=("tp",))
    return sw.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))["tp"]


def _check_grads(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, f"{what}: no grad for {name}"
        torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")


# -- values (no processes) ------------------------------------------------------------------------

STYLES = [
    ColwiseParallel(),
    ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate(), use_local_output=False),
    RowwiseParallel(),
    RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), src_data_rank=None),
    SequenceParallel(sequence_dim=0, use_local_output=True),
    PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)),
    PrepareModuleInput(input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Replicate()}),
    PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
]


@pytest.mark.parametrize("style", STYLES, ids=repr)
def test_styles_are_frozen_hashable_values_whose_repr_round_trips(style: ParallelStyle) -> None:
    assert eval(repr(style), {**vars(sw), **{type(style).__name__: type(style)}}) == style
    assert hash(style) == hash(copy.deepcopy(style)) and style == copy.deepcopy(style)
    with pytest.raises(dataclasses.FrozenInstanceError):
        style.use_local_output = not style.use_local_output  # type: ignore[misc]


def test_styles_are_canonicalised_on_construction() -> None:
    assert ColwiseParallel() == ColwiseParallel(input_layouts=Replicate(), output_layouts=(Shard(-1),))
    assert RowwiseParallel().output_layouts == Replicate() and RowwiseParallel().input_layouts is None
    assert PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=[Replicate()]) == PrepareModuleInput(
        input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)
    )
    assert PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate()).output_layouts == (Shard(0),)


def test_bad_style_arguments_say_what_to_give() -> None:
    with pytest.raises(TypeError, match="input_layouts must be a Placement"):
        ColwiseParallel(input_layouts="tp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give one desired layout per input layout"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match="give one desired layout per input layout"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(ValueError, match=r"input_kwarg_layouts for \['y'\] and desired_input_kwarg_layouts for \['z'\]"):
        PrepareModuleInput(input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"z": Replicate()})
    with pytest.raises(ValueError, match="give one desired layout per output layout"):
        PrepareModuleOutput(output_layouts=(Shard(0), Shard(1)), desired_output_layouts=Replicate())
    with pytest.raises(TypeError, match="sequence_dim must be an int"):
        SequenceParallel(sequence_dim="1")  # type: ignore[arg-type]


def test_conv1d_is_recognised_by_shape_not_by_type() -> None:
    assert _style.module_kind(Conv1D(6, 4)) == "conv1d"
    assert _style.module_kind(nn.Linear(4, 6)) == "linear" and _style.module_kind(nn.Embedding(3, 2)) == "embedding"
    no_nf = Conv1D(6, 4)
    del no_nf.nf
    assert _style.module_kind(no_nf) is None and _style.module_kind(nn.LayerNorm(3)) is None


def test_param_layouts_follow_the_megatron_table() -> None:
    tp = sw.AbstractMesh((4,), ("tp",))
    col, row = ColwiseParallel(), RowwiseParallel()
    assert col.param_layouts(nn.Linear(4, 8), tp) == {"weight": (Shard(0),), "bias": (Shard(0),)}
    assert row.param_layouts(nn.Linear(4, 8), tp) == {"weight": (Shard(1),), "bias": (Replicate(),)}
    assert col.param_layouts(nn.Embedding(8, 4), tp) == {"weight": (Shard(1),)}
    assert row.param_layouts(nn.Embedding(8, 4), tp) == {"weight": (Shard(0),)}
    assert col.param_layouts(Conv1D(8, 4), tp) == {"weight": (Shard(1),), "bias": (Shard(0),)}
    assert row.param_layouts(Conv1D(8, 4), tp) == {"weight": (Shard(0),), "bias": (Replicate(),)}


def test_style_module_doctests_pass() -> None:
    assert doctest.testmod(_style).failed == 0


# -- multi-rank ------------------------------------------------------------------------------------

MESHES = {"(4,)": (4,), "tp of (2, 2)": (2, 2)}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@distributed(world_size=4)
def test_colwise_then_rowwise_matches_single_device(mesh_name: str) -> None:
    tp = _tp_mesh(MESHES[mesh_name])
    # A local (plain) output goes into the row-split layer, which takes its last dim as the
    # weight's input features, so uneven hidden sizes (7: 2,2,2,1 on 4 ranks, 4,3 on 2) work
    # with local outputs too (torch reads the uneven piece as even and fails in the matmul).
    cases = [(conv1d, hidden, local) for conv1d in (False, True) for hidden in (8, 7) for local in (True, False)]
    for conv1d, hidden, local in cases:
        what = f"{'Conv1D' if conv1d else 'Linear'} MLP, hidden {hidden}, local outputs {local}, on {mesh_name}"
        torch.manual_seed(0)
        ref = Mlp(conv1d, hidden)
        model = copy.deepcopy(ref)
        col, row = ColwiseParallel(use_local_output=local), RowwiseParallel()
        before = (copy.deepcopy(col), copy.deepcopy(row), repr(col), repr(row))
        parallelize_module(model, tp, {"up": col, "down": row})
        assert (col, row, repr(col), repr(row)) == before, "applying a style must not change it"

        w_up, w_down = (Shard(1), Shard(0)) if conv1d else (Shard(0), Shard(1))
        assert model.up.weight.placements == (w_up,) and model.up.bias.placements == (Shard(0),)
        assert model.down.weight.placements == (w_down,) and model.down.bias.placements == (Replicate(),)

        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        got, want = model(x), ref(x_ref)
        assert type(got) is torch.Tensor  # use_local_output=True: a plain (replicated) tensor
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what} output: {m}")
        (got * torch.arange(4.0)).sum().backward()
        (want * torch.arange(4.0)).sum().backward()
        _check_grads(model, ref, what)
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")


@pytest.mark.parametrize("mesh_name", list(MESHES))
@distributed(world_size=4)
def test_embedding_sequence_and_prepare_styles_match_single_device(mesh_name: str) -> None:
    tp = _tp_mesh(MESHES[mesh_name])
    n, rank = tp.size(), tp.get_local_rank()
    ids = torch.tensor([[1, 9, 3], [9, 0, 4]])

    # vocab-sharded embedding (10 rows: 3,3,3,1 on 4 ranks): the lookup is Partial, the hook all-reduces it
    torch.manual_seed(0)
    ref = nn.Embedding(10, 7)
    model = parallelize_module(copy.deepcopy(ref), tp, RowwiseParallel())
    assert model.weight.placements == (Shard(0),)
    got = model(ids)
    torch.testing.assert_close(got, ref(ids))
    (got * torch.arange(7.0)).sum().backward()
    (ref(ids) * torch.arange(7.0)).sum().backward()
    _check_grads(model, ref, "rowwise embedding")

    # embedding-dim sharded (7 columns: 2,2,2,1 on 4 ranks): the output stays split on its last dim
    ref.zero_grad()
    model = parallelize_module(copy.deepcopy(ref), tp, ColwiseParallel(use_local_output=False))
    got = model(ids)
    assert got.placements == (Shard(2),)
    torch.testing.assert_close(got.full_tensor(), ref(ids))
    (got.full_tensor() * torch.arange(7.0)).sum().backward()
    (ref(ids) * torch.arange(7.0)).sum().backward()
    _check_grads(model, ref, "colwise embedding")

    # sequence parallel layer norm: a plain input is this rank's piece of the sequence (8 = 2 per rank on 4)
    torch.manual_seed(0)
    ref_ln = nn.LayerNorm(5)
    with torch.no_grad():
        ref_ln.weight.uniform_(0.5, 1.5)  # not the ones init: the style must copy real values
    ln = parallelize_module(copy.deepcopy(ref_ln), tp, SequenceParallel())
    x = torch.randn(2, 8, 5, generator=torch.Generator().manual_seed(2))
    piece = x.chunk(n, dim=1)[rank].clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    out = ln(piece)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), ref_ln(x_ref), **TOL)
    (out.full_tensor() ** 2).sum().backward()
    (ref_ln(x_ref) ** 2).sum().backward()
    _check_grads(ln, ref_ln, "sequence parallel")
    torch.testing.assert_close(piece.grad, x_ref.grad.chunk(n, dim=1)[rank], **TOL)
    # a DTensor input is redistributed to the sequence split, uneven (7 = 2,2,2,1 on 4)
    x7 = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(3))
    out = ln(sw.distribute_tensor(x7, tp, [Replicate()]))
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), ref_ln(x7), **TOL)

    # PrepareModuleInput / Output: rows arrive split, the module sees them whole, the output leaves split
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, k: float, *, y: Any = None) -> torch.Tensor:
            self.seen = (x.placements, None if y is None else y.placements)
            return x * k if y is None else x * k + y

    rows = torch.randn(8, 3, generator=torch.Generator().manual_seed(4))
    mine = rows.chunk(n)[rank].clone().requires_grad_(True)
    scale = parallelize_module(
        Scale(), tp, PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None))
    )
    parallelize_module(scale, tp, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    out = scale(mine, 3.0)
    assert scale.seen == ((Replicate(),), None) and type(out) is torch.Tensor
    torch.testing.assert_close(out, 3.0 * rows.chunk(n)[rank])
    (out * out).sum().backward()
    torch.testing.assert_close(mine.grad, 18.0 * rows.chunk(n)[rank])

    kw = parallelize_module(
        Scale(), tp, PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None),
                                        input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Replicate()})
    )
    out = kw(rows, 2.0, y=rows.chunk(n)[rank])
    assert kw.seen == ((Replicate(),), (Replicate(),))
    torch.testing.assert_close(out.full_tensor(), 3.0 * rows)

    # PrepareModuleInputOutput: both sides in one style, the same as the two styles above
    both = parallelize_module(Scale(), tp, PrepareModuleInputOutput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    again = rows.chunk(n)[rank].clone().requires_grad_(True)
    out = both(again, 3.0)
    assert both.seen == ((Replicate(),), None) and type(out) is torch.Tensor
    torch.testing.assert_close(out, 3.0 * rows.chunk(n)[rank])
    (out * out).sum().backward()
    torch.testing.assert_close(again.grad, 18.0 * rows.chunk(n)[rank])
    with pytest.raises(ValueError, match="one desired layout per input layout"):
        PrepareModuleInputOutput(input_layouts=Shard(0), output_layouts=Replicate(), desired_output_layouts=Shard(0))


@distributed(world_size=4)
def test_parallelize_module_checks_its_plan_before_any_collective() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Mlp(conv1d=False)
    with sw.comm_log() as log:
        with pytest.raises(ValueError, match=r"parallelize_module takes a 1-D mesh, got shape \(2, 2\) with dims \('dp', 'tp'\): pass the tensor-parallel sub-mesh, e.g. mesh\['tp'\]"):
            parallelize_module(model, mesh, {"up": ColwiseParallel()})
        with pytest.raises(ValueError, match=r"(?s)has 2 problem\(s\).*'upp' matches no submodule of Mlp \(did you mean 'up'\?\).*<root>: RowwiseParallel cannot apply to Mlp"):
            parallelize_module(model, mesh["tp"], {"upp": ColwiseParallel(), "": RowwiseParallel()})
    assert log == []
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
@distributed(world_size=4)
def test_rowwise_replicated_bias_gets_a_replicated_gradient_and_the_optimizer_moves_nothing(
    mesh_shape: tuple[int, ...]
) -> None:
    # Regression: summing the replicated output gradient into the bias gradient chose to chunk
    # it (less memory, same zero cost), so the Replicate bias got a Shard(0) gradient and every
    # optimizer op on it all_gathered it back.
    mesh = sw.DeviceMesh("cpu", list(range(mesh_shape[0])))
    if mesh.get_coordinate() is None:
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    bias = model[2].bias
    assert bias.placements == (Replicate(),) and bias.grad.placements == (Replicate(),)
    torch.testing.assert_close(bias.grad.to_local(), ref[2].bias.grad)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with sw.comm_log() as log:
        opt.step()
    assert log == [], [r.op for r in log]
