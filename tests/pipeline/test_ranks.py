"""Pipeline stages on separate processes (`DistributedPipe`) against the plain module.

Transparency: for GPipe, 1F1B and interleaved 1F1B on 2 and 4 processes, with every
checkpoint mode and an uneven last micro-batch, the loss, the forward outputs and the
gradient of every parameter equal those of the unpartitioned `nn.Sequential` on the
whole batch (<= 1e-6 in float32; bit for bit where the arithmetic is the same). The model
has three skips: one from the first layer to the last (crossing every stage), and two
named 'x' in different namespaces, which land on the next rank, on the same rank, or in
one stage, depending on the balance. Also: skips travel straight from the stashing rank
to the popping one (read from the point-to-point log), 1F1B keeps at most `p - s`
micro-batches of saved activations on stage `s` (counted with saved-tensor hooks), a
(pp, dp) mesh averages gradients over dp, and a stage that raises or a process that dies
gives every other rank a `PipelineError` naming the stage, rank, micro-batch and what it
waited for.

The failure tests start their own processes: the worker pool stops the surviving ranks as
soon as one rank dies, before they could report what they saw.
"""

from __future__ import annotations

import copy
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise._comm import P2PRecord
from shardwise.pipeline import Timeline
from shardwise.pipeline._runtime import DistributedPipe, PipelineError
from shardwise.pipeline._stage import split_module
from shardwise.pipeline._wire import HEADER, INLINE, ChannelPlan
from shardwise.pipeline.skip import Namespace, inspect_skip_layout, pop, skippable, stash
from shardwise.testing import distributed, run_distributed

from ..dist_helpers import run_own_processes

D = 4  # feature width
ROWS = 10  # batch rows: chunks=4 gives micro-batches of 3, 3, 3 and 1 rows
TOL = 1e-6
MODES = ("always", "except_last", "never")


# -- the model: 8 layers, three skips -------------------------------------------------------

