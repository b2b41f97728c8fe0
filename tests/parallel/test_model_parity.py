"""Training parity: the same model trained single-device and on 4 ranks gives the same losses and parameters.

Every rank trains the single-device reference itself (the models are tiny) and, side by
side, a deep copy whose parameters are DTensors placed by a layout: data parallel,
tensor parallel (Megatron column/row split of the attention and MLP linears), both on
a (dp, tp) mesh, and data parallel for a CNN with batch norm. Five steps of AdamW (and
SGD with momentum for the CNN); each step's loss, the first step's gradients and the
final parameters (and batch-norm running statistics) must match within 1e-5.

No test reduces gradients by hand. With `Replicate` parameters and a `Shard(0)` batch,
autograd leaves each parameter's gradient `Partial` (every rank holds its batch slice's
contribution); its global value is the single-device gradient of the global mean loss,
and the optimizer's ops on it must respect that, exactly as on one device.

A failure lists every step, parameter and error found (not only the first), the aten
ops that ran replicated for lack of a strategy, and the gradients' placements.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.testing import distributed

from .. import opinfo_sweep
from ..models import CNN, GPT, cnn_batch, distribute_params, gpt_batch

STEPS = 5
TOL = 1e-5

OptFactory = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptFactory] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got.double() - want.double()).abs().max()) if want.numel() else 0.0


class _Parity:
    """Collects every difference between the distributed run and the reference, then reports them at once."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.problems: list[str] = []
        self.notes: list[str] = []

    def close(self, where: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = _max_err(got, want)
        if not err <= TOL:
            shape = "" if got.shape == want.shape else f" (shape {tuple(got.shape)} != {tuple(want.shape)})"
            self.problems.append(f"{where}: max abs error {err:.3g}{shape}")

    def check(self) -> None:
        if self.problems:
            shown = self.problems[:25] + ([f"... and {len(self.problems) - 25} more"] if len(self.problems) > 25 else [])
            raise AssertionError(
                f"{self.what}: {len(self.problems)} differences from single-device training\n  "
                + "\n  ".join(shown) + ("\n" + "\n".join(self.notes) if self.notes else "")
            )


def _train_in_parity(
    what: str,
    make_model: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    mesh: Any,
    param_plan: Callable[[str, torch.Tensor], Any],
    batch_placements: list[Any],
    make_opt: OptFactory,
) -> dict[str, Any]:
    """Train the reference and the distributed copy for STEPS steps; raise listing every difference."""
    from shardwise._tensor import _dispatch

    torch.manual_seed(0)
    ref = make_model()
    model = distribute_params(ref, mesh, param_plan)
    ref_opt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    parity = _Parity(what)
    names = [n for n, _ in ref.named_parameters()]
    placed = {n: p.placements for n, p in model.named_parameters() if isinstance(p, DTensor)}
    _dispatch._PLANS.clear()  # so every aten call of this run is seen by the trace
    trace = opinfo_sweep._Trace()
    grad_layouts: dict[str, str] = {}
    phase, step = "setup", 0
    try:
        with trace.installed(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the fallback's warnings: the trace lists those ops
            for step in range(STEPS):
                x, y = batch(step)
                phase = "reference"
                ref_loss = ref(x, y)
                ref_loss.backward()
                phase = "forward"
                dx, dy = (sw.distribute_tensor(t, mesh, batch_placements) for t in (x, y))
                with sw.implicit_replication():  # position ids, the causal mask: the same on every rank
                    loss = model(dx, dy)
                parity.close(f"step {step} loss ({_full(loss).item():.6f} vs {ref_loss.item():.6f})", _full(loss).detach(), ref_loss.detach())
                phase = "backward"
                with sw.implicit_replication():
                    loss.backward()
                if step == 0:
                    phase = "gradients"
                    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                        if p.grad is None:
                            parity.problems.append(f"step 0 grad {name}: None (reference has one)")
                            continue
                        grad_layouts[name] = p.grad._spec.layout_str() if isinstance(p.grad, DTensor) else "plain"
                        parity.close(f"step 0 grad {name}", _full(p.grad), q.grad)
                phase = "optimizer step"
                ref_opt.step()
                ref_opt.zero_grad()
                with sw.implicit_replication():
                    opt.step()
                opt.zero_grad()
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        here = next((f"{f.filename.rsplit('/', 3)[-1]}:{f.lineno}" for f in reversed(frames) if "/torch/" not in f.filename), "?")
        parity.problems.append(f"step {step} {phase} raised {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''} (at {here}; last aten op {trace.last})")
    else:
        for name, p in model.named_parameters():
            parity.close(f"final param {name}", _full(p.detach()), dict(ref.named_parameters())[name].detach())
            if isinstance(p, DTensor) and p.placements != placed[name]:  # the optimizer must write in place
                parity.problems.append(f"final param {name}: placements changed from {placed[name]} to {p.placements}")
        for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
            if b.is_floating_point():
                parity.close(f"final buffer {name}", _full(b), rb)
    if trace.fallback:
        parity.notes.append("ran replicated (no strategy): " + ", ".join(sorted(trace.fallback)))
    if grad_layouts:
        parity.notes.append("gradient placements: " + ", ".join(f"{n}={grad_layouts[n]}" for n in names if n in grad_layouts))
    parity.check()
    return {"fallback": sorted(trace.fallback), "grads": grad_layouts}


# -- GPT ------------------------------------------------------------------------------------

_COLUMN = ("q", "k", "v", "up")  # nn.Linear.weight (out, in) split on out: Megatron's column parallel
_ROW = ("proj", "down")  # split on in: row parallel, the output is Partial until reduced


def _tp(name: str) -> Any:
    """The tensor-parallel placement of one GPT parameter on the tp mesh dim."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blocks":
        layer, kind = parts[2], parts[3]
        if layer in _COLUMN:
            return Shard(0)
        if layer in _ROW and kind == "weight":
            return Shard(1)
    return Replicate()


GPT_LAYOUTS: dict[str, tuple[tuple[int, ...], Callable[[str, torch.Tensor], Any], list[Any]]] = {
    "dp": ((4,), lambda n, p: [Replicate()], [Shard(0)]),
    "tp": ((4,), lambda n, p: [_tp(n)], [Replicate()]),
    "dp_x_tp": ((2, 2), lambda n, p: [Replicate(), _tp(n)], [Shard(0), Replicate()]),
}


@pytest.mark.parametrize("layout", list(GPT_LAYOUTS))
@distributed(world_size=4)
def test_gpt_trains_like_single_device(layout: str) -> None:
    mesh_shape, plan, batch_placements = GPT_LAYOUTS[layout]
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp") if len(mesh_shape) == 2 else None)
    # float64: AdamW's g / (sqrt(v) + eps) turns float32 rounding in near-zero gradients (the
    # tied embedding's rows of tokens absent from a batch) into steps of about lr, so which
    # order the ranks' terms are summed in shows up as ~2e-5 in a few elements; float64 is exact
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _train_in_parity(f"GPT {layout} on {mesh_shape}", GPT, gpt_batch, mesh, plan, batch_placements, OPTIMIZERS["adamw"])
    finally:
        torch.set_default_dtype(before)


# -- CNN ------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@distributed(world_size=4)
def test_cnn_trains_like_single_device_data_parallel(optimizer: str) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    _train_in_parity(
        f"CNN dp with {optimizer} on (4,)", CNN, cnn_batch, mesh, lambda n, p: [Replicate()], [Shard(0)], OPTIMIZERS[optimizer]
    )


# -- the checker itself ---------------------------------------------------------------------


def test_parity_report_lists_every_difference() -> None:
    parity = _Parity("toy")
    parity.close("a", torch.zeros(3), torch.zeros(3))
    parity.close("b", torch.ones(3), torch.zeros(3))
    parity.close("c", torch.ones(2), torch.zeros(3))
    with pytest.raises(AssertionError, match=r"(?s)toy: 2 differences.*b: max abs error 1\n.*c: max abs error inf \(shape"):
        parity.check()


class _OffOnRanks(CNN):
    """A CNN whose loss is 1% off when it runs on DTensors: the parity check must catch it."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(images, labels)
        return loss * 1.01 if isinstance(images, DTensor) else loss


@distributed(world_size=4)
def test_parity_check_catches_a_model_that_differs_on_ranks() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    with pytest.raises(AssertionError, match=r"(?s)differences from single-device.*step 0 loss.*final param fc.bias"):
        _train_in_parity("off", _OffOnRanks, cnn_batch, mesh, lambda n, p: [Replicate()], [Shard(0)], OPTIMIZERS["sgd_momentum"])


def test_reference_models_train_and_tie_their_head() -> None:
    torch.manual_seed(0)
    gpt = GPT()
    assert gpt.head.weight is gpt.tok.weight
    copy_ = distribute_params(gpt, None, lambda n, p: None)  # plan None keeps plain tensors
    assert copy_.head.weight is copy_.tok.weight and copy_.tok.weight is not gpt.tok.weight
    losses = []
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = gpt(*gpt_batch(0))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # the tiny model learns a fixed batch
    cnn = CNN()
    assert cnn(*cnn_batch(0)).shape == ()
