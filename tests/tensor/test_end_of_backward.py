"""The end-of-backward registry on its own (one process, no mesh): one engine callback per
backward pass, steps in phase order, passes that raise or nest, and one reducer per
parameter and level, a second refused naming both registrations."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.utils.checkpoint

from shardwise._tensor import _end_of_backward as registry
from shardwise._tensor._end_of_backward import PHASES, GradientReducer, Step, arm, register, unregister
from shardwise.debug import gradient_reducers


class Recorder(Step):
    def __init__(self, phase: str, log: list[str], name: str = "") -> None:
        self.phase, self.log, self.name = phase, log, name or phase

    def finish(self) -> None:
        self.log.append(self.name)


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The graph task of every end-of-pass callback the engine ran."""
    ended: list[int] = []
    real = registry._end_of_pass

    def counted(task: int) -> None:
        ended.append(task)
        real(task)

    monkeypatch.setattr(registry, "_end_of_pass", counted)
    yield ended


def test_steps_armed_in_any_order_run_once_at_the_end_of_the_pass_in_phase_order(passes: list[int]) -> None:
    log: list[str] = []
    steps = [Recorder(phase, log) for phase in reversed(PHASES)]
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    for step in steps:  # armed last phase first, and twice each: each runs once
        y.register_hook(lambda g, s=step: (arm(s), arm(s), None)[-1])
    y.sum().backward()
    assert log == list(PHASES)
    assert len(passes) == 1  # one engine callback for the pass, whatever armed
    (x * 3).sum().backward()  # a pass that arms nothing queues nothing
    assert len(passes) == 1 and log == list(PHASES)


def test_within_a_phase_steps_run_in_the_order_they_first_armed(passes: list[int]) -> None:
    log: list[str] = []
    a, b = Recorder("replicas", log, "a"), Recorder("replicas", log, "b")
    for first, second in ((a, b), (b, a)):  # the order is fixed by the first pass: the same on every rank
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g, s=first: arm(s))  # (hooks run in the order registered)
        y.register_hook(lambda g, s=second: arm(s))
        y.sum().backward()
    assert log == ["a", "b", "a", "b"] and len(passes) == 2


def test_arming_outside_backward_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="outside one"):
        arm(Recorder("layout", []))


def test_a_reentrant_backward_inside_a_pass_is_a_pass_of_its_own(passes: list[int]) -> None:
    log: list[str] = []
    inner, outer = Recorder("replicas", log, "inner"), Recorder("units", log, "outer")
    x = torch.ones(3, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        t = t * 2
        if t.requires_grad:
            t.register_hook(lambda g: arm(inner))  # runs in the recomputation's own backward
        return t

    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    z = y * 3
    z.register_hook(lambda g: arm(outer))
    z.sum().backward()
    assert log == ["inner", "outer"]  # the nested pass ended first, with its own callback
    assert len(passes) == 2 and not registry._PASSES.armed


def test_a_pass_that_raises_leaves_its_steps_to_the_next_pass_and_nothing_grows(passes: list[int]) -> None:
    log: list[str] = []
    step = Recorder("layout", log)
    for fail in (True, True, False):
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        if fail:
            y.register_hook(_boom)
        y.register_hook(lambda g: arm(step))  # (runs before the raising hook)
        if fail:
            with pytest.raises(ValueError, match="boom"):
                y.sum().backward()
        else:
            y.sum().backward()
    assert log == ["layout"] and len(passes) == 1
    assert not registry._PASSES.armed  # the failed passes' entries were dropped once the step moved on


def _boom(grad: torch.Tensor) -> None:
    raise ValueError("boom")


class FakeReducer:
    def __init__(self, registrant: str, level: str, params: list[torch.Tensor]) -> None:
        self.record = GradientReducer(registrant, level, "sum", (0, 1), "mesh dim 'x'", registry.caller_place())
        self.params = [(f"p{k}", p) for k, p in enumerate(params)]

    def gradient_reducer(self) -> GradientReducer:
        return self.record

    def reduced_params(self) -> list[tuple[str, torch.Tensor]]:
        return self.params


def test_a_second_reducer_of_a_parameter_at_one_level_is_refused_naming_both() -> None:
    p, q = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    first = FakeReducer("first style", "replicas", [p])
    register(first)
    try:
        layout = FakeReducer("a layout style", "layout", [p])  # another level: composes
        register(layout)
        second = FakeReducer("second style", "replicas", [q, p])
        with pytest.raises(ValueError) as info:
            register(second)
        message = str(info.value)
        assert "second style" in message and "first style" in message and "p1 (p0 there)" in message
        assert message.count("test_end_of_backward.py:") == 2  # both registrations' lines
        assert gradient_reducers(p) == (layout.record, first.record)  # in the order they apply
        assert gradient_reducers(q) == ()  # the refused one registered nothing
        unregister(first)
        register(second)  # once the first lets go, the parameter may be taken
        assert gradient_reducers(p) == (layout.record, second.record)
        unregister(second)
        unregister(layout)
    finally:
        unregister(first)
    assert gradient_reducers(p) == ()


def test_registration_is_weak_a_dropped_reducer_frees_its_parameters() -> None:
    p = torch.zeros(2, requires_grad=True)
    register(FakeReducer("gone", "replicas", [p]))  # nobody holds it: gone with its owner
    kept = FakeReducer("kept", "replicas", [p])
    register(kept)  # no clash with the dead one
    assert gradient_reducers(p) == (kept.record,)
    unregister(kept)


def test_gradient_reducers_refuses_what_is_neither_a_tensor_nor_a_module() -> None:
    with pytest.raises(TypeError, match="a parameter"):
        gradient_reducers("weight")  # type: ignore[call-overload]
    assert gradient_reducers(torch.nn.Linear(2, 2)) == {"weight": (), "bias": ()}


def test_a_group_sum_reduces_each_pass_share_once_and_keeps_what_earlier_passes_settled() -> None:
    # one rank (a group of 1): the sum is the share; what is checked is when and what it adds
    from shardwise._tensor import GroupSum

    w = torch.nn.Parameter(torch.ones(3))
    sums = GroupSum("a test", None, 1, (0,), over="nothing", where="here", scale=2.0)
    sums.take([("w", w), ("w again", w)])  # (a tied parameter counts once)
    assert gradient_reducers(w) == (sums.gradient_reducer(),) and sums.gradient_reducer().op == "sum / 2"
    for _ in range(2):  # two passes: each pass's share is divided once, the first pass's result kept
        (w * 4).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 4.0))
    sums.release()
    assert gradient_reducers(w) == ()
    (w * 4).sum().backward()  # released: no more division
    torch.testing.assert_close(w.grad, torch.full((3,), 8.0))
