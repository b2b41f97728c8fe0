"""`verify_skippables`: check every stash/pop pairing of an `nn.Sequential` before it runs.

Each skip `(namespace, name)` must be stashed by exactly one layer and popped by exactly
one later layer. A mistake would otherwise surface in the middle of a pipelined run, on
one micro-batch, as a missing tensor; checked statically, every problem of the model is
reported at once, one bullet each, in a single `TypeError`.

Only the top-level layers of the Sequential take part in skips: `Pipe` cuts the model
between top-level layers and routes skips between partitions by those layers'
declarations. A `@skippable` nested deeper (inside a container, or inside another
skippable) could neither be checked in order nor routed across devices, so it is
reported as a problem too: flatten it into the Sequential.

>>> from torch import nn
>>> from shardwise.pipeline.skip import skippable, stash, pop
>>> @skippable(stash=["x"])
... class A(nn.Module):
...     def forward(self, t):
...         yield stash("x", t)
...         return t
>>> verify_skippables(nn.Sequential(A(), A()))
Traceback (most recent call last):
...
TypeError: one or more pairs of stash and pop do not match:
<BLANKLINE>
* '1' redeclared 'x' as stashable but not isolated by namespace: isolate each stash and its pop in their own Namespace (layer.isolate(ns))
* no module declared 'x' as poppable but stashed: add a later layer with @skippable(pop=['x']) in the same namespace, or stop stashing 'x'
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..._describe import describe
from ._namespace import Namespace
from ._skippable import Skippable

__all__ = ["verify_skippables"]


def verify_skippables(module: nn.Sequential) -> None:
    """Raise one TypeError listing every unmatched stash/pop among `module`'s layers."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"verify_skippables checks an nn.Sequential, got {describe(module)}: skips are matched "
                        "between the layers of an nn.Sequential")
    stashed: dict[tuple[Optional[Namespace], str], str] = {}
    popped: set[tuple[Optional[Namespace], str]] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        problems.extend(_nested_problems(layer_name, layer))
        if not isinstance(layer, Skippable):
            continue
        both = layer.stashable_names & layer.poppable_names
        for name in sorted(both):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable: a layer pops "
                            "a skip stashed by an earlier layer; rename one of them")
        for ns, name in layer.poppable():
            if name in both:
                continue
            if (ns, name) in popped:
                problems.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace"
                                f"{_in(ns)}: isolate each stash and its pop in their own Namespace "
                                "(layer.isolate(ns))")
            elif (ns, name) not in stashed:
                problems.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed{_in(ns)}: "
                                f"stash '{name}' in an earlier layer, isolated in the same namespace")
            else:
                popped.add((ns, name))
        for ns, name in layer.stashable():
            if name in both:
                continue
            if (ns, name) in stashed:
                problems.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace"
                                f"{_in(ns)}: isolate each stash and its pop in their own Namespace "
                                "(layer.isolate(ns))")
            else:
                stashed[(ns, name)] = layer_name
    for (ns, name), layer_name in stashed.items():
        if (ns, name) not in popped:
            problems.append(f"no module declared '{name}' as poppable but stashed{_in(ns)}: add a later layer "
                            f"with @skippable(pop=['{name}']) in the same namespace, or stop stashing '{name}'")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n"
                        + "\n".join(f"* {p}" for p in problems))


def _in(ns: Optional[Namespace]) -> str:
    return "" if ns is None else f" (in {ns!r})"


def _nested_problems(layer_name: str, layer: nn.Module) -> list[str]:
    return [f"'{layer_name}.{path}' is a @skippable nested inside layer '{layer_name}': skips are matched and "
            "routed between the top-level layers of the nn.Sequential only; make it a top-level layer"
            for path, sub in layer.named_modules() if path and isinstance(sub, Skippable)]
