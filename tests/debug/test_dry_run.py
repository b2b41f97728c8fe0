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


def _mlp(mesh: Any) -> tuple[Any, Any]:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.ReLU(), torch.nn.Linear(30, 8))  # 30 / 4: uneven
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _mlp_step(model: Any, opt: Any, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _real_mlp() -> tuple[list[tuple[str, int, int]], dict[str, int]]:
    model, opt = _mlp(sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
    with sw.comm_log() as log:
        _mlp_step(model, opt, torch.randn(5, 8, requires_grad=True))
    return [(r.op, r.group_size, r.bytes_received) for r in log], _held(model, opt)


def test_uneven_pieces_make_ranks_differ_and_each_simulated_rank_holds_its_own() -> None:
    real = run_distributed(_real_mlp, 4)
    mesh = sw.AbstractMesh((4,), ("tp",))
    with torch.device("meta"):
        model, opt = _mlp(mesh)
    report = dry_run(_mlp_step, model, opt, torch.randn(5, 8, requires_grad=True), mesh=mesh, ranks=[3, 0, 1, 2])
    assert [r.rank for r in report.ranks] == [3, 0, 1, 2]
    for rank, (log, held) in enumerate(real):
        mine = report.rank(rank)
        assert [(c.kind, c.group_size, c.bytes) for c in mine.collectives] == log, rank
        assert {k: mine.memory.peaks[k] for k in held} == held, rank
        assert mine.uneven == ["tp"]
    assert real[0][1]["parameters"] > real[3][1]["parameters"]  # 8 rows of 30 on rank 0, 6 on rank 3
    assert not report.symmetric() and "uneven along tp" in str(report)
    assert tuple(model[0].weight._local_tensor.shape) == (8, 8)  # back to rank 0's piece after the run

    def broken(model: Any) -> None:
        model(torch.randn(5, 7))  # 7 features for a layer of 8

    with pytest.raises(RuntimeError) as caught:
        dry_run(broken, model, mesh=mesh, ranks=[2])
    assert any("on simulated rank 2 of a dry run" in n for n in getattr(caught.value, "__notes__", [])), caught.value
    with pytest.raises(KeyError, match=r"rank 5 was not simulated"):
        report.rank(5)


def test_explicit_mode_finds_hidden_communication_in_a_dry_run() -> None:
    mesh = sw.AbstractMesh((8, 8), ("dp", "tp"))
    x = sw.distribute_tensor(torch.empty(64, 32, device="meta"), mesh, [sw.Shard(0), sw.Replicate()])
    w1 = sw.distribute_tensor(torch.empty(32, 64, device="meta"), mesh, [sw.Replicate(), sw.Shard(1)])
    w2 = sw.distribute_tensor(torch.empty(64, 32, device="meta"), mesh, [sw.Replicate(), sw.Shard(1)])

    def step(x: Any, w1: Any, w2: Any) -> None:
        with sw.explicit():
            torch.relu(x @ w1) @ w2

    with pytest.raises(sw.ImplicitRedistributionError, match=r"aten.mm.default would redistribute"):
        dry_run(step, x, w1, w2, mesh=mesh)

    def written(x: Any, w1: Any, w2: Any) -> None:
        with sw.explicit():
            torch.relu(x @ w1) @ w2.redistribute(w2.device_mesh, [sw.Replicate(), sw.Shard(0)])

    report = dry_run(written, x, w1, w2, mesh=mesh)
    # w2's local (64, 4) columns become (8, 32) rows: an all_to_all keeping 1/8 of the piece
    assert report.totals() == {"all_to_all": (1, 7 * 64 * 4 * 4 // 8)}
    assert [c.mesh_dims for c in report.collectives] == [("tp",)]


def test_bad_calls_are_refused_with_the_fix() -> None:
    mesh = sw.AbstractMesh((2, 2), ("dp", "tp"))
    with pytest.raises(TypeError, match=r"dry_run\(mesh=...\) takes an AbstractMesh"):
        dry_run(lambda: None, mesh=(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"give ranks of the mesh \(2, 2\), ints in \[0, 3\], each once"):
        dry_run(lambda: None, mesh=mesh, ranks=[4])
    with pytest.raises(ValueError, match=r"each once"):
        dry_run(lambda: None, mesh=mesh, ranks=[1, 1])
    other = sw.distribute_tensor(torch.empty(4, 4, device="meta"), sw.AbstractMesh((4,)), [sw.Shard(0)])
    with pytest.raises(ValueError, match=r"not on DryMesh\(\(2, 2\)"):
        dry_run(lambda t: None, other, mesh=mesh)
    with pytest.raises(TypeError, match=r"dry_run runs a callable"):
        dry_run(3, mesh=mesh)  # type: ignore[arg-type]


def _pipeline(mesh: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    """The demo GPT as a 2-stage pipeline of 2-wide tensor-parallel stages (its head tied to
    the token embedding across the stages), one 1F1B step of 2 micro-batches and AdamW."""
    from shardwise._demo.model import CharGPT, CharGPTConfig, pipeline_layers
    from shardwise._demo.pipelined import _loss, pipeline_plan
    from shardwise.pipeline import DistributedPipe

    torch.manual_seed(0)
    layers = pipeline_layers(CharGPT(CharGPTConfig(vocab=VOCAB, d_model=WIDTH, seq=SEQ)))
    half = len(layers) // 2
    pipe = DistributedPipe(layers, [half, len(layers) - half], mesh, tp_plan=pipeline_plan(), schedule="1f1b",
                           chunks=2, checkpoint="never", loss_fn=_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.step(x, y)
    opt.step()
    return pipe, opt


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _real_pipeline() -> tuple[list[tuple[str, int, int]], dict[str, int]]:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with sw.comm_log() as log:
        pipe, opt = _pipeline(mesh, *_batch())
    pipe.close()
    return [(r.op, r.group_size, r.bytes_received) for r in log], _held(pipe, opt)


def test_a_dry_run_of_a_pipeline_plays_every_stage_and_matches_the_real_ranks() -> None:
    """Each simulated rank builds its own pipe (it keeps only its stages); the ranks take turns
    where a stage waits for another's activations or gradients."""
    real = run_distributed(_real_pipeline, 4)
    mesh = sw.AbstractMesh((2, 2), ("pp", "tp"))
    report = dry_run(lambda: _pipeline(mesh, *_batch()), mesh=mesh, ranks=range(4))
    for rank, (log, held) in enumerate(real):
        mine = report.rank(rank)
        assert [(c.kind, c.group_size, c.bytes) for c in mine.collectives] == log, rank
        assert {k: mine.memory.peaks[k] for k in held} == held, rank
        assert sum(c.kind == "recv" for c in mine.collectives) == 2  # per micro-batch: a header, the activation inside
    with pytest.raises(RuntimeError, match=r"waits for a message from rank 2 .*rank 2 is not simulated"):
        dry_run(lambda: _pipeline(mesh, *_batch()), mesh=mesh, ranks=[0])


def test_a_step_blocked_on_what_a_dry_run_cannot_answer_fails_within_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setenv("SHARDWISE_COLLECTIVE_TIMEOUT", "1")
    release = threading.Event()
    try:
        with pytest.raises(RuntimeError, match=r"simulated ranks \[0\] did not finish within"):
            dry_run(lambda: release.wait(), mesh=sw.AbstractMesh((2,)))
    finally:
        release.set()  # the blocked thread ends


def _llama(mesh: Any) -> tuple[Any, Any]:
    """An unchanged Hugging Face Llama (GQA, sdpa), cut by MegatronPlanner over tp, ZeRO-3 over dp."""
    import transformers

    from shardwise.parallel import MegatronPlanner, data_parallel, shard_module

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    shard_module(model, MegatronPlanner(), mesh["tp"])
    data_parallel(model, mesh, dp_dim="dp", shard_parameters=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _llama_step(model: Any, opt: Any, ids: torch.Tensor) -> None:
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _real_llama() -> tuple[list[tuple[str, int, int]], dict[str, int]]:
    model, opt = _llama(sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    with sw.comm_log() as log:
        _llama_step(model, opt, torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3)))
    return [(r.op, r.group_size, r.bytes_received) for r in log], _held(model, opt)


def test_a_dry_run_of_an_unchanged_hugging_face_llama_matches_the_real_ranks() -> None:
    pytest.importorskip("transformers")
    real = run_distributed(_real_llama, 4)
    mesh = sw.AbstractMesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model, opt = _llama(mesh)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    report = dry_run(_llama_step, model, opt, ids, mesh=mesh, ranks=range(4))
    for rank, (log, held) in enumerate(real):
        mine = report.rank(rank)
        assert [(c.kind, c.group_size, c.bytes) for c in mine.collectives] == log, rank
        assert {k: mine.memory.peaks[k] for k in held} == held, rank
    assert sum(report.rank(0).flops.values()) > 0
