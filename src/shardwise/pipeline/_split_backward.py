"""A stage's backward in two parts: B, the inputs' gradients now, and W, the weights', later.

Zero-bubble schedules (ZB-H1, ZBV, DualPipeV) send a stage's input gradients upstream as soon
as they exist and fill the bubbles with the weight gradients afterwards. `backward_input` is
B: one autograd pass from the roots to the stage's inputs, which returns the inputs'
gradients and a `WeightGrad`. Its `run()` is W: it accumulates into `.grad` of every other
leaf (the weights, and anything else that needs a gradient) what one
`torch.autograd.backward(roots, grads)` would, through the usual AccumulateGrad nodes, so
parameter hooks and post-accumulate-grad hooks (FSDP's gradient reduction) fire in W, once.

How the graph is cut. The *B side* is the nodes that lead to an input; B runs only those.
Every other node (the *W side*) runs in W. Where the B side feeds the W side, the gradient
crosses in one of two ways:

- *re-run*: the B-side node (an *intermediate*, e.g. a Linear's `AddmmBackward0`, whose
  outputs are dx and dW) runs in B for its B-side outputs only; a pre-hook keeps the
  gradient it received, and W runs it again from that gradient for its W-side outputs
  only. That second run holds the work W exists for: the weight-gradient matmuls.
- *kept*: B computes the gradient into the W-side node itself. That is for the cases
  where a second run would be wrong or would cost another recomputation: when it would
  also flow into the B side (the bias of a Linear applied twice), or when the node's
  saved tensors sit behind saved-tensor hooks, as under `torch.utils.checkpoint`, whose
  hooks allow one unpack per backward: the recomputation then happens once, in B.

W runs the W side from the kept and re-run gradients in *parts*: the crossings whose W-side
nodes below them overlap go together, re-run in B's order and then sent on in one pass, so
each sum into a weight's gradient is formed as plain backward forms it: bit for bit, unless
one sum mixes three terms or more from both sides of the cut (then only the order of its
additions differs). Parts that share no node are independent, and each accumulates before
the next re-runs: a stage of Linear layers holds one weight gradient at a time, as plain
backward does, not one per layer (which costs fresh memory and cache, a few percent of W).
B keeps the graph only when some intermediate is re-run; W frees all it holds.

>>> import torch
>>> layer = torch.nn.Linear(3, 2)
>>> x = torch.ones(4, 3, requires_grad=True)
>>> (dx,), w = backward_input([layer(x).sum()], None, [x])
>>> dx.shape, layer.weight.grad
(torch.Size([4, 3]), None)
>>> w.run(); layer.weight.grad.shape
torch.Size([2, 3])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrad", "backward_input"]

Slot = tuple[Node, int]  # where a gradient flows in: a node and the index of one of its inputs


class WeightGrad:
    """W of one `backward_input`: `run()`, once, accumulates what B left for the W side, part
    by part (see the module docstring)."""

    def __init__(self, parts: list[_Part]) -> None:
        self._parts, self._ran = parts, False

    def run(self) -> None:
        if self._ran:
            raise ValueError("WeightGrad.run(): this W has run already; each backward_input() gives one W "
                             "to run once (run B again, with a new forward, for another W)")
        self._ran = True
        parts, self._parts = self._parts, []
        while parts:
            parts.pop(0).run()


class _Part:
    """Crossings of the cut whose W-side nodes overlap: re-runs (node, the gradients it got in
    B, the W-side slots it runs for), in B's order, and the gradients B kept at W-side slots."""

    def __init__(self) -> None:
        self.reruns: list[tuple[Node, tuple[Optional[Tensor], ...], list[Slot]]] = []
        self.kept: list[tuple[Slot, Tensor]] = []

    def run(self) -> None:
        flows, self.kept = self.kept, []
        for node, grads, slots in self.reruns:  # in B's order, so sums into one slot add up as plain backward's
            given = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
            with _leaf_hooks_off(slots):
                got = torch.autograd.grad([e for e, _ in given], [GradientEdge(*s) for s in slots],
                                          [g for _, g in given], allow_unused=True)
            flows += [(s, g) for s, g in zip(slots, got) if g is not None]
        self.reruns = []
        if flows:
            torch.autograd.backward([GradientEdge(*s) for s, _ in flows], [g for _, g in flows])


