"""`@skippable`, `stash` and `pop`: layers that hand tensors to later layers of an `nn.Sequential`.

A skip connection (a U-Net's encoder-to-decoder link, a residual over several blocks)
does not fit a chain of one-argument layers. A skippable layer declares up front which
names it stashes and pops, and its `forward` is a generator that yields commands:
`yield stash(name, tensor)` hands a tensor on, `tensor = yield pop(name)` receives one.
Declaring names lets `verify_skippables` check a whole model before it runs and lets
`Pipe` plan, per skip, a direct route from the stashing partition to the popping one.

>>> import torch
>>> from torch import nn
>>> @skippable(stash=["x"])
... class Keep(nn.Module):
...     def forward(self, input):
...         yield stash("x", input)
...         return input * 10
>>> @skippable(pop=["x"])
... class AddBack(nn.Module):
...     def forward(self, input):
...         x = yield pop("x")
...         return input + x
>>> nn.Sequential(Keep(), nn.Identity(), AddBack())(torch.ones(2))
tensor([11., 11.])
>>> Keep()
@skippable(Keep())
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, ClassVar, Optional, TypeVar, Union

from torch import Tensor, nn

from ..._describe import describe
from .._microbatch import Batch
from ._namespace import Namespace
from ._tracker import current_skip_tracker

__all__ = ["Skippable", "pop", "skippable", "stash"]

T = TypeVar("T", bound="Skippable")
Command = Union["stash", "pop"]


class stash:
    """Command: `yield stash(name, tensor)` hands `tensor` (or `None`: no skip this time) on."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"stash({self.name!r}, ...)"


