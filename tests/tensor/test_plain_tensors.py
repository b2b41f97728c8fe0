"""Plain tensors meeting DTensors: the same on every rank, they count as replicated with no
workaround; rank-local, they raise on every rank instead of being silently taken as global.

The ranks compare a fingerprint of the plain tensors the first time they meet DTensors at an
op site (op, layouts, where the plain tensors sit), so later calls cost nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import ColwiseParallel, parallelize_module
from shardwise.testing import distributed

from ..dist_helpers import seeded


@distributed(world_size=4)
def test_a_plain_tensor_the_same_on_every_rank_counts_as_replicated_and_is_checked_once() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    full, bias = seeded(8, 6), seeded(6, seed=2)
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    with sw.comm_log() as first:
        y = x + bias  # a model's own constant, mask or table: no implicit_replication()
    assert y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), full + bias)
    assert [r.op for r in first] == ["all_gather"]  # the fingerprints (shape, three sums), once
    with sw.comm_log() as later:
        x + seeded(6, seed=3)  # the same site: not checked again
    assert later == []
    torch.testing.assert_close((x * torch.tensor(3.0)).full_tensor(), full * 3)
    torch.testing.assert_close((x * 2.5).full_tensor(), full * 2.5)


@distributed(world_size=4)
def test_a_rank_local_piece_mixed_into_a_global_computation_raises_on_every_rank() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    full = seeded(8, 6)
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    r = sw.distribute_tensor(seeded(2, 6, seed=1), mesh, [Replicate()])
    piece = x.to_local()  # (2, 6) on every rank, different values: taken as global it would be wrong
    with pytest.raises(ValueError, match=r"aten\.add\.Tensor: the plain tensor in argument 1 \(shape \(2, 6\).*"
                                         r"values differ between ranks \(rank 0 and rank\(s\) \[1, 2, 3\]\).*rank-local"):
        r + piece
    # the fix the message names: say how it is split
    whole = sw.DTensor.from_local(piece, mesh, [Shard(0)])
    torch.testing.assert_close((whole + x).full_tensor(), full * 2)


@distributed(world_size=4)
def test_rank_local_one_element_tensors_and_uneven_pieces_raise_too() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(seeded(5, 3), mesh, [Shard(0)])
    term = x.to_local().sum().reshape(1)  # a one-element tensor: each rank's own term
    with pytest.raises(ValueError, match=r"aten\.mul\.Tensor: the plain tensor in argument 1 \(shape \(1,\)"):
        x * term
    r = sw.distribute_tensor(seeded(3, seed=2), mesh, [Replicate()])
    rows = x.to_local()  # 2, 2, 1, 0 rows (as torch.chunk): the shapes differ
    with pytest.raises(ValueError, match=r"shapes differ.*shapes \[\(0, 3\), \(1, 3\), \(2, 3\)\]"):
        r * rows


@distributed(world_size=4)
def test_implicit_replication_vouches_for_plain_tensors_and_skips_the_check() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    r = sw.distribute_tensor(seeded(4, 3), mesh, [Replicate()])
    mine = torch.full((4, 3), float(dist.get_rank()))
    with sw.comm_log() as log, sw.implicit_replication():
        y = r + mine  # the user says it is replicated: each rank keeps its own sum
    assert log == []
    torch.testing.assert_close(y.to_local(), r.to_local() + mine)


@distributed(world_size=2)
def test_a_call_inside_implicit_replication_does_not_vouch_for_the_same_call_outside_it() -> None:
    """The plan of `r + plain` made inside implicit_replication() (unchecked) was cached and
    served the same call outside the block, which then took a rank-local tensor as global."""
    mesh = sw.init_device_mesh("cpu", (2,))
    r = sw.distribute_tensor(seeded(4, 3), mesh, [Replicate()])
    mine = torch.full((4, 3), float(dist.get_rank()))
    with sw.implicit_replication():
        r + mine
    with pytest.raises(ValueError, match=r"aten\.add\.Tensor: the plain tensor in argument 1 .*rank-local"):
        r + mine
    with sw.comm_log() as log, sw.implicit_replication():
        y = r + mine  # still vouched for inside the block, with no check
    assert log == []
    torch.testing.assert_close(y.to_local(), r.to_local() + mine)


class _Gated(torch.nn.Module):
    """A projection whose output is scaled by a table the plan does not mention."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 8, bias=False)
        self.register_buffer("table", torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x).view(x.shape[0], -1, 4) * self.table  # (batch, heads, head_dim) * (head_dim,)


