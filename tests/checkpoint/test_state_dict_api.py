"""`shardwise.checkpoint.state_dict` beside `torch.distributed.checkpoint.state_dict`, on the same program.

One MLP is sharded twice: by torch (its DTensor tensor parallelism on (4,); TP x its
`fully_shard` on (2, 2)) and by shardwise (the same plans), and both take one AdamW step on
the same batch. With an uneven hidden size (14 rows over 4 ranks), which torch's TP cannot
run, shardwise's is compared with the same MLP in one process instead. Then each library's functions are
asked for the full state dict (`full_state_dict=True`, with and without `cpu_offload`):
plain tensors with the same keys and values on both sides (rank 0 only with `cpu_offload`),
for the model and the optimizer. Loading a full state dict back into a differently seeded
model and a fresh optimizer, from every rank or from rank 0 alone (`broadcast_from_rank0`),
puts every tensor into the layout the model keeps (the optimizer's moments stay pieces), and
the next step equals torch's. torch's own `get_model_state_dict(full_state_dict=True)` on a
shardwise model hands the DTensors back ungathered, which is why this module exists.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_sd
from torch.distributed.checkpoint.state_dict import StateDictOptions

import shardwise as sw
from shardwise.checkpoint import state_dict as sw_sd
from shardwise.fsdp import fully_shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed


class _Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(10, hidden)
        self.down = nn.Linear(hidden, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _pair(mesh_shape: tuple[int, ...], seed: int, hidden: int) -> tuple[nn.Module, nn.Module]:
    """The MLP from `seed`, sharded by shardwise, and beside it the same MLP sharded by torch
    with the same plan (hidden 16), or (hidden 14: torch's TP cannot split it) left whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import parallel as tp

    torch.manual_seed(seed)
    theirs = _Mlp(hidden).double()
    ours = copy.deepcopy(theirs)
    names = ("tp",) if mesh_shape == (4,) else ("dp", "tp")
    smesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    parallelize_module(ours, smesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if mesh_shape != (4,):
        fully_shard(ours, mesh=smesh["dp"])
    if hidden % 4 == 0:
        tmesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        tp.parallelize_module(theirs, tmesh["tp"], {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
        if mesh_shape != (4,):
            torch_fully_shard(theirs, mesh=tmesh["dp"])
    return theirs, ours


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(5, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(x).pow(2).sum().backward()
    optimizer.step()


def _plain(state: Any) -> Any:
    """Every tensor of a state dict, asserting it is a plain tensor (gathered)."""
    if isinstance(state, torch.Tensor):
        assert type(state) is torch.Tensor, type(state).__name__
        return state
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    return state


def _same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where  # one step apart from torch's: rounding only
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _side_by_side(mesh_shape: tuple[int, ...], hidden: int) -> None:
    rank = torch.distributed.get_rank()
    theirs, ours = _pair(mesh_shape, 0, hidden)
    t_opt, s_opt = torch.optim.AdamW(theirs.parameters(), lr=0.1), torch.optim.AdamW(ours.parameters(), lr=0.1)
    _step(theirs, t_opt, 1)
    _step(ours, s_opt, 1)

    unsharded = torch_sd.get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
    assert any(isinstance(v, sw.DTensor) for v in unsharded.values())  # torch's own: nothing gathered

    for offload in (False, True):
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        want_model, want_optim = torch_sd.get_state_dict(theirs, t_opt, options=options)
        got_model, got_optim = sw_sd.get_state_dict(ours, s_opt, options=options)
        if offload and rank != 0:
            assert got_model == {} and got_optim == {} and want_model == {}
            continue
        _same(_plain(got_model), want_model, "model")
        _same(_plain(got_optim), want_optim, "optim")

    full_model, full_optim = sw_sd.get_state_dict(ours, s_opt, options=StateDictOptions(full_state_dict=True))
    for broadcast in (False, True):
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
        given = (full_model, full_optim) if rank == 0 or not broadcast else ({}, {})
        fresh_theirs, fresh_ours = _pair(mesh_shape, 2, hidden)
        ft_opt = torch.optim.AdamW(fresh_theirs.parameters(), lr=0.1)
        fs_opt = torch.optim.AdamW(fresh_ours.parameters(), lr=0.1)
        # torch's reference loads the full dicts on every rank (and puts its own DTensors into
        # the dicts it is given, so it gets copies)
        torch_sd.set_state_dict(fresh_theirs, ft_opt, model_state_dict=copy.deepcopy(full_model),
                                optim_state_dict=copy.deepcopy(full_optim),
                                options=StateDictOptions(full_state_dict=True))
        sw_sd.set_state_dict(fresh_ours, fs_opt, model_state_dict=given[0], optim_state_dict=given[1],
                             options=options)
        for name, p in fresh_ours.named_parameters():
            assert isinstance(p, sw.DTensor) and torch.equal(p.full_tensor(), full_model[name]), name
            moment = fs_opt.state[p]["exp_avg"]
            assert isinstance(moment, sw.DTensor) and moment.placements == p.placements, (name, moment)
            assert torch.equal(moment.full_tensor(), full_optim["state"][name]["exp_avg"]), name
        _step(fresh_theirs, ft_opt, 3)
        _step(fresh_ours, fs_opt, 3)
        want = {k: _full(v) for k, v in fresh_theirs.state_dict().items()}
        for k, v in fresh_ours.state_dict().items():
            torch.testing.assert_close(_full(v), want[k], rtol=0, atol=1e-12, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("hidden", [16, 14], ids=["beside-torch", "uneven-beside-one-process"])
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_full_state_dicts_equal_torchs_and_load_back_into_the_models_layouts(mesh_shape: tuple[int, ...],
                                                                             hidden: int) -> None:
    run_distributed(_side_by_side, 4, mesh_shape, hidden, timeout=300)


def _broadcast_without_full() -> None:
    model = _pair((4,), 0, 14)[1]
    with pytest.raises(ValueError, match="full_state_dict=True"):
        sw_sd.set_model_state_dict(model, {}, options=StateDictOptions(broadcast_from_rank0=True))


def test_broadcast_from_rank0_needs_a_full_state_dict() -> None:
    run_distributed(_broadcast_without_full, 4)