@skippable(stash=["long"])
class StashLong(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        y = torch.tanh(self.lin(x))
        yield stash("long", y)
        return y


@skippable(pop=["long"])
class PopLong(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        long = yield pop("long")
        return self.lin(x) * long


@skippable(stash=["x"])
class StashX(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        yield stash("x", x)
        return torch.sin(self.lin(x))


@skippable(pop=["x"])
class PopX(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        skipped = yield pop("x")
        return self.lin(x) + 2 * skipped


def skip_model(a: Namespace | None = None, b: Namespace | None = None) -> nn.Sequential:
    """'long': layer 0 -> 7; 'x' in namespace a: 1 -> 4; 'x' in namespace b: 2 -> 6."""
    torch.manual_seed(0)
    a, b = a or Namespace("a"), b or Namespace("b")
    return nn.Sequential(StashLong(), StashX().isolate(a), StashX().isolate(b), nn.Linear(D, D),
                         PopX().isolate(a), nn.Linear(D, D), PopX().isolate(b), PopLong())


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def batch(rows: int = ROWS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


def pp_mesh(world: int) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))


def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=lambda m: f"{what}: {m}")


def check_grads(pipe: DistributedPipe, ref: nn.Module, what: str) -> int:
    """Compare every local parameter's gradient with the reference's; return how many."""
    want = dict(ref.named_parameters())
    count = 0
    for j, part in pipe.partitions.items():
        for name, p in part.named_parameters():
            assert p.grad is not None, f"{what}: stage {j} parameter {name} got no gradient"
            close(f"{what}: grad of {name} (stage {j})", p.grad, want[name].grad)
            count += 1
    return count


# -- transparency ---------------------------------------------------------------------------

def _transparency(schedule: str, balance: list[int], chunks: int) -> list[int]:
    mesh = pp_mesh(dist.get_world_size())
    ref = skip_model()
    x, t = batch()
    ref_out = ref(x)
    ref_loss = mse(ref_out, t)
    ref_loss.backward()
    counted = []
    for mode in MODES:
        what = f"{schedule} {balance} checkpoint={mode}"
        pipe = DistributedPipe(copy.deepcopy(ref), balance, mesh, schedule=schedule, chunks=chunks, checkpoint=mode,
                               loss_fn=mse)
        for p in pipe.parameters():
            p.grad = None
        loss = pipe.step(x, t)
        out = pipe(x)
        last = pipe.schedule.stage_rank(pipe.num_stages - 1) == dist.get_rank()
        assert (loss is not None) == last and (out is not None) == last, what
        if loss is not None:
            close(f"{what}: loss", loss, ref_loss.detach())
            close(f"{what}: forward output", out, ref_out.detach())
        counted.append(check_grads(pipe, ref, what))
        pipe.close()
    return counted


@pytest.mark.parametrize("world, schedule, balance", [
    (2, "gpipe", [5, 3]),  # 'x' in a stays inside stage 0 (no message)
    (2, "1f1b", [3, 5]),  # all three skips from stage 0 to 1: both 'x' on the same channel pair
    (2, "interleaved", [2, 2, 2, 2]),  # 4 stages on 2 ranks: both 'x' skips stay on their rank
    (4, "gpipe", [2, 2, 2, 2]),  # 'long' goes from stage 0 to stage 3
    (4, "1f1b", [2, 2, 2, 2]),
    (4, "interleaved", [1] * 8),  # 8 stages on 4 ranks: 'x' in b goes from stage 2 to 6, both on rank 2
    (2, "looped_bfs", [2, 2, 2, 2]),
    (2, "zero_bubble", [3, 5]),  # ZB-H1: backwards split into I and W
    (4, "zero_bubble", [2, 2, 2, 2]),
    (2, "zero_bubble", [2, 2, 2, 2]),  # interleaved zero bubble
    (2, "zbv", [2, 2, 2, 2]),  # V: stages 0 and 3 on rank 0, 'long' from stage 0 to 3 stays on rank 0
    (4, "zbv", [1] * 8),
    (2, "dualpipev", [2, 2, 2, 2]),
])
def test_pipeline_equals_the_plain_module(world: int, schedule: str, balance: list[int]) -> None:
    counted = run_distributed(_transparency, world, schedule, balance, 4)
    assert [sum(per_rank[m] for per_rank in counted) for m in range(len(MODES))] == [16] * len(MODES)  # every parameter


def _exact() -> bool:
    mesh = pp_mesh(2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, D))
    x, t = batch(8)
    ref_loss = mse(ref(x), t)
    ref_loss.backward()
    pipe = DistributedPipe(copy.deepcopy(ref), [3, 2], mesh, chunks=1, checkpoint="never", loss_fn=mse)
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.step(x, t)
    want = dict(ref.named_parameters())
    for part in pipe.partitions.values():
        for name, p in part.named_parameters():
            assert p.grad is not None and torch.equal(p.grad, want[name].grad), name
    pipe.close()
    return loss is None or torch.equal(loss, ref_loss.detach())


class Split(nn.Module):
    """Returns a tuple crossing the stage boundary: a float tensor, an integer tensor, a number."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        return torch.tanh(x), (x > 0).long(), 0.5


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, values: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
        h, positive, scale = values
        return self.lin(h) * scale + positive


def _tuples() -> int:
    mesh = pp_mesh(2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(D, D), Split(), Merge())
    x, t = batch()
    ref_out = ref(x)
    mse(ref_out, t).backward()
    pipe = DistributedPipe(copy.deepcopy(ref), [2, 1], mesh, schedule="1f1b", chunks=4, loss_fn=mse)
    for p in pipe.parameters():
        p.grad = None
    pipe.step(x, t)
    out = pipe(x)
    if out is not None:
        close("output", out, ref_out.detach())
    count = check_grads(pipe, ref, "tuple boundary")
    pipe.close()
    return count


def test_a_tuple_with_integer_tensors_and_numbers_crosses_stages() -> None:
    assert sum(run_distributed(_tuples, 2)) == 4


class Fan(nn.Module):
    """Returns a tuple whose message takes the wire's longer forms: with `wide`, a float tensor
    too big to travel inside the header; otherwise a note too long for the header's metadata.
    A bool and an empty tensor ride along."""

    def __init__(self, wide: bool) -> None:
        super().__init__()
        self.width = 8192 if wide else D
        self.lin = nn.Linear(D, self.width)
        self.note = "" if wide else "n" * 600  # non-tensor values travel in the metadata

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        return torch.tanh(self.lin(x)), x > 0, x.new_zeros(0), self.note


class Gather(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, D)

    def forward(self, values: tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]) -> torch.Tensor:
        h, positive, empty, note = values
        return self.lin(h) + positive * float(len(note) == 600) + empty.numel()


def _long_messages(wide: bool) -> tuple[int, list[int]]:
    mesh = pp_mesh(2)
    torch.manual_seed(0)
    fan = Fan(wide)
    ref = nn.Sequential(nn.Linear(D, D), fan, Gather(fan.width))
    x, t = batch()
    mse(ref(x), t).backward()
    pipe = DistributedPipe(copy.deepcopy(ref), [2, 1], mesh, schedule="1f1b", chunks=4, loss_fn=mse)
    for p in pipe.parameters():
        p.grad = None
    with sw.comm_log() as log:
        pipe.step(x, t)
    count = check_grads(pipe, ref, "long messages")
    pipe.close()
    sent = [r.bytes_sent for r in log if isinstance(r, P2PRecord) and r.op == "send" and "activation of micro-batch 0"
            in r.label]
    return count, sent


@pytest.mark.parametrize("wide", [True, False], ids=["payload-past-the-header", "metadata-past-the-header"])
def test_messages_too_long_for_the_header_travel_after_it(wide: bool) -> None:
    """A small message is one transfer, its tensors inside the header; a tensor too big for it
    (past `PACKED` bytes), or metadata too long (past `INLINE`), follows as a message of its own."""
    (count0, sent0), (count1, _) = run_distributed(_long_messages, 2, wide)
    assert count0 + count1 == 6
    rows = 3  # micro-batch 0 of 10 rows in 4
    if wide:  # header (metadata inside), the float tensor, the bool one
        assert sent0 == [HEADER * 8, rows * 8192 * 4, rows * D], sent0
    else:  # header, metadata, the float tensor, the bool one
        assert len(sent0) == 4 and sent0[0] == HEADER * 8 and sent0[1] > INLINE and sent0[2:] == [rows * D * 4, rows * D]


def test_one_microbatch_is_bit_for_bit_the_plain_module() -> None:
    # Same operations on the same rows, only split between processes: nothing may differ.
    assert run_distributed(_exact, 2) == [True, True]


def test_channel_numbers_do_not_depend_on_namespace_ids() -> None:
    # Regression: channels were numbered in SkipRoutes.routes order, which sorts namespaces by
    # their random ids; two processes could then send 'x' in a on the channel where the other
    # expected 'x' in b (both skips from stage 0 to stage 1) and train on swapped skips.
    def plan(first: int, second: int) -> tuple[list[str], list[tuple[Any, ...]]]:
        a, b = Namespace("a"), Namespace("b")
        a._id, b._id = uuid.UUID(int=first), uuid.UUID(int=second)
        layout = inspect_skip_layout(split_module(skip_model(a, b), [3, 5]))
        channels = ChannelPlan(2, layout, [0, 1]).channels
        return [str(r) for r in layout.routes], [(c.index, c.kind, c.skip, c.src_stage, c.dst_stage) for c in channels]

    routes_ab, channels_ab = plan(1, 2)
    routes_ba, channels_ba = plan(2, 1)
    assert routes_ab != routes_ba  # the layout's order does follow the ids...
    assert channels_ab == channels_ba  # ...the channels' must not
    skips = ["'long'", "'x' in <Namespace 'a'>", "'x' in <Namespace 'b'>"]  # by stashing layer: 0, 1, 2
    assert [c[2] for c in channels_ab] == ["", ""] + skips + skips


# -- skips go straight from stash to pop ----------------------------------------------------

LABEL = re.compile(r"the (.+) of micro-batch (\d+) \(stage (\d+) -> (\d+)\)")


def _received(schedule: str) -> tuple[set[tuple[int, str]], dict[str, int], list[tuple[int, str, int]]]:
    mesh = pp_mesh(4)
    pipe = DistributedPipe(skip_model(), [2, 2, 2, 2], mesh, schedule=schedule, chunks=2, loss_fn=mse)
    x, t = batch(8)
    with sw.comm_log() as log, Timeline() as timeline:
        pipe.step(x, t)
    pipe.close()
    received: set[tuple[int, str]] = set()
    payload: dict[str, int] = {}
    for r in log:
        if isinstance(r, P2PRecord) and r.op == "recv":
            match = LABEL.fullmatch(r.label)
            assert match, r.label
            received.add((r.peer, match.group(1)))
            if r.bytes_received == HEADER * 8 + 4 * D * 4:  # the header with the tensor inside: 4 rows of D float32
                payload[match.group(1)] = payload.get(match.group(1), 0) + 1
    events = [(e.stage, e.kind, e.microbatch) for e in timeline.events]
    return received, payload, events


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_skips_go_straight_from_the_stashing_rank_to_the_popping_rank(schedule: str) -> None:
    # Stage s on rank s. 'long': 0 -> 3 (skips ranks 1, 2); 'x' in a: 0 -> 2 (skips 1); 'x' in b: 1 -> 3 (skips 2).
    results = run_distributed(_received, 4, schedule)
    a, b = "'x' in <Namespace 'a'>", "'x' in <Namespace 'b'>"
    expected = [
        {(1, "gradient"), (3, "skip gradient 'long'"), (2, f"skip gradient {a}")},
        {(0, "activation"), (2, "gradient"), (3, f"skip gradient {b}")},
        {(1, "activation"), (3, "gradient"), (0, f"skip {a}")},
        {(2, "activation"), (0, "skip 'long'"), (1, f"skip {b}")},
    ]
    for rank, (received, payload, events) in enumerate(results):
        assert received == expected[rank], f"rank {rank} received {sorted(received)}"
        for peer, what in expected[rank]:  # each of the 2 micro-batches carried its tensor, not only metadata
            if what.startswith("skip ") or what == "activation":
                assert payload.get(what) == 2, f"rank {rank}: {what}: {payload}"
        assert sorted(events) == sorted((rank, k, i) for k in "FB" for i in range(2)), events


# -- 1F1B bounds the activations each stage keeps -------------------------------------------

class _Live:
    """Saved tensors alive now and at most (a saved tensor dies when autograd frees its node)."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> _Saved:
        self.now += 1
        self.peak = max(self.peak, self.now)
        return _Saved(self, t)

    def unpack(self, saved: _Saved) -> torch.Tensor:
        return saved.tensor


class _Saved:
    def __init__(self, live: _Live, tensor: torch.Tensor) -> None:
        self.live, self.tensor = live, tensor

    def __del__(self) -> None:
        self.live.now -= 1


def _peak_saved(schedule: str, m: int, checkpoint: str) -> int:
    pipe = DistributedPipe(skip_model(), [2, 2, 2, 2], pp_mesh(4), schedule=schedule, chunks=m,
                           checkpoint=checkpoint, loss_fn=mse)
    live = _Live()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        pipe.step(*batch(2 * m))
    pipe.close()
    assert live.now == 0, f"{live.now} saved tensors outlived the step"
    return live.peak


def test_1f1b_keeps_at_most_p_minus_s_microbatches_of_activations() -> None:
    m, p = 8, 4
    gpipe = run_distributed(_peak_saved, p, "gpipe", m, "never")
    one_f_one_b = run_distributed(_peak_saved, p, "1f1b", m, "never")
    checkpointed = run_distributed(_peak_saved, p, "gpipe", m, "always")
    for s in range(p):
        # GPipe holds every micro-batch at the turn; that fixes the saved tensors per micro-batch.
        per_microbatch, rest = divmod(gpipe[s], m)
        assert per_microbatch > 0 and rest == 0, (s, gpipe)
        assert one_f_one_b[s] == min(p - s, m) * per_microbatch, (s, gpipe, one_f_one_b)
        # Checkpointed, a micro-batch keeps its stage input (saved by Checkpoint and by Recompute) and, on
        # the last stage, what the loss saves; one micro-batch at a time is recomputed in full.
        assert checkpointed[s] <= 3 * m + per_microbatch < gpipe[s], (s, gpipe, checkpointed)


# -- (pp, dp) -------------------------------------------------------------------------------

def _pp_dp(names: tuple[str, str]) -> int:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    ref = skip_model()
    x, t = batch(16)
    ref_loss = mse(ref(x), t)
    ref_loss.backward()
    dp = mesh.get_local_rank("dp")
    mine = slice(8 * dp, 8 * dp + 8)  # each replica's share of the batch
    pipe = DistributedPipe(copy.deepcopy(ref), [5, 3], mesh, schedule="1f1b", chunks=2, loss_fn=mse)
    for p in pipe.parameters():
        p.grad = None
    with sw.comm_log() as log:
        loss = pipe.step(x[mine], t[mine])
    if loss is not None:
        close("replica loss", loss, mse(ref(x[mine]), t[mine]).detach())
    checked = check_grads(pipe, ref, f"mesh {names}")
    pipe.close()
    reductions = [r for r in log if r.op == "all_reduce"]
    assert len(reductions) == 1 and reductions[0].group_size == 2, reductions  # one bucket, over dp
    return checked


@pytest.mark.parametrize("names", [("pp", "dp"), ("dp", "pp")])
def test_pp_dp_mesh_averages_gradients_over_dp(names: tuple[str, str]) -> None:
    assert sum(run_distributed(_pp_dp, 4, names)) == 2 * 16


# -- argument errors ------------------------------------------------------------------------

@distributed(world_size=2)
def test_argument_errors_name_the_values_and_the_fix() -> None:
    mesh = pp_mesh(2)
    with pytest.raises(ValueError, match=r"pp_dim='stages' is not a dim of the mesh \(dims: \('pp',\)\)"):
        DistributedPipe(skip_model(), [5, 3], mesh, pp_dim="stages")
    with pytest.raises(ValueError, match=r"balance needs 2 entries \(got 4\); use schedule='interleaved'"):
        DistributedPipe(skip_model(), [2, 2, 2, 2], mesh, schedule="1f1b")
    with pytest.raises(ValueError, match=r"2 problems with the DistributedPipe arguments:\n"
                                         r"  - dp_dim='dp' is not a dim of the mesh .*\n"
                                         r"  - schedule='zb' is not one of \('gpipe', '1f1b', 'interleaved', "
                                         r"'looped_bfs', 'zero_bubble', 'zbv', 'dualpipev'\)"):
        DistributedPipe(skip_model(), [5, 3], mesh, schedule="zb", dp_dim="dp")
    with pytest.raises(ValueError, match=r"dp_dim='pp' is also the pp dim: averaging gradients over it would mix"):
        DistributedPipe(skip_model(), [5, 3], mesh, dp_dim="pp")  # silently averaged stages' gradients
    with pytest.raises(ValueError, match=r"schedule='zbv' places stages in a V, two on each pp rank \(rank k holds "
                                         r"stages k and 3-k\), so balance needs 4 entries for 2 pp ranks, got 3 stages"
                                         r" per rank"):
        DistributedPipe(skip_model(), [1, 2, 1, 2, 1, 1], mesh, schedule="zbv")
    with pytest.raises(ValueError, match=r"chunks \(3\) must be at least 4: use chunks=4, or schedule='zbv'"):
        DistributedPipe(skip_model(), [2, 2, 2, 2], mesh, schedule="dualpipev", chunks=3)
    with pytest.raises(ValueError, match=r"chunks \(3\) must be a multiple of 2"):
        DistributedPipe(skip_model(), [2, 2, 2, 2], mesh, schedule="interleaved", chunks=3)
    with pytest.raises(ValueError, match=r"module and sum of balance have different length \(module: 8, sum of "
                                         r"balance: 7\)"):
        DistributedPipe(skip_model(), [4, 3], mesh)
    pipe = DistributedPipe(skip_model(), [5, 3], mesh, chunks=4)
    with pytest.raises(ValueError, match=r"step\(\) trains, so it needs loss_fn"):
        pipe.step(*batch())
    pipe.close()

    # A bad batch fails on the rank that reads it; the other rank learns of it and fails too.
    pipe = DistributedPipe(skip_model(), [5, 3], mesh, chunks=4, loss_fn=mse)
    x, t = batch(3)
    if dist.get_rank() == 0:
        with pytest.raises(ValueError, match=r"the input has 3 rows, which Tensor.chunk cuts into 3 micro-batches "
                                             r"\[1, 1, 1\], not chunks=4"):
            pipe.step(x, None)
    else:
        with pytest.raises(PipelineError, match=r"stage 1 on rank 1 stopped in the forward of micro-batch 0 of step 1 while "
                                                r"waiting for the activation of micro-batch 0 \(stage 0 -> 1\) "
                                                r"from rank 0: stage 0 on rank 0 raised ValueError: the input has 3"):
            pipe.step(None, torch.zeros(4, D))
    with pytest.raises(RuntimeError, match=r"failed in an earlier step .*build a new pipe"):
        pipe.step(*batch())
    pipe.close()


# -- failures reach every rank --------------------------------------------------------------

class Boom(nn.Module):
    """Identity until its call number `at` (counting from 0), where it raises or kills the process."""

    def __init__(self, at: int, how: str) -> None:
        super().__init__()
        self.at, self.how, self.calls = at, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at + 1:
            if self.how == "raise":
                raise ValueError("boom")
            os._exit(3)
        return x


def _failing_step(how: str) -> None:
    mesh = pp_mesh(3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), Boom(2, how), nn.Linear(D, D))
    pipe = DistributedPipe(model, [1, 2, 1], mesh, schedule="1f1b", chunks=4, checkpoint="never", loss_fn=mse)
    pipe.step(*batch(8))  # stage 1 (rank 1) fails in the forward of micro-batch 2


