"""Skip connections: @skippable / stash / pop, Namespace, verify_skippables, layouts, trackers, portals.

Single-process tests of the skip machinery on its own and in a bare nn.Sequential;
how skips travel inside a `Pipe` is tested in pipeline/test_pipe.py.
"""

from __future__ import annotations

import copy
import doctest
import threading
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.pipeline import skip as skip_pkg
from shardwise.pipeline._checkpoint import is_checkpointing
from shardwise.pipeline._microbatch import Batch
from shardwise.pipeline._stream import CPU_STREAM
from shardwise.pipeline.skip import (
    Namespace,
    Portal,
    SkipRoutes,
    SkipRoute,
    SkipTracker,
    SkipTrackerThroughPortals,
    current_skip_tracker,
    inspect_skip_layout,
    pop,
    skippable,
    stash,
    use_skip_tracker,
    verify_skippables,
)
from shardwise.pipeline.skip import _namespace, _routes, _skippable, _verify


# -- layers used below ------------------------------------------------------------------

@skippable(stash=["foo"])
class StashFoo(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield stash("foo", x * 2)
        return x + 1


@skippable(pop=["foo"])
class PopFoo(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        foo = yield pop("foo")
        return x * 10 + foo


@skippable(stash=["bar"])
class StashBar(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield stash("bar", x)
        return x


@skippable(pop=["bar"])
class PopBar(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        bar = yield pop("bar")
        return x + bar


@skippable(stash=["foo"], pop=["foo"])
class StashPopFoo(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield stash("foo", x)
        return x


def test_public_surface_of_skip_package() -> None:
    assert set(skip_pkg.__all__) >= {"skippable", "stash", "pop", "Namespace", "verify_skippables",
                                     "inspect_skip_layout", "SkipRoutes", "use_skip_tracker", "current_skip_tracker"}
    for name in skip_pkg.__all__:
        assert hasattr(skip_pkg, name), name


@pytest.mark.parametrize("module", [_namespace, _skippable, _routes, _verify], ids=lambda m: m.__name__)
def test_skip_module_doctests_pass(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- Namespace ----------------------------------------------------------------------------

def test_namespaces_are_distinct_hashable_ordered_and_copy_equal() -> None:
    a, b = Namespace(), Namespace("dec")
    assert a != b and a == a and hash(copy.copy(a)) == hash(a) and copy.deepcopy(b) == b
    assert (a < b) != (b < a)  # a total order
    assert isinstance(None, Namespace) and isinstance(a, Namespace)
    assert repr(b) == "<Namespace 'dec'>"
    assert sorted([b, a]) == sorted([a, b])


# -- @skippable declarations ----------------------------------------------------------------

def test_skippable_wraps_the_module_and_keeps_its_name() -> None:
    layer = StashFoo()
    assert repr(layer) == "@skippable(StashFoo())"
    assert type(layer).__name__ == "StashFoo" and type(layer).__qualname__ == "StashFoo"
    assert layer.stashable_names == frozenset({"foo"}) and layer.poppable_names == frozenset()
    assert list(layer.stashable()) == [(None, "foo")]


def test_skippable_rejects_a_string_instead_of_a_list() -> None:
    with pytest.raises(TypeError, match=r"skippable\(stash='foo'\) takes a list of names, not a string: "
                                        r"use stash=\['foo'\]"):
        skippable(stash="foo")


def test_isolate_maps_names_to_the_namespace_and_returns_self() -> None:
    ns = Namespace()
    layer = StashFoo()
    assert layer.isolate(ns) is layer
    assert list(layer.stashable()) == [(ns, "foo")]


def test_isolate_only_some_names() -> None:
    @skippable(stash=["alice", "bob"])
    class StashStash(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("alice", x)
            yield stash("bob", x)
            return x

    ns_a, ns_b = Namespace(), Namespace()
    layer = StashStash().isolate(ns_a, only=["alice"]).isolate(ns_b, only=["bob"])
    assert list(layer.stashable()) == [(ns_a, "alice"), (ns_b, "bob")]


def test_isolate_rejects_undeclared_names_and_non_namespaces() -> None:
    with pytest.raises(ValueError, match=r"isolate\(only=\['bar'\]\) names \['bar'\], which StashFoo does not "
                                         r"declare \(stash: \['foo'\], pop: \[\]\)"):
        StashFoo().isolate(Namespace(), only=["bar"])
    with pytest.raises(TypeError, match="isolate\\(\\) takes a Namespace, got 'ns' \\(str\\)"):
        StashFoo().isolate("ns")  # type: ignore[arg-type]


# -- stash and pop without a pipeline (the default tracker) -----------------------------------

def test_stash_and_pop_work_in_a_bare_sequential() -> None:
    model = nn.Sequential(StashFoo(), nn.Identity(), PopFoo())
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(model(x), (x + 1) * 10 + x * 2)


def test_stash_and_pop_in_a_bare_sequential_carry_gradients() -> None:
    model = nn.Sequential(StashFoo(), PopFoo())
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    model(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 12.0))  # d/dx [(x+1)*10 + 2x]


def test_stash_none_pops_none() -> None:
    @skippable(stash=["maybe"])
    class Maybe(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("maybe", None)
            return x

    @skippable(pop=["maybe"])
    class UseMaybe(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            maybe = yield pop("maybe")
            return x if maybe is None else x + maybe

    x = torch.ones(2)
    assert torch.equal(nn.Sequential(Maybe(), UseMaybe())(x), x)


def test_a_plain_forward_without_yield_is_allowed_only_if_nothing_is_declared() -> None:
    @skippable()
    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    assert torch.equal(Plain()(torch.ones(1)), torch.full((1,), 3.0))


def test_default_tracker_is_a_plain_one_per_thread() -> None:
    seen: list[SkipTracker] = []

    def remember() -> None:
        seen.append(current_skip_tracker())

    remember()
    thread = threading.Thread(target=remember)
    thread.start()
    thread.join()
    assert type(seen[0]) is SkipTracker and type(seen[1]) is SkipTracker and seen[0] is not seen[1]
    assert current_skip_tracker() is seen[0]  # the lazily created one is kept


def test_use_skip_tracker_installs_and_restores() -> None:
    before = current_skip_tracker()
    mine = SkipTracker()
    with use_skip_tracker(mine):
        assert current_skip_tracker() is mine
        nn.Sequential(StashFoo())(torch.ones(1))
        assert list(mine.tensors) == [(None, "foo")]
    assert current_skip_tracker() is before


def test_no_portal_is_created_without_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a Portal was created outside Pipe")

    monkeypatch.setattr(Portal, "__init__", fail)
    x = torch.ones(2, requires_grad=True)
    nn.Sequential(StashFoo(), nn.Identity(), PopFoo())(x).sum().backward()
    assert x.grad is not None


def test_plain_tracker_refuses_to_copy() -> None:
    with pytest.raises(TypeError, match="copy is not supported for non-portal skip tensors \\(skip 'foo'\\)"):
        SkipTracker().copy(Batch(torch.ones(1)), CPU_STREAM, CPU_STREAM, None, "foo")


# -- runtime errors -------------------------------------------------------------------------

def _run(*layers: nn.Module) -> None:
    with use_skip_tracker(SkipTracker()):
        nn.Sequential(*layers)(torch.ones(1))


def test_pop_without_stash_raises() -> None:
    with pytest.raises(RuntimeError, match="'foo' has not been stashed \\(namespace None\\): the layer stashing "
                                           "it must run earlier"):
        _run(PopFoo())


def test_pop_of_a_namespaced_skip_stashed_in_another_namespace_raises() -> None:
    with pytest.raises(RuntimeError, match="'foo' has not been stashed \\(namespace <Namespace 'pop-side'>\\)"):
        _run(StashFoo(), PopFoo().isolate(Namespace("pop-side")))


def test_undeclared_stash_raises() -> None:
    @skippable()
    class Sneaky(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("foo", x)
            return x

    with pytest.raises(RuntimeError, match=r"'foo' has not been declared as stashable: add it to "
                                           r"@skippable\(stash=\[...\]\) of Sneaky \(declared: \[\]\)"):
        _run(Sneaky())


def test_undeclared_pop_raises() -> None:
    @skippable(stash=["foo"])
    class Sneaky(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("foo", x)
            foo = yield pop("foo")
            return foo

    with pytest.raises(RuntimeError, match=r"'foo' has not been declared as poppable: add it to "
                                           r"@skippable\(pop=\[...\]\) of Sneaky"):
        _run(Sneaky())


def test_declared_but_not_stashed_raises() -> None:
    @skippable(stash=["foo", "bar"])
    class Lazy(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x

    with pytest.raises(RuntimeError, match="'bar', 'foo' must be stashed but have not: Lazy declares them"):
        _run(Lazy())


def test_declared_but_not_popped_raises() -> None:
    @skippable(pop=["foo"])
    class Lazy(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x

    with pytest.raises(RuntimeError, match="'foo' must be popped but have not: Lazy declares them as poppable"):
        _run(StashFoo(), Lazy())


def test_yielding_something_else_raises_type_error() -> None:
    @skippable()
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield "stash please"
            return x

    with pytest.raises(TypeError, match="'stash please' is not a command from @skippable: yield only"):
        _run(Odd())


# -- verify_skippables ------------------------------------------------------------------------

HEADER = "one or more pairs of stash and pop do not match:\n\n"


def test_verify_accepts_matching_pairs() -> None:
    verify_skippables(nn.Sequential(StashFoo(), nn.ReLU(), PopFoo(), StashBar(), PopBar()))


def test_verify_accepts_same_names_isolated_in_two_namespaces() -> None:
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(nn.Sequential(StashFoo().isolate(ns1), StashFoo().isolate(ns2),
                                    PopFoo().isolate(ns2), PopFoo().isolate(ns1)))


def test_verify_stash_and_pop_in_one_layer() -> None:
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(StashPopFoo()))
    assert str(info.value) == HEADER + "* '0' declared 'foo' both as stashable and as poppable: a layer pops a " \
                                       "skip stashed by an earlier layer; rename one of them"


def test_verify_redeclared_stash() -> None:
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(StashFoo(), StashFoo(), PopFoo()))
    assert str(info.value) == HEADER + "* '1' redeclared 'foo' as stashable but not isolated by namespace: " \
                                       "isolate each stash and its pop in their own Namespace (layer.isolate(ns))"


def test_verify_redeclared_pop() -> None:
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(StashFoo(), PopFoo(), PopFoo()))
    assert str(info.value) == HEADER + "* '2' redeclared 'foo' as poppable but not isolated by namespace: " \
                                       "isolate each stash and its pop in their own Namespace (layer.isolate(ns))"


def test_verify_pop_before_stash() -> None:
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(PopFoo(), StashFoo()))
    assert str(info.value) == HEADER + (
        "* '0' declared 'foo' as poppable but it was not stashed: stash 'foo' in an earlier layer, isolated in "
        "the same namespace\n"
        "* no module declared 'foo' as poppable but stashed: add a later layer with @skippable(pop=['foo']) in "
        "the same namespace, or stop stashing 'foo'")


def test_verify_names_the_namespace_of_a_mismatch() -> None:
    ns = Namespace("enc1")
    with pytest.raises(TypeError, match="\\* '1' declared 'foo' as poppable but it was not stashed "
                                        "\\(in <Namespace 'enc1'>\\)"):
        verify_skippables(nn.Sequential(StashFoo(), PopFoo().isolate(ns)))


def test_verify_collects_every_problem_into_one_error() -> None:
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(StashPopFoo(), PopBar(), StashBar(), StashBar()))
    bullets = str(info.value).split("\n\n", 1)[1].split("\n")
    assert [b.split(":")[0] for b in bullets] == [
        "* '0' declared 'foo' both as stashable and as poppable",
        "* '1' declared 'bar' as poppable but it was not stashed",
        "* '3' redeclared 'bar' as stashable but not isolated by namespace",
        "* no module declared 'bar' as poppable but stashed",
    ]


def test_verify_rejects_nested_skippables() -> None:
    block = nn.Sequential(StashFoo(), PopFoo())
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(nn.ReLU(), block))
    assert str(info.value) == HEADER + (
        "* '1.0' is a @skippable nested inside layer '1': skips are matched and routed between the top-level "
        "layers of the nn.Sequential only; make it a top-level layer\n"
        "* '1.1' is a @skippable nested inside layer '1': skips are matched and routed between the top-level "
        "layers of the nn.Sequential only; make it a top-level layer")


def test_verify_rejects_a_skippable_inside_a_skippable() -> None:
    @skippable()
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = StashFoo()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(TypeError, match="'0.module.inner' is a @skippable nested inside layer '0'"):
        verify_skippables(nn.Sequential(Outer()))


# -- inspect_skip_layout ----------------------------------------------------------------------

def _parts(*groups: list[nn.Module]) -> list[nn.Sequential]:
    return [nn.Sequential(*g) for g in groups]


def test_layout_without_skips_copies_nothing() -> None:
    layout = inspect_skip_layout(_parts([nn.ReLU()], [nn.ReLU()]))
    assert [list(layout.copy_policy(j)) for j in range(2)] == [[], []]
    assert str(layout) == "0 skips over 2 partitions"


def test_layout_inside_one_partition_copies_nothing() -> None:
    layout = inspect_skip_layout(_parts([StashFoo(), PopFoo()], [nn.ReLU()]))
    assert [list(layout.copy_policy(j)) for j in range(2)] == [[], []]
    assert not layout.requires_copy(None, "foo")
    assert str(layout.route(None, "foo")) == \
        "'foo': stashed in partition 0 (layer '0'), popped in partition 0 (layer '1'), same partition, no copy"


def test_layout_adjoining_and_far_partitions() -> None:
    layout = inspect_skip_layout(_parts([StashFoo()], [PopFoo()]))
    assert list(layout.copy_policy(1)) == [(0, None, "foo")] and layout.requires_copy(None, "foo")
    layout = inspect_skip_layout(_parts([StashFoo()], [nn.ReLU()], [nn.ReLU()], [PopFoo()]))
    assert [list(layout.copy_policy(j)) for j in range(4)] == [[], [], [], [(0, None, "foo")]]
    assert list(layout.route(None, "foo").skipped_partitions) == [1, 2]


def test_layout_copy_policy_is_sorted_by_source_partition() -> None:
    layout = inspect_skip_layout(_parts([StashBar()], [StashFoo()], [PopFoo(), PopBar()]))
    assert list(layout.copy_policy(2)) == [(0, None, "bar"), (1, None, "foo")]


def test_layout_keeps_namespaces_apart() -> None:
    ns1, ns2 = Namespace("one"), Namespace("two")
    layout = inspect_skip_layout(_parts([StashFoo().isolate(ns1)], [StashFoo().isolate(ns2)],
                                        [PopFoo().isolate(ns1)], [PopFoo().isolate(ns2)]))
    assert list(layout.copy_policy(2)) == [(0, ns1, "foo")]
    assert list(layout.copy_policy(3)) == [(1, ns2, "foo")]
    assert str(layout) == (
        "2 skips over 4 partitions:\n"
        "  'foo' in <Namespace 'one'>: stashed in partition 0 (layer '0'), popped in partition 2 (layer '0'), "
        "skips partition 1\n"
        "  'foo' in <Namespace 'two'>: stashed in partition 1 (layer '0'), popped in partition 3 (layer '0'), "
        "skips partition 2")


def test_unknown_skip_requires_no_copy() -> None:
    layout = SkipRoutes(2, [SkipRoute(None, "foo", 0, 1)])
    assert layout.requires_copy(None, "foo") and not layout.requires_copy(None, "bar")


# -- portals ----------------------------------------------------------------------------------

def test_portal_tensor_life_counts_down_and_drops_the_tensor() -> None:
    t = torch.ones(1)
    for life in range(5):
        portal = Portal(t, life)
        for _ in range(life):
            assert portal.tensor is t
            assert portal.use_tensor() is t
        assert portal.tensor is None
        with pytest.raises(RuntimeError, match="tensor in portal has been removed"):
            portal.use_tensor()


def test_portal_grad_is_single_use() -> None:
    portal = Portal(torch.ones(1), 1)
    portal.put_grad(torch.ones(1))
    portal.use_grad()
    with pytest.raises(RuntimeError, match="grad in portal has been removed or never set"):
        portal.use_grad()


def test_portal_blue_orange_carry_the_gradient_back() -> None:
    t1 = torch.ones(3, requires_grad=True)
    t2 = torch.full((3,), 2.0, requires_grad=True)
    stashed = t1 * 1  # what a layer stashes
    portal = Portal(stashed, 2)
    phony = portal.blue()                  # stash side: hidden from autograd
    hidden = torch.zeros(3, requires_grad=True) * 0
    out_stash = hidden + phony.sum()       # the stash partition's output carries the phony
    popped = portal.orange(torch.empty(0, requires_grad=True))
    assert popped is not None and portal.tensor is None  # freed at the pop
    loss = (popped * 2 + t2).sum()
    loss.backward(retain_graph=True)       # pop side first: the gradient lands in the portal
    out_stash.sum().backward()             # then the stash side hands it to the stashed tensor
    assert torch.equal(t1.grad, torch.full((3,), 2.0))
    assert torch.equal(t2.grad, torch.ones(3))


def test_tracker_through_portals_uses_dict_for_same_partition_routes() -> None:
    layout = inspect_skip_layout(_parts([StashFoo(), PopFoo()]))
    tracker = SkipTrackerThroughPortals(layout)
    with use_skip_tracker(tracker):
        out = nn.Sequential(StashFoo(), PopFoo())(torch.ones(2))
    assert tracker.portals == {} and torch.equal(out, torch.full((2,), 22.0))


def test_tracker_through_portals_reuses_the_portal_on_recomputation() -> None:
    layout = inspect_skip_layout(_parts([StashFoo()], [PopFoo()]))
    tracker = SkipTrackerThroughPortals(layout)
    batch = Batch(torch.ones(1, requires_grad=True) * 1)
    tracker.save(batch, None, "foo", torch.ones(1))
    portal = tracker.portals[(None, "foo")]
    assert portal.tensor_life == 1  # life 2 (not checkpointing) minus the blue()
    assert not is_checkpointing()
    tracker.load(batch, None, "foo")
    assert portal.tensor is None and portal.tensor_life == 0
    tracker.save(batch, None, "foo", torch.ones(1))  # the stash partition again (recomputed)
    assert tracker.portals[(None, "foo")] is portal and portal.tensor is None and portal.tensor_life == 0