class pop:
    """Command: `tensor = yield pop(name)` receives the tensor stashed under `name`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"pop({self.name!r})"


class Skippable(nn.Module):
    """Base of the classes `@skippable` makes: wraps the decorated module as `self.module`.

    Do not subclass it directly; decorate with `skippable(stash=..., pop=...)`.
    """

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> tuple[Optional[Namespace], str]:
        """`(namespace, name)` of one of this layer's skips (namespace `None` unless isolated)."""
        return self.namespaces.get(name), name

    def stashable(self) -> Iterator[tuple[Optional[Namespace], str]]:
        """`(namespace, name)` of every skip this layer stashes, sorted by name."""
        return (self.namespaced(name) for name in sorted(self.stashable_names))

    def poppable(self) -> Iterator[tuple[Optional[Namespace], str]]:
        """`(namespace, name)` of every skip this layer pops, sorted by name."""
        return (self.namespaced(name) for name in sorted(self.poppable_names))

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Put this layer's skips (or only the names in `only`) in namespace `ns`; returns self.

        Two pairs of layers using the same skip name stay apart when each pair is isolated
        in its own namespace: `Down().isolate(ns1)`, ..., `Up().isolate(ns1)`.
        """
        declared = self.stashable_names | self.poppable_names
        if not isinstance(ns, Namespace) or ns is None:
            raise TypeError(f"isolate() takes a Namespace, got {describe(ns)}: use Namespace()")
        if isinstance(only, str):
            raise TypeError(f"isolate(only={only!r}) takes a list of names, not a string: use only=[{only!r}]")
        listed = None if only is None or not isinstance(only, Iterable) else list(only)
        if only is not None and (listed is None or not all(isinstance(n, str) for n in listed)):
            raise TypeError(f"isolate(only=...) takes a list of skip names, got {describe(only)}")
        names = declared if listed is None else set(listed)
        unknown = sorted(names - declared)
        if unknown:
            raise ValueError(
                f"isolate(only={sorted(names)}) names {unknown}, which {type(self).__name__} does not "
                f"declare (stash: {sorted(self.stashable_names)}, pop: {sorted(self.poppable_names)}): "
                "isolate declared names only"
            )
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, input: Any) -> Any:
        """Run the wrapped module, answering its stash and pop commands through the tracker."""
        tracker = current_skip_tracker()
        batch = Batch(input) if isinstance(input, (Tensor, tuple)) else None
        popped: dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                popped[name] = tracker.load(_need_batch(batch, self, name), ns, name)
            except KeyError:
                raise RuntimeError(
                    f"'{name}' has not been stashed (namespace {ns!r}): the layer stashing it must run "
                    "earlier in this forward, under the same namespace (isolate both with the same Namespace)"
                ) from None
        if batch is not None:
            input = batch.value

        stashed: dict[str, Optional[Tensor]] = {}
        output = self._dispatch(input, stashed, popped)

        missing = sorted(self.stashable_names - stashed.keys())
        if missing:
            names = ", ".join(f"'{n}'" for n in missing)
            raise RuntimeError(f"{names} must be stashed but have not: {type(self).__name__} declares "
                               f"them as stashable, so its forward must `yield stash(name, tensor)` for each "
                               "(stash None to skip)")
        if popped:
            names = ", ".join(f"'{n}'" for n in sorted(popped))
            raise RuntimeError(f"{names} must be popped but have not: {type(self).__name__} declares them as "
                               "poppable, so its forward must `yield pop(name)` for each")

        out_batch = Batch(output) if isinstance(output, (Tensor, tuple)) else None
        for ns, name in self.stashable():
            tracker.save(_need_batch(out_batch, self, name), ns, name, stashed[name])
        return output if out_batch is None else out_batch.value

    def _dispatch(self, input: Any, stashed: dict[str, Optional[Tensor]],
                  popped: dict[str, Optional[Tensor]]) -> Any:
        result = self.module(input)
        if not isinstance(result, Generator):
            return result
        gen: Generator[Command, Optional[Tensor], Any] = result
        reply: Optional[Tensor] = None
        try:
            while True:
                command = gen.send(reply)
                reply = None
                if isinstance(command, stash):
                    if command.name not in self.stashable_names:
                        raise RuntimeError(
                            f"'{command.name}' has not been declared as stashable: add it to "
                            f"@skippable(stash=[...]) of {type(self).__name__} "
                            f"(declared: {sorted(self.stashable_names)})")
                    stashed[command.name] = command.tensor
                elif isinstance(command, pop):
                    if command.name not in self.poppable_names:
                        raise RuntimeError(
                            f"'{command.name}' has not been declared as poppable: add it to "
                            f"@skippable(pop=[...]) of {type(self).__name__} "
                            f"(declared: {sorted(self.poppable_names)})")
                    if command.name not in popped:
                        raise RuntimeError(f"'{command.name}' was popped twice by {type(self).__name__}: "
                                           "pop each skip once")
                    reply = popped.pop(command.name)
                else:
                    raise TypeError(f"{command!r} is not a command from @skippable: yield only "
                                    "stash(name, tensor) or pop(name)")
        except StopIteration as stop:
            return stop.value


def _need_batch(batch: Optional[Batch], layer: Skippable, name: str) -> Batch:
    if batch is None:
        raise TypeError(f"{type(layer).__name__} stashes or pops {name!r}, so its input and output must be a "
                        "Tensor or a tuple holding a Tensor (skips attach to the activations)")
    return batch


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator: make a module class skippable, declaring the names it stashes and pops.

    The decorated class is a `Skippable` subclass of the same name; instances build the
    original module (same constructor arguments) and run its generator `forward`.
    """
    problems = [f"skippable({arg}={value!r}) takes a list of names, not a string: use {arg}=[{value!r}]"
                if isinstance(value, str) else f"skippable({arg}=...) takes a list of names, got {describe(value)}"
                for arg, value in (("stash", stash), ("pop", pop))
                if isinstance(value, (str, bytes)) or not isinstance(value, Iterable)]
    if problems:
        raise TypeError("; ".join(problems))
    stash, pop = list(stash), list(pop)
    bad = sorted({repr(n) for n in stash + pop if not isinstance(n, str)})
    if bad:
        raise TypeError(f"skip names must be strings, got {', '.join(bad)}")
    stashable_names, poppable_names = frozenset(stash), frozenset(pop)

    def wrap(module_cls: type[nn.Module]) -> type[Skippable]:
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stashable_names,
            "poppable_names": poppable_names,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
        }
        return type(module_cls.__name__, (Skippable,), attrs)

    return wrap
