"""Pipe in one process over CPU devices: transparency against the plain nn.Sequential, skips
that go straight from stash to pop and are freed at the pop, validation errors, the
Sequential-like surface, early stop on exceptions, and a small U-Net trained under Pipe.
"""

from __future__ import annotations

import copy
import doctest
import gc
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.pipeline import Pipe
from shardwise.pipeline import _engine, _pipe
from shardwise.pipeline._checkpoint import is_checkpointing, is_recomputing
from shardwise.pipeline._timeline import Timeline
from shardwise.pipeline.skip import Namespace, Portal, pop, skippable, stash
from shardwise.pipeline.skip import _tracker
from shardwise.pipeline.skip._tracker import SkipTrackerThroughPortals, current_skip_tracker

D = 5  # feature width of the skip model
MODES = ["always", "except_last", "never"]


# -- a model with several skips -----------------------------------------------------------------
#
#   layer 0 Entry    stash 'long' (default namespace), stash 'x' (namespace a)
#   layer 1 MidPop   pop 'x' (a), dropout
#   layer 2 MidStash stash 'x' (namespace b)
#   layer 3 Exit     pop 'long', pop 'x' (b)
#
# With balance [1, 1, 1, 1], 'long' goes from partition 0 to partition 3 over partitions 1 and 2,
# and the two skips named 'x' live in different namespaces.

