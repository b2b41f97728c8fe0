"""What `torch.compile` needs to trace a program through shardwise DTensors.

A DTensor is a traceable wrapper subclass (`__tensor_flatten__` / `__tensor_unflatten__`):
dynamo and AOTAutograd hand it fake pieces, run DTensor dispatch on them, and the door
turns each collective of a fake piece into one `shardwise::collective` node (`_comm._traced`).
What a tracer cannot follow is handled here:
- making a DTensor from a piece (`from_local`), where a wrapper object is built in Python,
  and moving one to other placements from shardwise's own hooks (`redistribute_node`) are
  `torch._dynamo.nonstrict_trace` calls: dynamo records the call, AOTAutograd traces inside;
- the placements and meshes those take: placements are pytree nodes whose context is their
  value (so ones made inside the compiled region pass), meshes are pytree constants (made
  before the region, guarded by equality);
- hooks that swap module state and run their own collectives (`fully_shard`'s) run eagerly
  (`eager_hook`): dynamo breaks the graph around them, as it does around torch's FSDP2 hooks;
- dynamo never starts a frame in shardwise's code (`_skip_fresh_frames`), the rule it keeps
  for torch's own: it runs our code only where it inlines it from a compiled caller.

`torch._dynamo` costs seconds to import, so nothing here imports it: the registrations run
when something else imports it (a post-import hook), or at once if it is already loaded.
Until then the entries below are the plain functions.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from .._compat import dynamo_disable, nonstrict_trace, register_pytree_constant, skip_code
from .._mesh import DeviceMesh
from .._placement import Partial, Placement, Replicate, Shard, _StridedShard
from .._layout import ShardOrder
from .._spec import DTensorSpec, TensorMeta
from ._autograd import FromLocal

__all__ = ["eager_hook", "from_local_node", "mark_loaded", "redistribute_node"]


def _from_local(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
                stride: tuple[int, ...], order: ShardOrder) -> Any:
    spec = DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), stride, local.dtype), order)
    return FromLocal.apply(local, spec)  # type: ignore[no-untyped-call]


def _redistribute(x: Any, placements: tuple[Placement, ...]) -> Any:
    return x.redistribute(placements=placements)


def _eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


# the entries callers go through: the plain functions, or dynamo's wrappers of them
_ENTRIES: dict[str, Callable[..., Any]] = {"from_local": _from_local, "redistribute": _redistribute, "eager": _eagerly}


def from_local_node(local: torch.Tensor, spec: DTensorSpec) -> Any:
    """`FromLocal.apply(local, spec)`, as one call a compiler records whole."""
    meta = spec.tensor_meta
    return _ENTRIES["from_local"](local, spec.mesh, spec.placements, tuple(meta.shape), meta.stride, spec.shard_order)


def redistribute_node(x: Any, placements: Sequence[Placement]) -> Any:
    """`x.redistribute(placements=placements)`, as one call a compiler records whole."""
    return _ENTRIES["redistribute"](x, tuple(placements))


def eager_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run eagerly when a compiled program calls it (dynamo breaks the graph there):
    for hooks that swap module state and issue their own collectives (`fully_shard`'s)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return _ENTRIES["eager"](hook, *args, **kwargs)

    return run


def _register() -> None:
    import torch.utils._pytree as pytree

    for cls in (DeviceMesh, *_mesh_subclasses()):
        if cls not in pytree.SUPPORTED_NODES:
            register_pytree_constant(cls)
    nodes: list[tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = [
        (Shard, lambda p: p.dim, Shard),
        (Replicate, lambda p: 0, lambda _: Replicate()),  # (a None context would be refused)
        (Partial, lambda p: p.reduce_op, Partial),
        (_StridedShard, lambda p: (p.dim, p.split_factor), lambda c: _StridedShard(c[0], split_factor=c[1])),
    ]
    for cls, context, rebuild in nodes:
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(cls, _flatten(context), _unflatten(rebuild))
    mark_loaded()
    _ENTRIES["eager"] = dynamo_disable(_eagerly)
    for name in ("from_local", "redistribute"):
        _ENTRIES[name] = nonstrict_trace(_ENTRIES[name])


def _codes(obj: Any, seen: set[int]) -> Iterator[types.CodeType]:
    """The code objects of a module's functions and classes, nested ones included."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.CodeType):
        yield obj
        for const in obj.co_consts:
            if isinstance(const, types.CodeType):
                yield from _codes(const, seen)
    elif isinstance(obj, (staticmethod, classmethod)):
        yield from _codes(obj.__func__, seen)
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            yield from _codes(f, seen)
    elif isinstance(obj, functools.partial):
        yield from _codes(obj.func, seen)
    elif isinstance(obj, types.FunctionType):
        yield from _codes(inspect.unwrap(obj).__code__, seen)
        if obj is not inspect.unwrap(obj):
            yield from _codes(obj.__code__, seen)
    elif isinstance(obj, type):
        for value in vars(obj).values():
            yield from _codes(value, seen)


def _skip_fresh_frames(module: ModuleType) -> None:
    """Dynamo never starts a frame of `module`'s code: it runs shardwise code only where it
    inlines it from a compiled caller, as it treats torch's own code. (A frame it entered
    fresh, say `__torch_dispatch__` or `redistribute` run eagerly after a graph break, would
    be traced on its own: into the dispatcher, past a half-built DTensor.)"""
    name = module.__name__
    seen: set[int] = set()
    for value in list(vars(module).values()):
        if getattr(value, "__module__", name) == name:
            for code in _codes(value, seen):
                skip_code(code)


def mark_loaded() -> None:
    """`_skip_fresh_frames` for every shardwise module loaded, once torch._dynamo is (the
    package's `__init__` calls it last, for modules that were still loading at registration)."""
    if _DONE.is_set():
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "shardwise" and module is not None:
                _skip_fresh_frames(module)


def _mesh_subclasses() -> list[type]:
    out, todo = [], list(DeviceMesh.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _flatten(context: Callable[[Any], Any]) -> Callable[[Any], tuple[list[Any], Any]]:
    return lambda p: ([], context(p))


def _unflatten(rebuild: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda children, context: rebuild(context)


# -- running `_register` once torch._dynamo is imported ---------------------------------------------

_DONE = threading.Event()


def _register_once() -> None:
    if not _DONE.is_set():
        _DONE.set()
        try:
            _register()
        except Exception as exc:  # noqa: BLE001 - never break `import torch._dynamo` for its other users
            warnings.warn(f"shardwise could not register its DTensors with torch.compile on torch "
                          f"{torch.__version__} ({type(exc).__name__}: {exc}); compiled programs over them will "
                          "break the graph or fail", stacklevel=2)


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Finds `torch._dynamo` as the other finders do and registers once it has run; after
    that, marks each shardwise module imported later (`_skip_fresh_frames`)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        ours = name.split(".")[0] == "shardwise"
        if not (ours if _DONE.is_set() else name == "torch._dynamo"):
            return None
        for finder in sys.meta_path:  # the finder that would have found it
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if ours:
                _skip_fresh_frames(module)
            else:
                _register_once()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterDynamo())
if "torch._dynamo" in sys.modules:
    _register_once()
