"""`dry_run`: a step on an abstract mesh, with meta tensors, reports what a real run does.

The demo's GPT, sharded by its Megatron plan on a (4,) tp mesh, and on a (2, 2) dp x tp
mesh with ZeRO-3 over dp, runs one training step (forward, loss_parallel loss, backward,
AdamW step) on 4 real gloo ranks under `comm_log()`; the same model built on the meta
device and sharded on an `AbstractMesh` of the same shape runs the same step in a dry run
as each of the 4 ranks. Per rank, the dry run's collectives (kind, group size, bytes, in
order) equal the real log, and its parameter, gradient and optimizer-state bytes equal the
storage the real rank holds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.debug import dry_run
from shardwise.testing import run_distributed

MESHES = [((4,), ("tp",)), ((2, 2), ("dp", "tp"))]
IDS = ["tp4", "dp2-tp2-zero3"]
VOCAB, WIDTH, SEQ, BATCH = 16, 32, 8, 2


def _sharded(mesh: Any) -> tuple[Any, Any]:
    from shardwise._demo.model import CharGPT, CharGPTConfig
    from shardwise._demo.train import manual_plan
    from shardwise.parallel import data_parallel, parallelize_module

    torch.manual_seed(0)
    model = CharGPT(CharGPTConfig(vocab=VOCAB, d_model=WIDTH, seq=SEQ))
    parallelize_module(model, mesh["tp"], manual_plan(), replicate_rest=True)
    if "dp" in (mesh.mesh_dim_names or ()):
        data_parallel(model, mesh, dp_dim="dp", shard_parameters=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    from shardwise._demo.model import loss_fn
    from shardwise.parallel import loss_parallel

    opt.zero_grad()
    with loss_parallel():
        loss_fn(model(x), y).backward()
    opt.step()


def _held(model: Any, opt: Any) -> dict[str, int]:
    """Bytes of the storages this rank holds for parameters, gradients and optimizer state."""
    out = {}
    groups = {"parameters": list(model.parameters()), "gradients": [p.grad for p in model.parameters()],
              "optimizer": [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]}
    for name, tensors in groups.items():
        storages = {}
        for t in tensors:
            if t is not None:
                s = (t._local_tensor if isinstance(t, sw.DTensor) else t).untyped_storage()
                storages[s._cdata] = s.nbytes()
        out[name] = sum(storages.values())
    return out


def _real(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[list[tuple[str, int, int]], dict[str, int]]:
    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, opt = _sharded(mesh)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    with sw.comm_log() as log:
        _step(model, opt, x, y)
    return [(r.op, r.group_size, r.bytes_received) for r in log], _held(model, opt)


@pytest.mark.parametrize(("shape", "names"), MESHES, ids=IDS)
def test_a_dry_run_reports_what_each_real_rank_sends_and_holds(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    real = run_distributed(_real, 4, shape, names)
    mesh = sw.AbstractMesh(shape, names)
    with torch.device("meta"):
        model, opt = _sharded(mesh)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    report = dry_run(_step, model, opt, x, y, mesh=mesh, ranks=range(4))
    for rank, (log, held) in enumerate(real):
        mine = report.rank(rank)
        assert [(c.kind, c.group_size, c.bytes) for c in mine.collectives] == log, rank
        assert {k: mine.memory.peaks[k] for k in held} == held, rank
        assert mine.memory.peak >= sum(held.values())
    assert report.symmetric()
    text = str(report)
    assert "all_reduce" in text and "memory peak" in text