@skippable(stash=["long", "x"])
class Entry(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        yield stash("long", h)
        yield stash("x", torch.sin(h))
        return torch.tanh(h)


@skippable(pop=["x"])
class MidPop(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> Any:
        x = yield pop("x")
        return self.drop(torch.relu(self.lin(h))) + x


@skippable(stash=["x"])
class MidStash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> Any:
        y = self.lin(h)
        yield stash("x", y * 0.5)
        return torch.sigmoid(y)


@skippable(pop=["long", "x"])
class Exit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 3)
        self.proj = nn.Linear(D, 3)

    def forward(self, h: torch.Tensor) -> Any:
        long = yield pop("long")
        x = yield pop("x")
        return self.lin(h) + self.proj(long * x)


def skip_model(dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    a, b = Namespace("a"), Namespace("b")
    return nn.Sequential(Entry().isolate(a, only=["x"]), MidPop(dropout).isolate(a), MidStash().isolate(b),
                         Exit().isolate(b, only=["x"]))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()]  # type: ignore[misc]


def _run_pipe(model: nn.Sequential, balance: list[int], chunks: int, checkpoint: str, x: torch.Tensor,
              seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, Pipe]:
    pipe = Pipe(model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
    xp = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = pipe(xp)
    out.square().sum().backward()
    assert xp.grad is not None
    return out, xp.grad, pipe


BALANCES = [[1, 1, 1, 1], [2, 2], [3, 1], [1, 3], [1, 2, 1], [4]]


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("balance", BALANCES, ids=str)
def test_transparency_with_skips_against_the_full_batch(balance: list[int], chunks: int, checkpoint: str) -> None:
    """No dropout: the pipelined module equals the plain one on the whole batch (7 rows: uneven chunks)."""
    reference = skip_model()
    x = torch.randn(7, D)
    out, x_grad, pipe = _run_pipe(copy.deepcopy(reference), balance, chunks, checkpoint, x)

    xr = x.clone().requires_grad_()
    ref_out = reference(xr)
    ref_out.square().sum().backward()
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x_grad, xr.grad, atol=1e-6, rtol=1e-6)
    for got, want in zip(_grads(pipe), _grads(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("balance", [[1, 1, 1, 1], [2, 2], [3, 1]], ids=str)
def test_transparency_with_dropout_is_exact_per_micro_batch(balance: list[int], chunks: int, checkpoint: str) -> None:
    """With dropout, the reference runs the same micro-batches in order under the same seed:
    outputs are bit-identical (same arithmetic, same masks even when recomputed)."""
    reference = skip_model(dropout=0.5)
    x = torch.randn(7, D)
    out, x_grad, pipe = _run_pipe(copy.deepcopy(reference), balance, chunks, checkpoint, x)

    xr = x.clone().requires_grad_()
    torch.manual_seed(1)
    ref_out = torch.cat([reference(piece) for piece in xr.chunk(chunks)])
    ref_out.square().sum().backward()
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(x_grad, xr.grad, atol=1e-6, rtol=1e-6)
    for got, want in zip(_grads(pipe), _grads(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_skip_layout_of_the_skip_model() -> None:
    pipe = Pipe(skip_model(), [1, 1, 1, 1], devices=["cpu"] * 4)
    a, b = pipe[1].namespaces["x"], pipe[2].namespaces["x"]
    assert [list(pipe.skip_routes.copy_policy(j)) for j in range(4)] == \
        [[], [(0, a, "x")], [], [(0, None, "long"), (2, b, "x")]]
    assert str(pipe.skip_routes) == (
        "3 skips over 4 partitions:\n"
        "  'x' in <Namespace 'a'>: stashed in partition 0 (layer '0'), popped in partition 1 (layer '1')\n"
        "  'long': stashed in partition 0 (layer '0'), popped in partition 3 (layer '3'), skips partitions 1, 2\n"
        "  'x' in <Namespace 'b'>: stashed in partition 2 (layer '2'), popped in partition 3 (layer '3')")


# -- skips travel straight from stash to pop -----------------------------------------------------

# Every tensor whose storage address was recorded stays alive for the whole test: a freed
# storage's address may be handed to a later tensor, which would look like the same storage.
_KEEP: list[torch.Tensor] = []


def _storages(value: Any) -> Iterator[int]:
    if isinstance(value, torch.Tensor):
        _KEEP.append(value)
        yield value.untyped_storage().data_ptr()
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _storages(v)


@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_tensor_never_reaches_the_partitions_between(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = skip_model()
    stashed: list[int] = []  # storage of every 'long' stashed by Entry
    popped: list[int] = []   # storage of every 'long' popped by Exit

    entry_forward = model[0].module.forward

    def spy_entry(x: torch.Tensor) -> Any:
        gen = entry_forward(x)
        command = next(gen)
        assert command.name == "long"
        stashed.extend(_storages(command.tensor))
        yield command
        return (yield from gen)

    exit_forward = model[3].module.forward

    def spy_exit(h: torch.Tensor) -> Any:
        gen = exit_forward(h)
        command = next(gen)
        assert command.name == "long"
        long = yield command
        popped.extend(_storages(long))
        return (yield from _resume(gen, long))

    monkeypatch.setattr(model[0].module, "forward", spy_entry)
    monkeypatch.setattr(model[3].module, "forward", spy_exit)

    seen_between: list[int] = []  # every tensor partitions 1 and 2 receive or produce
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=3, checkpoint=checkpoint)
    for partition in (pipe.partitions[1], pipe.partitions[2]):
        for module in partition.modules():
            module.register_forward_hook(lambda m, args, out: seen_between.extend(_storages((args, out))))

    copies: list[str] = []
    portal_copy = Portal.copy

    def count_copy(self: Portal, *args: Any) -> torch.Tensor:
        copies.append("copy")
        return portal_copy(self, *args)

    monkeypatch.setattr(Portal, "copy", count_copy)
    activation_copies: list[int] = []
    engine_copy = _engine._copy
    monkeypatch.setattr(_engine, "_copy", lambda batch, *a: (activation_copies.append(1), engine_copy(batch, *a)))

    x = torch.randn(7, D, requires_grad=True)
    pipe(x).sum().backward()

    assert len(stashed) >= 3 and len(popped) >= 3  # 3 micro-batches (more when recomputed)
    assert set(popped) <= set(stashed)  # positive control: the pop side does see the stashed storage
    assert not set(stashed) & set(seen_between) and seen_between
    _KEEP.clear()
    assert len(copies) == 3 * 3  # three routes cross partitions, one copy each per micro-batch
    assert len(activation_copies) == 3 * 3  # partition boundaries x micro-batches


def _resume(gen: Any, value: Any) -> Any:
    """Drive the rest of a skippable generator after a command already answered with `value`."""
    try:
        command = gen.send(value)
        while True:
            reply = yield command
            command = gen.send(reply)
    except StopIteration as stop:
        return stop.value


# -- skips are released after pop -----------------------------------------------------------------

SKIP_REFS: list[weakref.ref[torch.Tensor]] = []  # a weak reference to every tensor KeepSkip stashed
AFTER_POP: list[tuple[bool, bool, bool]] = []  # UseSkip: (checkpointing, recomputing, portal still holds it)


@skippable(stash=["skip"])
class KeepSkip(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        skip = x * 2  # nothing in autograd keeps this tensor: mul by a number saves no tensor
        SKIP_REFS.append(weakref.ref(skip))
        yield stash("skip", skip)
        return x + 1


@skippable(pop=["skip"])
class UseSkip(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        skip = yield pop("skip")
        tracker = current_skip_tracker()
        assert isinstance(tracker, SkipTrackerThroughPortals)
        portal = tracker.portals[(None, "skip")]
        AFTER_POP.append((is_checkpointing(), is_recomputing(), portal.tensor is not None))
        return x * 3 + skip


def _leak_pipe(checkpoint: str) -> Pipe:
    SKIP_REFS.clear()
    AFTER_POP.clear()
    torch.manual_seed(0)
    model = nn.Sequential(KeepSkip(), nn.Linear(4, 4), nn.Linear(4, 4), UseSkip())
    return Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=3, checkpoint=checkpoint)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_skip_is_released_after_pop(checkpoint: str, train: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    trackers: list[SkipTrackerThroughPortals] = []
    init = SkipTrackerThroughPortals.__init__

    def keep(self: SkipTrackerThroughPortals, layout: Any) -> None:
        init(self, layout)
        trackers.append(self)

    monkeypatch.setattr(_tracker.SkipTrackerThroughPortals, "__init__", keep)
    pipe = _leak_pipe(checkpoint)
    pipe.train(train)
    x = torch.randn(6, 4, requires_grad=True)
    out = pipe(x)
    gc.collect()

    checkpointed = {"always": 3, "except_last": 2, "never": 0}[checkpoint] if train else 0
    # Right after the pop, the portal keeps the tensor only for a recomputation to come.
    assert AFTER_POP == [(k < checkpointed, False, k < checkpointed) for k in range(3)]
    # After forward, before backward: only skips of checkpointed micro-batches are still held.
    held = [t.portals[(None, "skip")].tensor is not None for t in trackers]
    assert held == [k < checkpointed for k in range(3)]
    if checkpointed == 0:
        assert [r() for r in SKIP_REFS] == [None, None, None]

    out.sum().backward()
    gc.collect()
    assert all(t.portals[(None, "skip")].tensor is None for t in trackers)
    assert all(r() is None for r in SKIP_REFS)
    # Recomputation popped again, with nothing left in the portal afterwards.
    assert AFTER_POP[3:] == [(False, True, False)] * checkpointed


def test_none_skip_crosses_partitions_without_portal_nodes() -> None:
    @skippable(stash=["maybe"])
    class Maybe(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("maybe", None)
            return x * 2

    @skippable(pop=["maybe"])
    class UseMaybe(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            maybe = yield pop("maybe")
            assert maybe is None
            return x + 1

    pipe = Pipe(nn.Sequential(Maybe(), nn.Identity(), UseMaybe()), [1, 1, 1], devices=["cpu"] * 3, chunks=2,
                checkpoint="never")
    x = torch.randn(4, 2, requires_grad=True)
    out = pipe(x)
    assert torch.equal(out, x * 2 + 1)
    names = _graph_names(out)
    assert not any(n.startswith("Portal") for n in names), names
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 2), 2.0))


def _graph_names(out: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


# -- checkpoint modes -----------------------------------------------------------------------------

@pytest.mark.parametrize(("checkpoint", "expected"), [("always", 2), ("except_last", 1), ("never", 0)])
def test_checkpoint_mode_decides_which_micro_batches_are_checkpointed(checkpoint: str, expected: int) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=2, checkpoint=checkpoint)
    out = pipe(torch.rand(2, 1))
    assert _graph_names(out).count("CheckpointBackward") == expected
    assert _graph_names(out).count("RecomputeBackward") == expected


@pytest.mark.parametrize("checkpoint", MODES)
def test_chunks_one_accepts_every_mode_and_eval_never_checkpoints(checkpoint: str) -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=1, checkpoint=checkpoint)
    assert _graph_names(pipe(torch.rand(2, 1))).count("CheckpointBackward") == (checkpoint == "always")
    pipe.eval()
    assert "CheckpointBackward" not in _graph_names(pipe(torch.rand(2, 1)))


def test_no_grad_runs_the_partitions_without_grad() -> None:
    modes: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            modes.append(torch.is_grad_enabled())
            return x

    pipe = Pipe(nn.Sequential(nn.Linear(1, 1), Probe()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with torch.no_grad():
        out = pipe(torch.rand(2, 1))
    assert out.grad_fn is None and modes == [False, False]


# -- inputs and outputs ---------------------------------------------------------------------------

class PairLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, xs: tuple[Any, ...]) -> tuple[Any, ...]:
        a, b, flag = xs
        return self.lin(a) + b, b * 2, flag


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_input_with_a_pass_through_value(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(PairLayer(), PairLayer(), PairLayer())
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    a, b = torch.randn(5, 3, requires_grad=True), torch.randn(5, 3)
    out = pipe((a, b, "flag"))
    ref = reference((a, b, "flag"))
    assert out[2] == "flag" and torch.allclose(out[0], ref[0], atol=1e-6) and torch.equal(out[1], ref[1])
    out[0].sum().backward()
    assert a.grad is not None


def test_input_must_be_a_tensor_or_tuple() -> None:
    pipe = Pipe(nn.Sequential(nn.Identity()), [1], devices=["cpu"])
    with pytest.raises(TypeError, match=r"expected Tensor, but got \[tensor\(\[1\.\]\)\] \(list\)"):
        pipe([torch.ones(1)])  # type: ignore[arg-type]


def test_batch_smaller_than_chunks_gives_fewer_micro_batches() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"], chunks=4, checkpoint="except_last")
    x = torch.randn(2, 2)
    assert torch.allclose(pipe(x), pipe[0](x))


def test_empty_sequential_is_the_identity() -> None:
    pipe = Pipe(nn.Sequential(), [], devices=[])
    x = torch.ones(2)
    assert pipe(x) is x and len(pipe) == 0


# -- exceptions -----------------------------------------------------------------------------------

class Boom(Exception):
    pass


def test_exception_propagates_with_its_traceback() -> None:
    class Raise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise Boom("from partition 1")

    pipe = Pipe(nn.Sequential(nn.Identity(), Raise()), [1, 1], devices=["cpu", "cpu"], chunks=3)
    with pytest.raises(Boom, match="from partition 1") as info:
        pipe(torch.ones(3, 1))
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "forward" in frames  # Raise.forward, where it was raised in the worker thread


def test_exception_stops_the_pipeline_at_the_end_of_its_clock_cycle() -> None:
    counter = 0

    class Counter(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            nonlocal counter
            counter += 1
            return x

    class Raise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise Boom()

    model = nn.Sequential(nn.Identity(), nn.Identity(), Counter(), Raise())
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=3)
    with pytest.raises(Boom):
        pipe(torch.rand(3))
    # Cycle 3 runs (1, 2) and (0, 3), which raises: micro-batch 2 never reaches the counter.
    assert counter == 2


def test_pipe_runs_again_after_an_exception() -> None:
    fail = [True]

    class Flaky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if fail[0]:
                raise Boom()
            return x + 1

    pipe = Pipe(nn.Sequential(nn.Identity(), Flaky()), [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(Boom):
        pipe(torch.zeros(2))
    fail[0] = False
    assert torch.equal(pipe(torch.zeros(2)), torch.ones(2))


# -- validation -----------------------------------------------------------------------------------

def _four() -> nn.Sequential:
    return nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1))


def test_balance_is_required_and_the_error_recommends_auto_balance() -> None:
    with pytest.raises(ValueError) as info:
        Pipe(_four())
    message = str(info.value)
    assert message.startswith("balance is required: pass balance=[layers of partition 0, ")
    assert "balance_by_time(partitions, model, sample)" in message


def test_balance_must_sum_to_the_module_length() -> None:
    with pytest.raises(ValueError, match=r"^module and sum of balance have different length \(module: 4, sum of "
                                         r"balance: 3\): balance\[j\] is the number of layers of partition j") as info:
        Pipe(_four(), [1, 2], devices=["cpu", "cpu"])
    assert "balance_by_time" in str(info.value)
    with pytest.raises(ValueError, match=r"module: 4, sum of balance: 5"):
        Pipe(_four(), [3, 2], devices=["cpu", "cpu"])


def test_balance_entries_must_be_positive_integers() -> None:
    with pytest.raises(ValueError, match=r"^all balance numbers must be positive integer \(balance: \[2, 0, 2\]\): "
                                         "give each partition at least one layer"):
        Pipe(_four(), [2, 0, 2], devices=["cpu"] * 3)
    with pytest.raises(ValueError, match=r"all balance numbers must be positive integer \(balance: \[-1, 5\]\)"):
        Pipe(_four(), [-1, 5], devices=["cpu"] * 2)


def test_chunks_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^number of chunks must be positive integer \(chunks: 0\): pass "
                                         "chunks >= 1"):
        Pipe(_four(), [4], devices=["cpu"], chunks=0)
    with pytest.raises(ValueError, match=r"\(chunks: -1\)"):
        Pipe(_four(), [4], devices=["cpu"], chunks=-1)


def test_checkpoint_mode_must_be_known() -> None:
    with pytest.raises(ValueError, match=r"^checkpoint is not one of 'always', 'except_last', or 'never' "
                                         r"\(checkpoint: 'sometimes'\)$"):
        Pipe(_four(), [4], devices=["cpu"], checkpoint="sometimes")


def test_several_argument_problems_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        Pipe(_four(), [1, 2], devices=["cpu"] * 2, chunks=0, checkpoint="sometimes")
    message = str(info.value)
    assert message.startswith("3 problems with the Pipe arguments:\n  - number of chunks must be positive")
    assert "\n  - checkpoint is not one of" in message and "\n  - module and sum of balance" in message


def test_too_few_devices_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^too few devices to hold given partitions \(devices: 1 \['cpu'\], partitions: 2\): "
                                         r"pass one device per partition, e.g. devices=\['cpu', 'cpu'\]"):
        Pipe(_four(), [2, 2], devices=["cpu"])


def test_extra_devices_are_dropped() -> None:
    pipe = Pipe(_four(), [2, 2], devices=["cpu"] * 3)
    assert pipe.devices == [torch.device("cpu")] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="default devices are the CUDA devices there")
def test_default_devices_without_cuda_are_cpus() -> None:
    assert Pipe(_four(), [1, 3]).devices == [torch.device("cpu")] * 2


def test_module_must_be_sequential() -> None:
    with pytest.raises(TypeError, match=r"^module must be nn.Sequential to be partitioned, got Linear: wrap its "
                                        "layers in nn.Sequential"):
        Pipe(nn.Linear(1, 1), [1])  # type: ignore[arg-type]


def test_duplicate_children_are_rejected() -> None:
    layer = nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"^module with duplicate children is not supported \('2' is the same "
                                         r"Linear as '0'\): use a separate instance for each position"):
        Pipe(nn.Sequential(layer, nn.ReLU(), layer), [1, 2], devices=["cpu"] * 2)


def test_parameters_shared_across_partitions_are_rejected() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with pytest.raises(ValueError, match=r"^module with duplicate parameters in distinct partitions is not supported "
                                         r"\(parameter '0.weight' \(partition 0\) is also '2.weight' \(partition 1\)\): "
                                         "keep the layers that share a parameter in one partition"):
        Pipe(nn.Sequential(a, nn.ReLU(), b), [2, 1], devices=["cpu"] * 2)


def test_parameters_shared_inside_one_partition_are_allowed_and_transparent() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    model = nn.Sequential(nn.Linear(2, 2), a, nn.Tanh(), b)
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [1, 3], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 2)
    pipe(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad, atol=1e-6, rtol=1e-6)


def test_skippables_are_verified_before_splitting() -> None:
    @skippable(pop=["foo"])
    class PopFoo(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            foo = yield pop("foo")
            return x + foo

    with pytest.raises(TypeError, match="one or more pairs of stash and pop do not match:\n\n"
                                        "\\* '1' declared 'foo' as poppable but it was not stashed"):
        Pipe(nn.Sequential(nn.ReLU(), PopFoo()), [1, 1], devices=["cpu"] * 2)


# -- the Sequential-like surface ------------------------------------------------------------------

def test_public_attributes() -> None:
    pipe = Pipe(_four(), [1, 3], devices=["cpu", "cpu"], chunks=42.000, checkpoint="never")  # type: ignore[arg-type]
    assert pipe.balance == [1, 3] and pipe.chunks == 42 and isinstance(pipe.chunks, int)
    assert pipe.checkpoint == "never" and pipe.devices == [torch.device("cpu")] * 2
    assert isinstance(pipe.partitions, nn.ModuleList)
    assert all(isinstance(p, nn.Sequential) for p in pipe.partitions)
    assert [len(p) for p in pipe.partitions] == [1, 3]


class _Named:
    """torchgpipe's own suite passes `checkpoint=MyString('always')`: an object whose str() is the mode."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __str__(self) -> str:
        return self.value


class _Mode(str):
    pass


@pytest.mark.parametrize("given", [_Named("always"), _Mode("except_last"), _Named("never")],
                         ids=["object naming always", "str subclass", "object naming never"])
def test_checkpoint_named_by_any_object_whose_str_is_a_mode_is_that_mode_as_torchgpipe_reads_it(given: Any) -> None:
    # regression: torchgpipe's test_public_attrs passes checkpoint=MyString('always'); it was refused
    pipe = Pipe(_four(), (1, 3), devices=("cpu", "cpu"), chunks=42.000, checkpoint=given)  # type: ignore[arg-type]
    assert pipe.checkpoint == str(given) and type(pipe.checkpoint) is str
    assert pipe.balance == [1, 3] and pipe.chunks == 42 and pipe.devices == [torch.device("cpu")] * 2
    for wrong in (_Named("sometimes"), None, True, 2.5):
        with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never'"):
            Pipe(_four(), [1, 3], devices=["cpu", "cpu"], checkpoint=wrong)  # type: ignore[arg-type]


def test_layers_are_indexed_and_iterated_like_the_sequential() -> None:
    model = _four()
    layers = list(model)
    pipe = Pipe(model, [1, 3], devices=["cpu", "cpu"])
    assert len(pipe) == 4 and list(pipe) == layers
    assert pipe[0] is layers[0] and pipe[3] is layers[3] and pipe[-1] is layers[3] and pipe[-4] is layers[0]
    with pytest.raises(IndexError, match="layer index 4 is out of range for a Pipe of 4 layers"):
        pipe[4]
    with pytest.raises(IndexError):
        pipe[-5]


def test_state_dict_and_names_keep_the_layer_names() -> None:
    model = nn.Sequential()
    model.add_module("a", nn.Linear(1, 1))
    model.add_module("b", nn.Linear(1, 1))
    pipe = Pipe(model, [1, 1], devices=["cpu", "cpu"])
    assert "partitions.0.a.weight" in pipe.state_dict() and "partitions.1.b.bias" in pipe.state_dict()
    assert [name for name, _ in pipe.named_modules()][-1] == "partitions.1.b"
    with pytest.raises(AttributeError):
        pipe.a  # noqa: B018


def test_moving_is_denied_but_dtype_changes_are_allowed() -> None:
    pipe = Pipe(_four(), [2, 2], devices=["cpu", "cpu"])
    for move in (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.to(torch.device("cpu")),
                 lambda: pipe.to(device="cpu"), lambda: pipe.to(torch.zeros(1))):
        with pytest.raises(TypeError, match=r"^denied to move parameters and buffers, because Pipe should manage "
                                            r"device placement \(partition j lives on devices\[j\], devices: "
                                            r"\['cpu', 'cpu'\]\)"):
            move()
    pipe.to(torch.float64)
    assert pipe[0].weight.dtype == torch.float64
    assert pipe(torch.ones(2, 1, dtype=torch.float64)).dtype == torch.float64


def test_gpipe_is_an_alias() -> None:
    assert _pipe.GPipe is Pipe


def test_pipe_module_doctest_passes() -> None:
    result = doctest.testmod(_pipe)
    assert result.attempted > 0 and result.failed == 0


def test_forward_spans_are_recorded_in_the_active_timeline() -> None:
    pipe = Pipe(_four(), [2, 2], devices=["cpu", "cpu"], chunks=3)
    with Timeline() as timeline:
        pipe(torch.ones(3, 1)).sum().backward()
    spans = sorted((e.stage, e.microbatch, e.kind) for e in timeline.events)
    assert spans == [(j, i, "F") for j in range(2) for i in range(3)]


# -- a U-Net trained under Pipe -------------------------------------------------------------------

@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Any:
        y = torch.relu(self.conv(x))
        yield stash("skip", y)
        return F.avg_pool2d(y, 2)


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self, cin: int, cskip: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin + cskip, cskip, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Any:
        skip = yield pop("skip")
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return torch.relu(self.conv(torch.cat([x, skip], dim=1)))


def unet() -> nn.Sequential:
    level1, level2 = Namespace("level1"), Namespace("level2")
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),   # 0            8x8
        Down(4, 4).isolate(level1),      # 1  stash     8x8 -> 4x4
        Down(4, 8).isolate(level2),      # 2  stash     4x4 -> 2x2
        nn.Conv2d(8, 8, 3, padding=1),   # 3            2x2
        Up(8, 8).isolate(level2),        # 4  pop       2x2 -> 4x4
        Up(8, 4).isolate(level1),        # 5  pop       4x4 -> 8x8
        nn.Conv2d(4, 1, 1),              # 6
    )


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_unet_trains_five_steps_like_the_single_process_model(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = unet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 1, 8, 8), torch.randn(6, 1, 8, 8)
    pipe = Pipe(model, [2, 2, 2, 1], devices=["cpu"] * 4, chunks=3, checkpoint=checkpoint)
    assert [r.skipped_partitions for r in pipe.skip_routes.routes] == [range(1, 2), range(2, 2)]

    losses = _train(pipe, x, y, 5)
    ref_losses = _train(reference, x, y, 5)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, ref_losses, atol=1e-6, rtol=1e-5)
    for got, want in zip(pipe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)

