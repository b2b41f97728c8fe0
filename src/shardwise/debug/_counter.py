"""`CommCounter`: the collectives of a block of code, per module and per pass.

Every collective goes through one door (`_comm`); the counter watches it and files each
record under the module running at that moment and the pass: forward, or backward (the
autograd engine is running). Modules are followed by hooks on the model given: a forward
pre-hook and hook keep a stack of the modules in their forward; in backward a module is
entered when the first gradient of its outputs is ready and left when the gradients of its
inputs are (multi-grad hooks), so a collective of its backward is filed under it. A
collective outside every module of the model is filed under the model itself (path "").

    with CommCounter(model) as counter:
        loss_fn(model(x), y).backward()
    print(counter)                 # a tree: per module, forward and backward, count and bytes
    counter.totals()               # {"all_reduce": (count, bytes), ...}
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._comm import CommRecord, Interceptor, intercept

__all__ = ["CommCounter"]

PASSES = ("forward", "backward")
Tally = dict[str, list[int]]  # collective kind -> [count, bytes received]


class _Observer(Interceptor):
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def observe(self, record: CommRecord) -> None:
        self.counter._file(record)


class CommCounter:
    """Counts the collectives issued inside the block, and the bytes this rank receives, per
    module path of `model` (its `named_modules` names; "" the model itself), forward and
    backward separately. Point-to-point messages count as their op ("send" / "recv")."""

    def __init__(self, model: Optional[nn.Module] = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"CommCounter follows an nn.Module's submodules, got {type(model).__name__}: pass the "
                            "model (or nothing, to count without module paths)")
        self.model = model
        self.counts: dict[str, dict[str, Tally]] = defaultdict(lambda: {p: defaultdict(lambda: [0, 0]) for p in PASSES})
        self._forward: list[str] = []
        self._backward: list[str] = []
        self._handles: list[RemovableHandle] = []
        self._context: Any = None

    # -- the block --------------------------------------------------------------------------

    def __enter__(self) -> CommCounter:
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._entered(name)))
                self._handles.append(module.register_forward_hook(self._left(name)))
        self._context = intercept(_Observer(self))
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _entered(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._forward.append(name)
            inputs = [t for t in _tensors(args) if t.requires_grad]
            if inputs and torch.is_grad_enabled():  # its backward ends when its inputs' gradients are ready
                torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: self._leave_backward(name))
        return hook

    def _left(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._forward and self._forward[-1] == name:
                self._forward.pop()
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if outputs and torch.is_grad_enabled():  # its backward starts with its outputs' first gradient
                torch.autograd.graph.register_multi_grad_hook(outputs, lambda grad: self._backward.append(name),
                                                              mode="any")
        return hook

    def _leave_backward(self, name: str) -> None:
        if name in self._backward:  # and whatever started inside it and never saw its inputs' gradients
            del self._backward[len(self._backward) - 1 - self._backward[::-1].index(name):]

    def _file(self, record: CommRecord) -> None:
        backward = torch._C._current_graph_task_id() != -1
        stack = self._forward if self._forward else (self._backward if backward else [])
        tally = self.counts[stack[-1] if stack else ""]["backward" if backward else "forward"][record.op]
        tally[0] += 1
        tally[1] += record.bytes_received

    # -- reading ----------------------------------------------------------------------------

    def totals(self, which: Optional[str] = None) -> dict[str, tuple[int, int]]:
        """(count, bytes received) per collective kind over every module, of one pass or both."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for passes in self.counts.values():
            for p in PASSES if which is None else (which,):
                for kind, (n, b) in passes[p].items():
                    out[kind][0] += n
                    out[kind][1] += b
        return {kind: (n, b) for kind, (n, b) in sorted(out.items())}

    def to_dict(self) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        """{module path: {pass: {kind: {"count": n, "bytes": b}}}} for the modules that communicated."""
        return {path: {p: {k: {"count": n, "bytes": b} for k, (n, b) in sorted(passes[p].items())}
                       for p in PASSES if passes[p]}
                for path, passes in sorted(self.counts.items()) if any(passes[p] for p in PASSES)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        rows = self.to_dict()
        if not rows:
            return "no collectives"
        paths = sorted(set(rows) | {".".join(p.split(".")[:k]) for p in rows for k in range(1, p.count(".") + 1)})
        lines = [f"{'module':<40} {'forward':<36} backward"]
        for path in paths:
            depth = path.count(".") + 1 if path else 0
            label = ("  " * depth + (path.rsplit(".", 1)[-1] if path else "(model)"))[:40]
            entry = rows.get(path, {})
            lines.append(f"{label:<40} {_cell(entry.get('forward', {})):<36} {_cell(entry.get('backward', {}))}".rstrip())
        total = {p: self.totals(p) for p in PASSES}
        lines.append(f"{'total':<40} {_cell_of(total['forward']):<36} {_cell_of(total['backward'])}".rstrip())
        return "\n".join(lines)


def _cell(kinds: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{k} x{v['count']} {_size(v['bytes'])}" for k, v in kinds.items())


def _cell_of(kinds: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{k} x{n} {_size(b)}" for k, (n, b) in kinds.items())


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
