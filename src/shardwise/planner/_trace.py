"""One training step as a graph of aten ops: what the layout solver chooses layouts for.

`trace_step(model, inputs, loss_fn)` runs the model's forward, the loss and the backward
once, on meta tensors on one device (no mesh), under a dispatch mode that records every aten
op: the values it reads (earlier ops' outputs, parameters, inputs, or constants made
elsewhere), its outputs' shapes, the module it ran in and whether it ran in the backward.
The backward's ops know their module too: when a module's forward ends, the autograd nodes
it made are tagged with its path, and a backward op reads the tag of the node running it.
A parameter's gradient is the value the backward leaves in its `.grad`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._spec import TensorMeta

__all__ = ["Graph", "Node", "Ref", "trace_step"]

_TAG = "shardwise.path"


@dataclass(frozen=True)
class Ref:
    """Output `out` of node `node`."""

    node: int
    out: int = 0


@dataclass
class Node:
    """One op call (kind "op"), or a value the step starts from: a parameter ("param"), a
    model input ("input"), or a tensor made outside the trace ("const": buffers, constants)."""

    index: int
    kind: str
    op: Any
    args: tuple[Any, ...]  # tensors replaced by `Ref`s
    kwargs: dict[str, Any]
    outs: tuple[Optional[TensorMeta], ...]
    path: str
    backward: bool
    name: str = ""
    plain: bool = False  # made from constants only: a plain tensor at run time, not a DTensor

    def refs(self) -> list[Ref]:
        """The values this node reads: positional arguments, then keywords in the order the call
        gave them (the order an `OpSchema` of the call lists its DTensor inputs in)."""
        return [a for a in pytree.tree_leaves((self.args, list(self.kwargs.values()))) if isinstance(a, Ref)]


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)  # parameter name -> its node
    grads: dict[str, Ref] = field(default_factory=dict)  # parameter name -> its gradient
    inputs: list[int] = field(default_factory=list)

    def meta(self, ref: Ref) -> TensorMeta:
        m = self.nodes[ref.node].outs[ref.out]
        assert m is not None
        return m


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, tuple(t.stride()), t.dtype)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, graph: Graph) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.graph = graph
        self.values: dict[int, Ref] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while every traced tensor lives
        self.stack: list[str] = [""]

    def source(self, t: torch.Tensor, kind: str, name: str, path: str = "") -> int:
        g = self.graph
        node = Node(len(g.nodes), kind, None, (), {}, (_meta(t),), path, False, name, plain=kind == "const")
        g.nodes.append(node)
        self.values[id(t)] = Ref(node.index)
        self.keep.append(t)
        return node.index

    def ref(self, t: torch.Tensor) -> Ref:
        hit = self.values.get(id(t))
        if hit is None:
            self.source(t, "const", "", self.stack[-1])
            hit = self.values[id(t)]
        return hit

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs:
            return out
        g = self.graph
        as_refs = pytree.tree_map_only(torch.Tensor, self.ref, (args, kwargs))
        backward = torch._C._current_graph_task_id() != -1
        if backward:
            running = torch._C._current_autograd_node()
            path = "" if running is None else str(_meta_of(running).get(_TAG, ""))
        else:
            path = self.stack[-1]
        reads = [r for r in pytree.tree_leaves(as_refs) if isinstance(r, Ref)]
        node = Node(len(g.nodes), "op", func, tuple(as_refs[0]), dict(as_refs[1]), tuple(_meta(o) for o in outs),
                    path, backward, plain=all(g.nodes[r.node].plain for r in reads))
        g.nodes.append(node)
        for k, o in enumerate(outs):  # an in-place op's result is a new version of its input
            self.values[id(o)] = Ref(node.index, k)
            self.keep.append(o)
        return out


def _meta_of(fn: Any) -> dict[str, Any]:
    """An autograd node's own metadata dict (kept with the node, read back in the backward)."""
    return fn.metadata  # type: ignore[no-any-return]


def _tag(tensors: Any, path: str) -> None:
    """Tag the autograd nodes behind `tensors` not tagged yet with `path`."""
    todo = [t.grad_fn for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or _TAG in _meta_of(fn):
            continue
        _meta_of(fn)[_TAG] = path
        todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)


def trace_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor]) -> Graph:
    """The graph of one forward + loss + backward of `model` (meta parameters) on `inputs`."""
    graph = Graph()
    rec = _Recorder(graph)
    names = {id(m): n for n, m in model.named_modules()}
    for name, p in model.named_parameters():
        graph.params[name] = rec.source(p, "param", name, name.rpartition(".")[0])
    for name, b in model.named_buffers():
        rec.source(b, "const", name, name.rpartition(".")[0])
    for k, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            graph.inputs.append(rec.source(x, "input", str(k)))

    def pre(mod: nn.Module, args: Any) -> None:
        name = names.get(id(mod))
        if name is not None:
            _tag(args, rec.stack[-1])  # what the caller made before the call is the caller's
            rec.stack.append(name)

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        name = names.get(id(mod))
        if name is not None and rec.stack[-1] == name:
            _tag(out, name)
            rec.stack.pop()

    hooks = [nn.modules.module.register_module_forward_pre_hook(pre),
             nn.modules.module.register_module_forward_hook(post)]
    try:
        with rec:
            loss = loss_fn(model(*inputs))
            _tag(loss, "")
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for h in hooks:
            h.remove()
    for name, p in model.named_parameters():
        if p.grad is not None and id(p.grad) in rec.values:
            graph.grads[name] = rec.values[id(p.grad)]
    return graph
