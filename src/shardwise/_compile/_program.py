"""One traced signature as a program: the graph as plain code, and how to wrap what it returns.

A trace records what each output leaf is (`output_kinds`: a DTensor with its spec, a plain
tensor, one of the inputs, a constant) and which slots the function rebound
(`slot_writes`); a replay runs the graph on the inputs' local tensors and rebuilds the
outputs and the rebound slots from those records, with no DTensor dispatch. The graph's
collective records and host steps live as long as the program (`Trace.forget`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from .._tensor import DTensor
from ._replay_code import compile_graph
from ._signature import Slot, local_piece
from ._trace import Trace

__all__ = ["Program", "output_kinds", "slot_writes"]


class Program:
    """One traced signature: the graph, where its inputs come from, how to wrap its outputs."""

    __slots__ = ("forward", "out_tree", "outputs", "slot_writes", "forget", "begin", "failed")

    def __init__(self, gm: torch.fx.GraphModule, out_tree: Any, outputs: list[tuple[str, Any]],
                 slot_writes: list[tuple[int, Any]], trace: Trace) -> None:
        self.forward = compile_graph(gm)
        self.out_tree = out_tree
        # per output leaf: ("dtensor", spec) | ("tensor", None) | ("input", index) | ("const", value)
        self.outputs = outputs
        # per rebound slot: (slot index, ("dtensor", spec) | ("tensor", None) | ("none", None))
        self.slot_writes = slot_writes
        self.forget = trace.forget  # drops the graph's collective records and host steps
        self.begin, self.failed = trace.begin, trace.failed  # hooks of host work in the graph

    def __del__(self) -> None:
        self.forget()

    def run(self, inputs: list[Any], slots: list[Slot]) -> Any:
        for begin in self.begin:
            begin()
        try:
            with torch.no_grad():
                results = self.forward(*[local_piece(t) for t in inputs if isinstance(t, torch.Tensor)])
        except BaseException as exc:
            for failed in self.failed:
                failed(exc)
            raise
        k = 0
        leaves: list[Any] = []
        for kind, info in self.outputs:
            if kind == "dtensor":
                leaves.append(DTensor(results[k], info, requires_grad=False))
                k += 1
            elif kind == "tensor":
                leaves.append(results[k])
                k += 1
            elif kind == "input":
                leaves.append(inputs[info])
            else:
                leaves.append(info)
        for index, (kind, info) in self.slot_writes:
            setter = slots[index][1]
            assert setter is not None
            if kind == "none":
                setter(None)
            else:
                setter(DTensor(results[k], info, requires_grad=False) if kind == "dtensor" else results[k])
                k += 1
        return pytree.tree_unflatten(leaves, self.out_tree)


def output_kinds(out_leaves: list[Any], tensor_ids: dict[int, int]) -> list[tuple[str, Any]]:
    """What each output leaf of the traced call is (see `Program.outputs`)."""
    kinds: list[tuple[str, Any]] = []
    for t in out_leaves:
        if isinstance(t, torch.Tensor) and id(t) in tensor_ids:
            kinds.append(("input", tensor_ids[id(t)]))
        elif isinstance(t, DTensor):
            kinds.append(("dtensor", t._spec))
        elif isinstance(t, torch.Tensor):
            kinds.append(("tensor", None))
        else:
            kinds.append(("const", t))
    return kinds


def slot_writes(state: list[Any], after: list[Any]) -> list[tuple[int, tuple[str, Any]]]:
    """The slots the traced call rebound, and what to write there (see `Program.slot_writes`)."""
    writes: list[tuple[int, tuple[str, Any]]] = []
    for i, (old, new) in enumerate(zip(state, after)):
        if new is old or isinstance(old, frozenset):
            continue
        if new is None:
            writes.append((i, ("none", None)))
        else:
            writes.append((i, ("dtensor", new._spec) if isinstance(new, DTensor) else ("tensor", None)))
    # graph outputs list the rebound slots with a tensor in slot order; "none" writes take no output
    return writes
