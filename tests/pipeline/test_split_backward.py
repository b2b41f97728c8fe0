"""B (input gradients) then W (weight gradients) against one plain backward, bit for bit.

Every case runs the same module twice from one deep copy, on float64: once with
`backward_input` and `WeightGrad.run()`, once with `torch.autograd.backward(roots, grads)`,
and compares the inputs' gradients and every parameter's `.grad` with `torch.equal`.
"""

from __future__ import annotations

import copy
import doctest
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise import DTensor
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.pipeline import _split_backward
from shardwise.pipeline._split_backward import backward_input
from shardwise.testing import distributed

D = torch.float64
Run = Callable[[nn.Module, Sequence[Tensor]], list[Tensor]]


def _grads(roots: Sequence[Tensor], seed: int = 7) -> list[Optional[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in roots]


def _copy(xs: Sequence[Tensor]) -> list[Tensor]:
    return [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]


def _same(got: Optional[Tensor], want: Optional[Tensor], what: str) -> None:
    assert (got is None) == (want is None), f"{what}: {got} vs {want}"
    if isinstance(got, DTensor) and isinstance(want, DTensor):
        assert got.placements == want.placements, what
        got, want = got.to_local(), want.to_local()
    if got is not None and want is not None:
        assert torch.equal(got, want), f"{what} differs by {(got - want).abs().max().item()}"


def _same_params(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        _same(p.grad, q.grad, f"{name}.grad")


def _check(model: nn.Module, run: Run, xs: Sequence[Tensor], *, loss: bool = False,
           ref: Optional[nn.Module] = None) -> None:
    """Split backward of `run(model, xs)` equals plain backward of `run(ref, copy of xs)`."""
    ref = copy.deepcopy(model) if ref is None else ref
    xs_ref = _copy(xs)
    roots = run(model, xs)
    grads = None if loss else _grads(roots)
    got, w = backward_input(roots, grads, xs)
    assert all(p.grad is None for p in model.parameters()), "B must leave the weights' .grad alone"
    w.run()
    torch.autograd.backward(run(ref, xs_ref), grads)
    for k, (g, x) in enumerate(zip(got, xs_ref, strict=True)):
        _same(g, x.grad, f"inputs[{k}] grad")
    _same_params(model, ref)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(D)


def _x(*shape: int, grad: bool = True, seed: int = 1) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D).requires_grad_(grad)


def _call(model: nn.Module, xs: Sequence[Tensor]) -> list[Tensor]:
    return [model(xs[0])]


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products that run under it (the backward's, on CPU's calling thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_module_doctests_pass() -> None:
    result = doctest.testmod(_split_backward)
    assert result.attempted > 0 and result.failed == 0


# --- 1. an MLP stage ---------------------------------------------------------------------


def test_mlp_middle_stage_is_bit_exact() -> None:
    _check(_mlp(), _call, [_x(5, 4)])


def test_middle_stage_b_does_the_input_matmuls_and_w_the_weight_matmuls() -> None:
    model, x = _mlp(), _x(5, 4)
    y = model(x)
    with _CountMatmuls() as b:
        backward_input([y], _grads([y]), [x])[1]
    w = backward_input([model(x)], _grads([y]), [x])[1]
    with _CountMatmuls() as wc:
        w.run()
    assert (b.count, wc.count) == (2, 2), "B: dx of both layers; W: dW of both layers (biases are sums)"


def test_w_accumulates_each_layers_weight_before_the_next_layers_matmul() -> None:
    """Independent layers are separate parts of W: one weight gradient is held at a time, as in
    plain backward, rather than every layer's before the first accumulates."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(4)]).to(D)
    x = _x(5, 6)
    _check(copy.deepcopy(model), _call, [x])
    events: list[str] = []
    for p in model.parameters():
        if p.ndim == 2:
            p.register_post_accumulate_grad_hook(lambda p: events.append("acc"))

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket is torch.ops.aten.mm:
                events.append("mm")
            return func(*args, **(kwargs or {}))

    y = model(x)
    w = backward_input([y], _grads([y]), [x])[1]
    with Log():
        w.run()
    assert events == ["mm", "acc"] * 4, events


def test_first_stage_b_runs_nothing_and_w_runs_the_whole_backward() -> None:
    model = _mlp()
    x = _x(5, 4, grad=False)
    _check(model, _call, [x])
    seen: list[str] = []
    hidden = model[0](x)
    hidden.register_hook(lambda g: seen.append("hidden"))
    y = model[2](model[1](hidden))
    with _CountMatmuls() as b:
        got, w = backward_input([y], _grads([y]), [x])
    assert got == [None] and b.count == 0 and seen == []
    w.run()
    assert seen == ["hidden"] and all(p.grad is not None for p in model.parameters())


# --- 2. tied weights, no bias, weights the roots do not reach ------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)  # applied three times: weight and bias sums of three terms
        self.no_bias = nn.Linear(4, 4, bias=False)
        self.unreached = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(torch.relu(self.shared(torch.relu(self.shared(x)))))
        return self.no_bias(h)


def test_a_weight_used_three_times_a_bias_free_layer_and_unreached_weights_match() -> None:
    torch.manual_seed(0)
    model = _Tied().to(D)
    _check(model, _call, [_x(3, 4)])
    assert model.unreached.weight.grad is None and model.unreached.bias.grad is None


def test_a_weight_used_directly_by_two_inputs_branches_is_re_run_for_each() -> None:
    w = nn.Parameter(_x(4, seed=3).detach())
    holder = nn.ParameterList([w])
    _check(holder, lambda m, xs: [xs[0] * m[0] + xs[1] * m[0]], [_x(2, 4, seed=4), _x(2, 4, seed=5)])


def test_a_sum_of_three_from_both_sides_of_the_cut_is_exact_up_to_its_order() -> None:
    # w's gradient sums x0's and x1's terms (B side, re-run in W) and (w * 2)'s (W side).
    # Plain backward adds them in node order: w * 2's term first, as it was made last;
    # W adds the re-run terms first (they start W's pass), so the last bit may differ.
    w = nn.Parameter(_x(64, seed=3).detach())
    holder = nn.ParameterList([w])
    xs = [_x(3, 64, seed=s) for s in (4, 5, 6)]
    ref, xs_ref = copy.deepcopy(holder), _copy(xs)

    def run(m: nn.Module, xs: Sequence[Tensor]) -> list[Tensor]:
        return [xs[0] * m[0] + xs[1] * m[0] + xs[2] * (m[0] * 2)]

    roots = run(holder, xs)
    got, wg = backward_input(roots, _grads(roots), xs)
    wg.run()
    torch.autograd.backward(run(ref, xs_ref), _grads(roots))
    for k in range(3):
        _same(got[k], xs_ref[k].grad, f"inputs[{k}] grad")
    torch.testing.assert_close(holder[0].grad, ref[0].grad, rtol=0, atol=1e-12)


def test_a_stage_whose_output_does_not_depend_on_the_input_gets_it_all_in_w() -> None:
    model = _mlp()
    bias = nn.Linear(1, 3).to(D)
    both = nn.ModuleList([model, bias])
    ones = torch.ones(5, 1, dtype=D)
    _check(both, lambda m, xs: [m[0](xs[0]), m[1](ones)], [_x(5, 4)])


# --- 3. a last stage: a scalar loss ------------------------------------------------------


def test_a_loss_root_needs_no_gradient() -> None:
    target = _x(5, 3, grad=False, seed=9)
    _check(_mlp(), lambda m, xs: [nn.functional.mse_loss(m(xs[0]), target)], [_x(5, 4)], loss=True)


# --- 4. activation checkpointing ---------------------------------------------------------


@pytest.mark.parametrize("part", ["whole", "first layer"])
def test_a_checkpointed_stage_recomputes_once_in_b_and_accumulates_in_w(part: str) -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    runs = [0]

    def body(m: nn.Module, x: Tensor) -> Tensor:
        runs[0] += 1
        return m(x)

    def run(m: nn.Module, xs: Sequence[Tensor]) -> list[Tensor]:
        if part == "whole":
            return [checkpoint(body, m, xs[0], use_reentrant=False)]
        return [m[2](m[1](checkpoint(body, m[0], xs[0], use_reentrant=False)))]  # the last Linear re-runs in W

    accumulated: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.append(name))
    x = _x(5, 4)
    roots = run(model, [x])
    got, w = backward_input(roots, _grads(roots), [x])
    assert runs[0] == 2 and accumulated == [], "the forward, then one recomputation in B"
    w.run()
    assert runs[0] == 2 and sorted(accumulated) == sorted(n for n, _ in model.named_parameters())
    x_ref = _copy([x])
    torch.autograd.backward(run(ref, x_ref), _grads(roots))
    _same(got[0], x_ref[0].grad, "input grad")
    _same_params(model, ref)


# --- 5. several micro-batches --------------------------------------------------------------


def test_b0_b1_w0_w1_accumulates_as_two_plain_backwards() -> None:
    model = _mlp()
    ref = copy.deepcopy(model)
    xs = [_x(5, 4, seed=s) for s in (1, 2)]
    roots = [model(x) for x in xs]
    grads = [_grads([r], seed=s) for r, s in zip(roots, (3, 4))]
    split = [backward_input([r], g, [x]) for r, g, x in zip(roots, grads, xs)]
    assert all(p.grad is None for p in model.parameters())
    for _, w in split:
        w.run()
    xs_ref = _copy(xs)
    for x, g in zip(xs_ref, grads):
        torch.autograd.backward([ref(x)], g)
    for (got, _), x in zip(split, xs_ref):
        _same(got[0], x.grad, "input grad")
    _same_params(model, ref)


# --- 6. a slice of a real model ------------------------------------------------------------


def test_two_llama_decoder_layers_are_bit_exact() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2)
    config._attn_implementation = "sdpa"  # what a model made from this config picks on CPU
    torch.manual_seed(0)
    layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(2)).to(D)
    for p in layers.parameters():  # the default init leaves norms at one: make every weight distinct
        nn.init.normal_(p, std=0.2)
    hidden = _x(2, 6, 32)
    positions = torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(config)(hidden, positions)

    def run(m: nn.Module, xs: Sequence[Tensor]) -> list[Tensor]:
        h = xs[0]
        for layer in m:
            out = layer(h, position_embeddings=(xs[1], xs[2]), position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out
        return [h]

    _check(layers, run, [hidden, cos.to(D), sin.to(D)])


# --- 7. hooks fire in W --------------------------------------------------------------------


def test_parameter_hooks_fire_in_w_once_and_never_in_b() -> None:
    model = _mlp()
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append("post " + name))
        p.register_hook(lambda g, name=name: fired.append("grad " + name))
    x = _x(5, 4)
    y = model(x)
    _, w = backward_input([y], _grads([y]), [x])
    assert fired == []
    w.run()
    names = sorted(n for n, _ in model.named_parameters())
    assert sorted(f[5:] for f in fired if f.startswith("post ")) == names
    assert sorted(f[5:] for f in fired if f.startswith("grad ")) == names
    assert all(fired.index("grad " + n) < fired.index("post " + n) for n in names)


def test_a_parameter_hook_that_changes_the_gradient_applies_once() -> None:
    # the shared bias's gradient is taken in B (its three terms must add up in B), the
    # others' when W re-runs a Linear: neither may run the hook on the way
    torch.manual_seed(0)
    model = _Tied().to(D)
    ref = copy.deepcopy(model)
    calls: list[int] = []

    def halve(g: Tensor) -> Tensor:
        calls.append(1)
        return g / 2

    for p, q in zip(model.parameters(), ref.parameters()):
        p.register_hook(halve)
        q.register_hook(halve)
    _check(model, _call, [_x(3, 4)], ref=ref)
    assert len(calls) == 2 * 3, "once per reached parameter (of three), in each of the two backwards"


# --- 8. DTensor parameters -----------------------------------------------------------------


class _TpMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.relu(self.up(x)))


@distributed(world_size=2)
def test_tensor_parallel_parameters_match_the_same_modules_plain_backward() -> None:
    tp = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model, ref = (parallelize_module(_TpMlp().to(D), tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
                  for _ in range(2))
    assert isinstance(model.up.weight, DTensor)
    _check(model, _call, [_x(3, 4)], ref=ref)


# --- 9. misuse and edge cases --------------------------------------------------------------


def test_running_w_twice_says_each_b_gives_one_w() -> None:
    model, x = _mlp(), _x(5, 4)
    y = model(x)
    _, w = backward_input([y], _grads([y]), [x])
    w.run()
    with pytest.raises(ValueError, match=r"WeightGrad.run\(\): this W has run already"):
        w.run()


def test_bad_roots_and_grads_say_what_to_give() -> None:
    model, x = _mlp(), _x(5, 4)
    y = model(x)
    with pytest.raises(ValueError, match=r"1 roots but 2 grads"):
        backward_input([y], [None, None], [x])
    with pytest.raises(ValueError, match=r"roots\[0\] has shape \(5, 3\) and no gradient: give grads\[0\]"):
        backward_input([y], None, [x])


def test_an_input_outside_the_graph_and_one_without_grad_get_none() -> None:
    model, x = _mlp(), _x(5, 4)
    _check(model, _call, [x, _x(2, seed=5), _x(2, grad=False, seed=6)])


def test_roots_without_grad_are_skipped() -> None:
    model, x = _mlp(), _x(5, 4)
    ref, x_ref = copy.deepcopy(model), _copy([x])
    y = model(x)
    grads = _grads([y])
    got, w = backward_input([y, torch.arange(3)], [grads[0], None], [x])
    w.run()
    torch.autograd.backward([ref(x_ref[0])], grads)
    _same(got[0], x_ref[0].grad, "input grad")
    _same_params(model, ref)
    got, w = backward_input([torch.ones(2)], None, [x])
    assert got == [None]
    w.run()


# --- memory --------------------------------------------------------------------------------


def test_b_frees_the_roots_side_and_w_frees_the_rest() -> None:
    model, x = _mlp(), _x(5, 4)
    act = torch.relu(model[0](x))  # saved by the second Linear for its dW: W needs it
    out = model[2](act)
    y = out.sin()  # saves `out`: only B needs it
    gone_out, gone_act = weakref.ref(out), weakref.ref(act)
    _, w = backward_input([y], _grads([y]), [x])
    del y, out, act
    assert gone_out() is None and gone_act() is not None
    w.run()
    assert gone_act() is None