@distributed(world_size=2)
def test_a_use_local_output_result_meeting_a_replicated_buffer_raises_and_left_plain_is_right() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    reference = _Gated()
    x = seeded(3, 6)
    want = reference(x)  # (3, 2, 4): rank r's head is [:, r]
    # `table` replicated as a DTensor meets each rank's own head (a plain local output):
    # the product broadcasts, and taken as global it would be silently wrong
    mixed = parallelize_module(copy.deepcopy(reference), mesh, {"up": ColwiseParallel()}, replicate_rest=True)
    with pytest.raises(ValueError, match=r"aten\.mul\.Tensor: the plain tensor in argument 0 \(shape \(3, 1, 4\)"):
        mixed(x)
    # left plain (torch's rule), the whole computation is local and right on each rank
    local = parallelize_module(copy.deepcopy(reference), mesh, {"up": ColwiseParallel()})
    rank = dist.get_rank()
    torch.testing.assert_close(local(x), want[:, rank : rank + 1])


class _Shifted(torch.nn.Module):
    """Its input, a plain tensor, meets its replicated `shift` at `aten.add`."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


@distributed(world_size=2)
def test_a_model_sharded_after_another_checks_its_plain_tensors_as_the_first_did() -> None:
    """The checked sites were kept once per process (and the op plans, which skip the check,
    too): a second model meeting a plain tensor at a site the first had checked took its
    rank-local tensor as global, silently, and a model's first step logged a check or not
    by what had run before it."""
    mesh = sw.init_device_mesh("cpu", (2,))
    first = sw.distribute_module(_Shifted(), mesh)
    with sw.comm_log() as log:
        first(seeded(3, 6))
    assert [r.op for r in log] == ["all_gather"]  # this site's check, whatever ran before in the process
    with sw.comm_log() as later:
        first(seeded(3, 6, seed=1))
    assert later == []  # once per site: a model's later steps cost nothing
    second = sw.distribute_module(_Shifted(), mesh)
    mine = torch.full((3, 6), float(dist.get_rank()))  # per-rank data, as in the first model's place
    with pytest.raises(ValueError, match=r"aten\.add\.Tensor: the plain tensor in argument 0 .*rank-local"):
        second(mine)


# -- plain leaves and in-place ops on plain tensors ----------------------------------------------
# regressions (issue 45): a plain bias beside a vocab-split weight got a Shard(0) DTensor gradient,
# and the for-loop AdamW's `exp_avg_sq.addcmul_(grad, grad)` on its plain state then failed with
# "AttributeError: 'Tensor' object has no attribute '_local_tensor'" (writing the moved self back)


@pytest.mark.parametrize("placement", ["S(0)", "P(sum)", "R"])
@pytest.mark.parametrize("n", [8, 7], ids=["even", "uneven"])
@distributed(world_size=4)
def test_an_in_place_op_on_a_plain_tensor_with_dtensor_operands_gives_the_whole_result(placement: str, n: int) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    full, plain = seeded(n, dtype=torch.float64), seeded(n, seed=5, dtype=torch.float64)
    if placement == "P(sum)":
        d = sw.DTensor.from_local(full / 4, mesh, [sw.Partial()])
    else:
        d = sw.distribute_tensor(full, mesh, [Shard(0) if placement == "S(0)" else Replicate()])
    want = plain.clone().addcmul_(full, full, value=0.5).add_(full)
    got = plain.clone()
    returned = got.addcmul_(d, d, value=0.5)
    assert returned is got and type(got) is torch.Tensor
    got.add_(d)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("optimizer", ["AdamW default", "AdamW foreach", "AdamW fused", "SGD"])
@distributed(world_size=4)
def test_a_plain_parameter_gets_a_plain_whole_gradient_where_dtensors_gave_it_a_split_one(optimizer: str) -> None:
    # y = x W^T + b with W split by rows (a vocab-split weight): b's gradient is the column sum of
    # a column-split dy, Shard(0) on its own; a plain b must be stepped with the whole gradient
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    reference = torch.nn.Linear(6, 10).double()  # 10 rows over 4 ranks: uneven
    model = copy.deepcopy(reference)
    model.weight = torch.nn.Parameter(sw.distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    kind, _, how = optimizer.partition(" ")
    extra = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(how, {})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if kind == "SGD" else
            torch.optim.AdamW(m.parameters(), lr=1e-2, **extra) for m in (reference, model)]
    for step in range(3):
        x = seeded(5, 6, seed=step, dtype=torch.float64)
        for m in (reference, model):
            m(x).pow(2).sum().backward()
        assert type(model.bias.grad) is torch.Tensor  # plain and whole, as the parameter is
        torch.testing.assert_close(model.bias.grad, reference.bias.grad, atol=1e-12, rtol=0)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(model.bias.detach(), reference.bias.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(model.weight.full_tensor().detach(), reference.weight.detach(), atol=1e-12, rtol=0)
