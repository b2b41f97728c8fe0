"""`shardwise.compile` replays whole train steps under every parallelism, equal to eager.

A step is forward, backward, foreach AdamW's step and zero_grad, compiled with
`shardwise.compile` and run 5 times beside the same step in one process (float64): the
parameters must agree to 1e-10 and the step must replay one program, with no warning.
Parallelisms: ZeRO-3 (`fully_shard` per block and at the root, 2 ranks), DP x TP on
(2, 2) (tensor-parallel blocks, then `fully_shard` over dp), and the `ContextParallel()`
style on an HF Llama (2 ranks, the allgather, alltoall, Ulysses and ring rotations; the ring's
point-to-point messages are host steps of the graph, posted and waited where eager does). Regressions: a replayed
`fully_shard` step crashed the process (its gather buffers were freed and re-made by storage
resizes a trace did not see), and context parallel's per-call agreement exchanges made every
step run eagerly.
A pipeline stage's schedule replays too (gpipe, 1F1B, interleaved; stages plain, tensor-
parallel, or ZeRO-3 over dp): each message between ranks is one host step of the graph that
runs the wire protocol eager runs, headers included, so a rank whose replay goes wrong still
tells its peers at once.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

from ..models import ResidualMLP as Block


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _compare(model: nn.Module, ref: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor],
             ref_loss: Callable[[], torch.Tensor]) -> tuple[float, int, list[str]]:
    """5 compiled steps of `model` beside 5 eager steps of `ref`: the largest parameter
    difference, the programs compiled and the warnings."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        value = loss(model, batch)
        value.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        return value.detach()

    compiled = sw.compile(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            compiled(model, opt, batch)
            ref_loss().backward()  # type: ignore[no-untyped-call]
            ref_opt.step()
            ref_opt.zero_grad()
    err = max((_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return err, compiled.programs(), [str(w.message) for w in caught]


def _blocks() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    model, ref = nn.Sequential(Block(), Block()).double(), nn.Sequential(Block(), Block()).double()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _batches() -> torch.Tensor:
    return torch.randn(2, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _zero3() -> tuple[float, int, list[str]]:
    model, ref = _blocks()
    mesh = sw.init_device_mesh("cpu", (2,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = _batches()  # each rank its own batch: the mean of the two ranks' losses
    return _compare(model, ref, x[mesh.get_local_rank()], lambda m, b: m(b).square().sum(),
                    lambda: (ref(x[0]).square().sum() + ref(x[1]).square().sum()) / 2)


def _dp_x_tp() -> tuple[float, int, list[str]]:
    model, ref = _blocks()
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    x = _batches()
    return _compare(model, ref, x[mesh["dp"].get_local_rank()], lambda m, b: m(b).square().sum(),
                    lambda: (ref(x[0]).square().sum() + ref(x[1]).square().sum()) / 2)


def _context_parallel(rotation: str) -> tuple[float, int, list[str]]:
    transformers = pytest.importorskip("transformers")
    from shardwise.experimental import set_load_balance, set_rotate_method
    from shardwise.parallel import ContextParallel

    set_rotate_method(rotation)  # module-level options: set here, whatever an earlier test in this worker chose
    set_load_balance(True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).double()
    ref = transformers.LlamaForCausalLM(config).double()
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)), ContextParallel())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return _compare(model, ref, ids, lambda m, b: m(input_ids=b, labels=b).loss,
                    lambda: ref(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("name, ranks, body, args", [
    ("zero3", 2, _zero3, ()), ("dp x tp", 4, _dp_x_tp, ()),
    ("context parallel, allgather", 2, _context_parallel, ("allgather",)),
    ("context parallel, alltoall", 2, _context_parallel, ("alltoall",)),
    ("context parallel, ulysses", 2, _context_parallel, ("ulysses",)),
    ("context parallel, ring", 2, _context_parallel, ("ring",)),
])
def test_a_compiled_train_step_replays_one_program_equal_to_one_process(name: str, ranks: int, body: Any,
                                                                        args: tuple[Any, ...]) -> None:
    for rank, (err, programs, caught) in enumerate(run_distributed(body, ranks, *args, timeout=600)):
        assert not caught, (rank, caught)
        assert programs == 1, (rank, programs)
        assert err <= 1e-10, (rank, err)


def _pipeline(schedule: str, shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[list[float], int, list[str]]:
    """5 compiled steps of an MLP cut into stages beside the same model in one process (the
    whole batch): the largest difference of each step's loss and of every parameter this
    rank holds, after the last step; the programs compiled and the warnings."""
    from shardwise.pipeline import DistributedPipe

    from ..pipeline._mlp import PLAN, batch, mlp, one_process

    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp, d = (mesh.size("dp"), mesh.get_local_rank("dp")) if "dp" in names else (1, 0)
    balance = [2, 1, 2, 1] if schedule == "interleaved" else [3, 3]
    pipe = DistributedPipe(mlp(16), balance, mesh, schedule=schedule, chunks=4, loss_fn=F.mse_loss,
                           tp_plan=PLAN if "tp" in names else None, shard_parameters="dp" in names)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05, foreach=True)

    def step(pipe: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
        opt.zero_grad()
        loss = pipe.step(x, y)  # the loss on the last stage's ranks, None elsewhere
        opt.step()
        return loss

    compiled = sw.compile(step)
    expected = one_process(mlp(16), 8, 5)
    errors = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(5):
                x, y = batch(k, 8)
                loss = compiled(pipe, opt, x.chunk(dp)[d], y.chunk(dp)[d])
                if loss is not None:  # each dp replica's is its half's mean: their mean is the batch's
                    if dp > 1:
                        torch.distributed.all_reduce(loss, group=mesh.get_group("dp"))
                    errors.append(abs(loss.item() / dp - expected[k][0]))
    finally:
        pipe.close()  # (its process group: the worker process lives on into later tests)
    params = expected[-1][1]
    errors.append(max((_full(p) - params[name.split(".", 2)[2]]).abs().max().item()
                      for name, p in pipe.named_parameters()))
    return errors, compiled.programs(), [str(w.message) for w in caught]


@pytest.mark.parametrize("schedule, shape, names", [
    ("1f1b", (2,), ("pp",)), ("gpipe", (2,), ("pp",)), ("interleaved", (2,), ("pp",)),
    ("1f1b", (2, 2), ("pp", "tp")), ("1f1b", (2, 2), ("dp", "pp")),
])
def test_a_compiled_pipeline_step_replays_its_schedule_equal_to_one_process(schedule: str, shape: tuple[int, ...],
                                                                            names: tuple[str, ...]) -> None:
    """A stage's schedule, its messages (header and payloads, as eager sends them)
    as host steps of the replayed graph: one program, every step's loss and the parameters
    equal to one process."""
    results = run_distributed(_pipeline, len(names) * 2, schedule, shape, names, timeout=600)
    for rank, (errors, programs, caught) in enumerate(results):
        assert not caught, (rank, caught)
        assert programs == 1, (rank, programs)
        assert max(errors) <= 1e-10, (rank, errors)
    assert sum(len(errors) for errors, _, _ in results) == 5 * len(results) // 2 + len(results)  # the losses came


def _pipeline_twice() -> tuple[float, int]:
    """One compiled function steps the pipe twice (two batches, one optimizer step): the two
    steps' messages share their tags, so the replay must match each receive to its own step."""
    from shardwise.pipeline import DistributedPipe

    from ..pipeline._mlp import batch, mlp

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipe = DistributedPipe(mlp(16), [3, 3], mesh, schedule="1f1b", chunks=2, loss_fn=F.mse_loss)
    ref = mlp(16)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)

    def step(pipe: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        pipe.step(x[:4], y[:4])
        pipe.step(x[4:], y[4:])  # gradients accumulate
        opt.step()
        opt.zero_grad()

    compiled = sw.compile(step)
    try:
        for k in range(4):
            x, y = batch(k, 8)
            compiled(pipe, opt, x, y)
            for half in (slice(0, 4), slice(4, 8)):
                F.mse_loss(ref(x[half]), y[half]).backward()  # type: ignore[no-untyped-call]
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        pipe.close()
    mine = [q for i, q in enumerate(ref.parameters()) if (i < 4) == (mesh.get_local_rank() == 0)]
    return max((p - q).abs().max().item() for p, q in zip(pipe.parameters(), mine)), compiled.programs()


def test_a_compiled_function_stepping_a_pipe_twice_replays_both_steps() -> None:
    for rank, (err, programs) in enumerate(run_distributed(_pipeline_twice, 2, timeout=300)):
        assert programs == 1 and err <= 1e-10, (rank, err, programs)


def _pipeline_ranks_disagree() -> str:
    """Rank 0 changes its batch's shape after 3 steps and traces again; rank 1 keeps its own
    and replays: its replay receives a message of other shapes than it was traced with."""
    from shardwise.pipeline import DistributedPipe, PipelineError

    from ..pipeline._mlp import batch, mlp

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipe = DistributedPipe(mlp(16), [3, 3], mesh, schedule="1f1b", chunks=4, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)

    def step(pipe: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        return loss

    compiled = sw.compile(step)
    x, y = batch(0, 8)
    try:
        for _ in range(3):
            compiled(pipe, opt, x, y)
        assert compiled.programs() == 1
        try:
            compiled(pipe, opt, x[:4] if mesh.get_local_rank() == 0 else x, y)
        except (PipelineError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    finally:
        pipe.close()


def test_a_replayed_pipeline_step_that_receives_other_shapes_fails_on_every_rank_at_once() -> None:
    """The replay reads every message's header: the rank whose message disagrees with its trace
    raises naming both shapes, and tells the stage waiting on it, which stops with
    PipelineError instead of waiting for the timeout."""
    rank0, rank1 = run_distributed(_pipeline_ranks_disagree, 2, timeout=120)
    assert "traced receiving float64[2, 8]" in rank1 and "float64[1, 8]" in rank1, rank1
    assert rank0.startswith("PipelineError") and "stage 1 on rank 1 raised RuntimeError" in rank0, rank0