def backward_input(roots: Sequence[Tensor], grads: Optional[Sequence[Optional[Tensor]]],
                   inputs: Sequence[Tensor]) -> tuple[list[Optional[Tensor]], WeightGrad]:
    """B: the gradients of `inputs` (None for one that needs none or that the roots do not
    reach) and the `WeightGrad` that is W. `roots`: the stage's outputs, or its loss; `grads`:
    theirs (None for a loss, as in `backward`); roots that need no gradient are skipped.
    Leaves that are not inputs get their `.grad` in W only; inputs' `.grad` is not touched."""
    pairs = _pairs(roots, grads)
    wanted = [k for k, x in enumerate(inputs) if x.requires_grad]
    results: list[Optional[Tensor]] = [None] * len(inputs)
    if not pairs:
        return results, WeightGrad([])
    root_slots = [_slot(t) for t, _ in pairs]
    input_slots = [_slot(inputs[k]) for k in wanted]
    floor = {node for node, _ in input_slots}
    graph = _Graph([node for node, _ in root_slots], floor)
    reruns, kept_slots = _cut(graph, root_slots, floor)
    seen: dict[Node, tuple[Optional[Tensor], ...]] = {}
    handles = [node.register_prehook(_Keep(node, seen)) for node in reruns]
    try:
        with _leaf_hooks_off(kept_slots):
            got = torch.autograd.grad([t for t, _ in pairs], [GradientEdge(*s) for s in input_slots + kept_slots],
                                      [g for _, g in pairs], retain_graph=bool(reruns), allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for k, g in zip(wanted, got):
        results[k] = g
    kept = [(s, g) for s, g in zip(kept_slots, got[len(input_slots):]) if g is not None]
    return results, WeightGrad(_parts(graph, [(node, grads_in, reruns[node]) for node, grads_in in seen.items()],
                                      kept))


def _parts(graph: _Graph, reruns: list[tuple[Node, tuple[Optional[Tensor], ...], list[Slot]]],
           kept: list[tuple[Slot, Tensor]]) -> list[_Part]:
    """The crossings grouped into parts whose W-side nodes (the slots' nodes and all below them)
    overlap, in the order of each part's first crossing; within a part, B's order."""
    def below(slots: Sequence[Slot]) -> int:
        bits = 0
        for node, _ in slots:
            bits |= graph.bit[node] | graph.below[node]
        return bits

    masks = [below([slot]) for slot, _ in kept] + [below(slots) for _, _, slots in reruns]
    owner = list(range(len(masks)))  # union-find over the crossings

    def root(k: int) -> int:
        while owner[k] != k:
            owner[k] = owner[owner[k]]
            k = owner[k]
        return k

    seen: dict[int, int] = {}  # a W-side node's bit -> a crossing above it
    for k, bits in enumerate(masks):
        while bits:
            low = bits & -bits
            bits ^= low
            other = seen.setdefault(low, k)
            owner[root(k)] = root(other)
    parts: dict[int, _Part] = {}
    for k, (slot, g) in enumerate(kept):
        parts.setdefault(root(k), _Part()).kept.append((slot, g))
    for k, rerun in enumerate(reruns, len(kept)):
        parts.setdefault(root(k), _Part()).reruns.append(rerun)
    return list(parts.values())


def _pairs(roots: Sequence[Tensor], grads: Optional[Sequence[Optional[Tensor]]]) -> list[tuple[Tensor, Optional[Tensor]]]:
    if grads is not None and len(grads) != len(roots):
        raise ValueError(f"backward_input: {len(roots)} roots but {len(grads)} grads: give one gradient per root "
                         "(None for a one-element loss), or grads=None when every root is a loss")
    pairs = []
    for k, t in enumerate(roots):
        g = None if grads is None else grads[k]
        if not t.requires_grad:
            continue
        if g is None and t.numel() != 1:
            raise ValueError(f"backward_input: roots[{k}] has shape {tuple(t.shape)} and no gradient: give "
                             f"grads[{k}] (only a one-element root, a loss, may go without)")
        pairs.append((t, g))
    return pairs


def _slot(t: Tensor) -> Slot:
    edge = get_gradient_edge(t)
    return edge.node, edge.output_nr


class _Keep:
    """B's pre-hook on an intermediate: keeps the gradient it is about to run on."""

    def __init__(self, node: Node, seen: dict[Node, tuple[Optional[Tensor], ...]]) -> None:
        self.node, self.seen = node, seen

    def __call__(self, grads: tuple[Optional[Tensor], ...]) -> None:
        if any(g is not None for g in grads):
            self.seen[self.node] = tuple(grads)


class _Graph:
    """The backward graph below some nodes, children before parents; `floor` nodes end it."""

    def __init__(self, starts: Sequence[Node], floor: set[Node]) -> None:
        self.order: list[Node] = []
        self.children: dict[Node, list[Slot]] = {}
        for start in starts:
            if start in self.children:
                continue
            self.children[start] = kids = _kids(start, floor)
            stack = [(start, iter(kids))]
            while stack:
                node, rest = stack[-1]
                for child, _ in rest:
                    if child not in self.children:
                        self.children[child] = grandkids = _kids(child, floor)
                        stack.append((child, iter(grandkids)))
                        break
                else:
                    stack.pop()
                    self.order.append(node)
        index = {node: i for i, node in enumerate(self.order)}
        self.bit = {node: 1 << i for node, i in index.items()}
        self.below: dict[Node, int] = {}  # each node's descendants, one bit per node
        for node in self.order:
            bits = 0
            for child, _ in self.children[node]:
                bits |= self.bit[child] | self.below[child]
            self.below[node] = bits

    def leading_to(self, targets: set[Node]) -> set[Node]:
        """The nodes with a path of one edge or more to one of `targets`."""
        bits = sum(self.bit[t] for t in targets if t in self.bit)
        return {node for node in self.order if self.below[node] & bits}


def _kids(node: Node, floor: set[Node]) -> list[Slot]:
    return [] if node in floor else [(child, k) for child, k in node.next_functions if child is not None]


def _cut(graph: _Graph, root_slots: list[Slot], floor: set[Node]) -> tuple[dict[Node, list[Slot]], list[Slot]]:
    """Where the B side meets the W side: the intermediates W re-runs (with the slots it runs
    them for) and the slots whose gradient B keeps. Keeping a slot can move nodes to the B
    side, so this repeats until nothing moves (once or twice in practice)."""
    hooked: dict[Node, bool] = {}

    def behind_hooks(node: Node) -> bool:
        if node not in hooked:
            hooked[node] = _saves_behind_hooks(node)
        return hooked[node]

    kept = {node for node, _ in root_slots if node not in floor}
    while True:
        b_side = graph.leading_to(floor | kept)
        reruns: dict[Node, list[Slot]] = {}
        more: set[Node] = set()
        for node in graph.order:
            kids = graph.children[node]
            if node not in b_side:
                if node not in floor and behind_hooks(node):
                    more |= {child for child, _ in kids}  # it runs in B: its children's gradients are kept
                continue
            out = [(child, k) for child, k in kids if child not in b_side and child not in kept and child not in floor]
            if not out:
                continue
            if behind_hooks(node):
                more |= {child for child, _ in out}  # B runs it for all its outputs
                continue
            bad = _not_alone(graph, kids, {child for child, _ in out})
            more |= bad
            if not bad:
                reruns[node] = out
        more -= kept
        if not more:
            break
        kept |= more
    slots = [s for s in root_slots if s[0] in kept and s[0] not in b_side]
    slots += [(child, k) for node in graph.order if node in b_side
              for child, k in graph.children[node] if child in kept and child not in b_side]
    return reruns, list(dict.fromkeys(slots))


def _not_alone(graph: _Graph, kids: list[Slot], targets: set[Node]) -> set[Node]:
    """The targets that a re-run would not reach alone: those below another child of the node
    (the run would go through it) and those below another target (it would run first)."""
    bad = set()
    for target in targets:
        bit = graph.bit[target]
        if any(graph.below[child] & bit for child, _ in kids):
            bad.add(target)
    return bad


@contextmanager
def _leaf_hooks_off(slots: Sequence[Slot]) -> Iterator[None]:
    """Silence the tensor hooks of the leaves whose gradient is taken at `slots` (autograd
    runs a tensor's hooks when it hands its gradient back): they run when W accumulates it."""
    off: list[tuple[dict[int, object], dict[int, object]]] = []
    for node, _ in slots:
        hooks = getattr(getattr(node, "variable", None), "_backward_hooks", None)
        if hooks:
            off.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in off:
            hooks.update(saved)


def _saves_behind_hooks(node: Node) -> bool:
    """Whether a tensor `node` saved unpacks through saved-tensor hooks (checkpointing,
    offloading): such hooks may allow one unpack per backward, so the node runs once, in B."""
    for name in _saved_names(type(node)):
        saved = getattr(node, name)
        for s in saved if isinstance(saved, (list, tuple)) else (saved,):
            if getattr(s, "unpack_hook", None) is not None:
                return True
    return False


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}  # per autograd node class: its saved tensors' attributes


def _saved_names(cls: type) -> tuple[str, ...]:
    names = _SAVED_NAMES.get(cls)
    if names is None:  # (one `dir` per node class: a backward walks hundreds of nodes of a few classes)
        names = _SAVED_NAMES[cls] = tuple(n for n in dir(cls) if n.startswith("_raw_saved_"))
    return names
