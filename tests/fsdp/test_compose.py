"""`fully_shard` with what a training loop wraps around it: gradient clipping, foreach / fused
AdamW, activation checkpointing, checkpoints saved on one mesh and loaded on another, a dry run."""

from __future__ import annotations

import re

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.testing import distributed

from .test_fully_shard import ROWS, Block, Net, _batches, _full, _model, _torch_fsdp


class CheckpointedBlock(Block):
    """Checkpoints its own body (the recomputation reads the parameters without calling the module)."""

    reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x,  # type: ignore[no-any-return]
                                                 use_reentrant=self.reentrant)


class ReentrantBlock(CheckpointedBlock):
    reentrant = True


def _checkpointed(i: int = 0) -> Net:
    model = _model()
    for j, block in enumerate(model.blocks):  # every other block reentrant from block i
        block.__class__ = ReentrantBlock if (j + i) % 2 else CheckpointedBlock
    return model


def _train_clipped(model: nn.Module, batches: list[torch.Tensor], rows: slice, **adamw: bool) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw)
    norms = []
    for x in batches:
        model(x[rows]).square().mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        norms.append(float(_full(norm)))
        opt.step()
        opt.zero_grad()
    return norms


@distributed(world_size=4)
def test_clipping_foreach_and_fused_adamw_and_activation_checkpointing_match_torch_and_one_process() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    batches = _batches(4, torch.float64)
    one = _model()
    want = _train_clipped(one, batches, slice(None))
    theirs = _torch_fsdp(_checkpointed(), (4,))
    _train_clipped(theirs, batches, rows, foreach=True)
    mesh = sw.init_device_mesh("cpu", (4,))
    for fused in (False, True):
        ours = _checkpointed(int(fused))
        for block in ours.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(ours, mesh=mesh)
        got = _train_clipped(ours, batches, rows, **({"fused": True} if fused else {"foreach": True}))
        assert max(got) > 0.05  # clipping was active
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-10, rtol=0)
        for (name, p), (_, q), (_, r) in zip(ours.named_parameters(), theirs.named_parameters(),
                                             one.named_parameters()):
            torch.testing.assert_close(_full(p), _full(q), atol=1e-10, rtol=0, msg=lambda m: f"{name} vs torch: {m}")
            torch.testing.assert_close(_full(p), r.detach(), atol=1e-10, rtol=0, msg=lambda m: f"{name}: {m}")


@distributed(world_size=4)
def test_a_checkpoint_saved_on_4_ranks_loads_onto_an_hsdp_mesh(tmp_path_factory: object = None) -> None:
    import tempfile

    import torch.distributed as dist

    import shardwise.checkpoint as dcp

    flat = _model()
    for block in flat.blocks:
        fully_shard(block, mesh=sw.init_device_mesh("cpu", (4,)))
    fully_shard(flat, mesh=sw.init_device_mesh("cpu", (4,)))
    x = torch.randn(ROWS, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    flat(x).sum().backward()
    torch.optim.SGD(flat.parameters(), lr=0.1).step()  # weights that differ from the init
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(flat.state_dict(), checkpoint_id=path[0])
    hsdp_mesh = sw.init_device_mesh("cpu", (2, 2))
    hsdp = _model()
    for block in hsdp.blocks:
        fully_shard(block, mesh=hsdp_mesh)
    fully_shard(hsdp, mesh=hsdp_mesh)
    state = hsdp.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    hsdp.load_state_dict(state)
    for (name, p), (_, q) in zip(hsdp.named_parameters(), flat.named_parameters()):
        assert [str(x) for x in p.placements] == ["R", "S(0)"], name
        assert torch.equal(_full(p), _full(q)), name
    assert torch.equal(hsdp(x), flat(x))


def test_dry_run_of_a_fully_sharded_llama_on_an_abstract_mesh_counts_one_collective_per_unit_and_pass() -> None:
    # planning an 8-rank fully_shard step on one process: no process group, meta tensors
    transformers = pytest.importorskip("transformers")
    from shardwise.debug import dry_run

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    mesh = sw.AbstractMesh((8,), ("dp",))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    report = dry_run(step, model, opt, torch.randint(0, 256, (1, 32)), mesh=mesh)
    text = str(report)
    # 5 units (4 layers + the root) gathered in forward, the 4 layers again in backward, 5 reduce_scatters
    assert re.search(r"forward\s+all_gather\s+dp\s+5\b", text), text[:600]
    assert re.search(r"backward\s+all_gather\s+dp\s+4\b", text), text[:600]
    assert re.search(r"backward\s+reduce_scatter\s+dp\s+5\b", text), text[:600]
    layer = model.model.layers[0].mlp.up_proj.weight
    assert layer._local_tensor.is_meta and layer._local_tensor.shape == (16, 64)  # 128 rows over 8 ranks


def test_dry_run_of_reshard_to_a_smaller_group_gathers_over_that_group_in_backward() -> None:
    # reshard_after_forward=2 on 8 ranks: forward gathers over the 8, backward over pairs
    from shardwise.debug import dry_run

    mesh = sw.AbstractMesh((8,), ("dp",))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    report = dry_run(step, model, opt, torch.randn(4, 16), mesh=mesh, ranks=range(8))
    for rank in range(8):
        gathers = [c.group_size for c in report.rank(rank).collectives if c.kind == "all_gather"]
        assert gathers == [8, 8, 8, 2, 2, 2], (rank, gathers)
