"""Long runs do not grow: after warm-up, no new shardwise objects and flat caches over 400 steps.

Each loop trains a tiny model with an optimizer whose scalars change every step (AdamW's
bias corrections, a cosine learning-rate schedule). The loops, on gloo ranks:

- tensor parallel (2 ranks);
- ZeRO-3 (`fully_shard`, 2 ranks);
- dp x tp (4 ranks, mesh (2, 2)): Colwise/Rowwise over tp, then `fully_shard` over dp
  (torchtitan's 2-D recipe);
- a 1F1B pipeline (`DistributedPipe`, 2 stages, 4 micro-batches);
- the `ContextParallel()` plan style (2 ranks, ring rotation) on a one-layer Hugging Face
  Llama;
- the compiled replay: `shardwise.compile` of a whole tensor-parallel train step (forward,
  backward, the optimizer's step, zero_grad): one program, traced on the second call and
  replayed on every later one (checked at every step);
- the compiled replay of the 1F1B pipeline's step (its messages host steps of the graph).

Every loop runs with foreach AdamW. The optimizer's own paths run where they differ: eager
tensor parallel with foreach, fused and for-loop AdamW and foreach momentum SGD (each steps the
DTensor parameters' local pieces through its own ops and state), and the compiled replay with
AdamW and with SGD (a trace steps every Adam flavour, foreach, fused or for-loop, on the one
fused Adam kernel with its lr an input, and SGD on the fused SGD kernel: two programs, not
four). The other loops add a layout or a schedule, not an optimizer path: running each of
them with every optimizer (28 cases, the suite's largest item on CI) repeated what the
tensor-parallel loops check.

The context-parallel options are module state that outlives a test in the worker pool:
the loop sets them itself.

Between step 150 and the last step, the live objects of shardwise's own types (counted
after `gc.collect()`) and every cache in `shardwise.debug.cache_info()` stay exactly the
same. Before the caches keyed elementwise and optimizer ops by their float arguments'
values, foreach AdamW grew by three plans a step (the benchmark runs 10,000). Before the
compiled replay passed Adam's learning rate in as a tensor, a schedule's new lr was a new
signature: the step was traced again every step, one program more each time. (The loops
ran 1,000 steps until the suite's time on CI mattered more than the extra 600: every growth
found so far was per step. `python -m bench --only long_run` runs 10,000.)
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.debug import cache_info
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.testing import run_distributed

STEPS, WARM = 400, 150  # 250 steps after warm-up: growth of one object or plan per step shows as 250
Growth = tuple[dict[str, int], dict[str, int], dict[str, int]]  # (objects made, caches at WARM, at the end)


def _ours() -> Counter[str]:
    gc.collect()
    found: Counter[str] = Counter()
    for o in gc.get_objects():
        module = getattr(type(o), "__module__", None)  # (a str, except on a few C types)
        if isinstance(module, str) and module.startswith("shardwise"):
            found[type(o).__qualname__] += 1
    return found


def _long_run(step: Callable[[], object]) -> Growth:
    """`step()` STEPS times: the shardwise objects made between step WARM and the end, and the caches at both."""
    before: tuple[Counter[str], dict[str, int]] = (Counter(), {})
    for i in range(STEPS):
        step()
        if i == WARM:
            before = (_ours(), cache_info())
    after = (_ours(), cache_info())
    return dict(after[0] - before[0]), before[1], after[1]


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[kind]
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _rows(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _eager(model: torch.nn.Module, kind: str) -> Callable[[], object]:
    optimizer = _optimizer(kind, model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)  # a new lr every step
    x = _rows(8, 16)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        schedule.step()
    return step


@contextlib.contextmanager
def _tp(kind: str) -> Iterator[Callable[[], object]]:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    yield _eager(parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), kind)


@contextlib.contextmanager
def _zero3(kind: str) -> Iterator[Callable[[], object]]:
    from shardwise.fsdp import fully_shard

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = _mlp()
    fully_shard(model, mesh=mesh)
    yield _eager(model, kind)


@contextlib.contextmanager
def _dp_x_tp(kind: str) -> Iterator[Callable[[], object]]:
    from shardwise.fsdp import fully_shard

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    yield _eager(model, kind)


@contextlib.contextmanager
def _pipeline(kind: str) -> Iterator[Callable[[], object]]:
    from shardwise.pipeline import DistributedPipe

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipe = DistributedPipe(_mlp(), [2, 1], mesh, schedule="1f1b", chunks=4, loss_fn=F.mse_loss)
    optimizer = _optimizer(kind, pipe.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    x, y = _rows(8, 16), _rows(8, 16).flip(0)

    def step() -> None:
        optimizer.zero_grad()
        pipe.step(x, y)  # (the loss on the last stage, None on the first)
        optimizer.step()
        schedule.step()
    yield step
    pipe.close()  # (its process group: the worker process lives on into later tests)


@contextlib.contextmanager
def _context_parallel(kind: str) -> Iterator[Callable[[], object]]:
    import transformers

    from shardwise.experimental import set_load_balance, set_rotate_method
    from shardwise.parallel import ContextParallel

    set_rotate_method("ring")  # module-level options: set here, whatever an earlier test in this worker chose
    set_load_balance(True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    parallelize_module(model, sw.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)), ContextParallel())
    optimizer = _optimizer(kind, model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        schedule.step()
    yield step


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(x).square().mean()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    return loss


@contextlib.contextmanager
def _compiled_tp(kind: str) -> Iterator[Callable[[], object]]:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = _optimizer(kind, model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    x = _rows(8, 16)
    train = sw.compile(_train_step)
    calls = 0

    def step() -> None:
        nonlocal calls
        train(model, optimizer, x)
        schedule.step()
        calls += 1  # call 1 makes AdamW's state (eager), call 2 traces, then every call replays that one program
        assert train.programs() == (calls >= 2), f"call {calls}: {train.programs()} programs"
    yield step


def _pipe_step(pipe: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    optimizer.zero_grad()
    loss = pipe.step(x, y)
    optimizer.step()
    return loss


@contextlib.contextmanager
def _compiled_pipeline(kind: str) -> Iterator[Callable[[], object]]:
    from shardwise.pipeline import DistributedPipe

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipe = DistributedPipe(_mlp(), [2, 1], mesh, schedule="1f1b", chunks=4, loss_fn=F.mse_loss)
    optimizer = _optimizer(kind, pipe.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    x, y = _rows(8, 16), _rows(8, 16).flip(0)
    train = sw.compile(_pipe_step)
    calls = 0

    def step() -> None:
        nonlocal calls
        train(pipe, optimizer, x, y)
        schedule.step()
        calls += 1  # as the compiled tp loop: eager, traced, then one program replayed
        assert train.programs() == (calls >= 2), f"call {calls}: {train.programs()} programs"
    yield step
    pipe.close()


# name -> (the loop's set-up, yielding its step; ranks)
LOOPS: dict[str, tuple[Callable[[str], contextlib.AbstractContextManager[Callable[[], object]]], int]] = {
    "tp": (_tp, 2), "zero3": (_zero3, 2), "dp-x-tp": (_dp_x_tp, 4), "1f1b": (_pipeline, 2),
    "context-parallel": (_context_parallel, 2), "compiled-tp": (_compiled_tp, 2),
    "compiled-1f1b": (_compiled_pipeline, 2),
}


def _loop(parallel: str, kind: str) -> Growth:
    with LOOPS[parallel][0](kind) as step:
        return _long_run(step)


OPTIMIZERS = ("foreach", "fused", "for-loop", "sgd")
# every loop with foreach AdamW; every optimizer path on eager tp, and both traced kernels (Adam, SGD) on compiled tp
CASES = ([(loop, "foreach") for loop in LOOPS] + [("tp", kind) for kind in OPTIMIZERS[1:]]
         + [("compiled-tp", "sgd")])


@pytest.mark.parametrize("parallel, kind", CASES)
def test_a_long_training_loop_grows_no_objects_and_no_caches(parallel: str, kind: str) -> None:
    if parallel == "context-parallel":
        pytest.importorskip("transformers")
    ranks = LOOPS[parallel][1]
    for rank, (grown, caches_before, caches_after) in enumerate(run_distributed(_loop, ranks, parallel, kind,
                                                                                 timeout=600)):
        assert not grown, f"rank {rank}: shardwise objects made between step {WARM} and {STEPS}: {grown}"
        assert caches_after == caches_before, f"rank {rank}: caches grew: {caches_before} -> {caches_after}"


def _floats_by_type() -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    d = sw.distribute_tensor(x, mesh, [sw.Shard(0)])
    sizes = []
    for v in (2.0, 3.0, -0.5, 1e-8):  # one plan per op, each call with its own value
        torch.testing.assert_close((d * v).full_tensor(), x * v, rtol=0, atol=0)
        torch.testing.assert_close(d.add(d, alpha=v).full_tensor(), x.add(x, alpha=v), rtol=0, atol=0)
        ys, ds = [x.clone(), x.clone() + 1], [d.clone(), d.clone() + 1]
        torch._foreach_mul_(ys, [v, v * 2])
        torch._foreach_mul_(ds, [v, v * 2])
        torch._foreach_addcdiv_(ys, ys, [y + 2 for y in ys], [v, -v])
        torch._foreach_addcdiv_(ds, ds, [t + 2 for t in ds], [v, -v])
        for y, t in zip(ys, ds):
            torch.testing.assert_close(t.full_tensor(), y, rtol=0, atol=0)
        sizes.append(cache_info()["op plans"])
    assert sizes[1:] == sizes[:1] * 3, sizes
    i = sw.distribute_tensor(torch.arange(6), mesh, [sw.Shard(0)])
    assert (i * 2).dtype == torch.int64 and (i * 2.0).dtype == torch.float32


def test_a_float_argument_is_read_at_every_call_while_its_plan_is_cached_by_type() -> None:
    run_distributed(_floats_by_type, 2, timeout=120)