def test_a_stage_that_raises_stops_every_rank_with_a_clear_error() -> None:
    results = run_own_processes(_failing_step, 3, "raise")
    cause = "stage 1 on rank 1 raised ValueError: boom (in the forward of micro-batch 2 of step 1)"
    assert results[1] == ("ValueError", "boom\n(raised by stage 1 on rank 1 in the forward of micro-batch 2 of step 1; the "
                                        "other stages were told and stop with PipelineError)")
    # 1F1B on 3 stages: stage 0 has sent micro-batch 3 and waits for micro-batch 1's gradient;
    # stage 2 waits for micro-batch 2's activation.
    assert results[0] == ("PipelineError", "stage 0 on rank 0 stopped in the backward of micro-batch 1 of step 1 while waiting "
                                           "for the gradient of micro-batch 1 (stage 1 -> 0) from rank 1: " + cause)
    assert results[2] == ("PipelineError", "stage 2 on rank 2 stopped in the forward of micro-batch 2 of step 1 while waiting "
                                           "for the activation of micro-batch 2 (stage 1 -> 2) from rank 1: " + cause)


def test_a_stage_process_that_dies_stops_every_rank_with_a_clear_error() -> None:
    results = run_own_processes(_failing_step, 3, "exit")
    assert results[1] == ("exit code 3", "")
    for rank in (0, 2):
        kind, message = results[rank]
        assert kind == "PipelineError", (rank, results[rank])
        assert re.match(rf"stage {rank} on rank {rank} stopped in the (forward|backward) of micro-batch \d of step 1 "
                        r"while (waiting for|sending) the (activation|gradient) of micro-batch \d "
                        r"\(stage \d -> \d\) (from|to) rank 1: stage 1 on rank 1 ", message), message
        assert "rank 1 died (process gone)" in message, message  # found in the store: its pid is gone
