"""Strategies for the matmul family: mm, bmm, mv, dot, vdot, and the add-forms addmm,
baddbmm, addbmm, addmv, addr (plus their in-place variants).

`matmul`, `linear`, `einsum`, `tensordot` and `outer` decompose before dispatch into these
(and views); so do their backwards (`mm`/`bmm` of transposes, `sum` for a bias grad).

Each op is a contraction written in einsum labels (`mm` is `mk,kn->mn`). Along one mesh
dim it can run as:

| option | output | operands | bias (`self` of the add-forms) |
|---|---|---|---|
| a kept label (m, n, batch b) split | S(its dim) | S where the label is, else R | S unless broadcast there, else R |
| a contracted label (k) split | P(sum) | S where the label is, else R | P(sum) |
| linear in one operand | P(op), op sum or avg | that one P(op), the other R | P(op) |
| replicated | R | R | R |

A Partial output needs a Partial bias: `out = beta * self + alpha * m1 @ m2` summed over
ranks would count a replicated `self` once per rank. With `beta == 0` torch ignores `self`,
so then it only has to be replicated.

An output is split or Partial along a mesh dim only where an input already is (`anchored`):
chunking replicated inputs is free under the byte cost model, so without that rule a
replicated `mm` would be split, or worse turned into partial sums whose reduction the next
op pays for. shardwise follows the splits the user made; it does not start new ones.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Sequence
from typing import Any, Optional

import torch

from .._placement import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec, TensorMeta
from ._registry import register_op_strategy
from ._schema import OpSchema, OpStrategy
from ._utils import expand_to_mesh

__all__ = ["CONTRACTIONS", "anchored", "contraction_options", "contraction_strategy", "linear_partial_ops"]

aten = torch.ops.aten

# op -> (labels of each operand, labels of the output, whether argument 0 is an added bias)
CONTRACTIONS: dict[Any, tuple[tuple[str, str], str, bool]] = {
    aten.mm.default: (("mk", "kn"), "mn", False),
    aten.bmm.default: (("bmk", "bkn"), "bmn", False),
    aten.mv.default: (("mk", "k"), "m", False),
    aten.dot.default: (("k", "k"), "", False),
    aten.vdot.default: (("k", "k"), "", False),
    aten.addmm.default: (("mk", "kn"), "mn", True),
    aten.addmm_.default: (("mk", "kn"), "mn", True),
    aten.baddbmm.default: (("bmk", "bkn"), "bmn", True),
    aten.baddbmm_.default: (("bmk", "bkn"), "bmn", True),
    aten.addbmm.default: (("bmk", "bkn"), "mn", True),
    aten.addbmm_.default: (("bmk", "bkn"), "mn", True),
    aten.addmv.default: (("mk", "k"), "m", True),
    aten.addmv_.default: (("mk", "k"), "m", True),
    aten.addr.default: (("m", "n"), "mn", True),
    aten.addr_.default: (("m", "n"), "mn", True),
}

_LINEAR_OPS = ("sum", "avg")  # reductions that commute with a (bi)linear map


def linear_partial_ops(spec: Optional[DTensorSpec]) -> list[str]:
    """The Partial reductions `spec` holds on some mesh dim that commute with a linear map."""
    held = {p.reduce_op for p in spec.placements if isinstance(p, Partial)} if spec is not None else set()
    return [op for op in _LINEAR_OPS if op in held]


def _bias_shard(bias: DTensorSpec, out_shape: Sequence[int], out_dim: int) -> Placement:
    """Bias placement under an output split on `out_dim`: split the same way unless broadcast."""
    d = out_dim - (len(out_shape) - bias.ndim)
    if d < 0 or bias.shape[d] != out_shape[out_dim]:
        return Replicate()
    return Shard(d)


def contraction_options(
    labels: tuple[str, str], out: str, out_shape: Sequence[int], operands: Sequence[DTensorSpec],
    bias: Optional[DTensorSpec], bias_counts: bool,
) -> list[tuple[Placement, ...]]:
    """Per-mesh-dim options `(output, [bias], operand 0, operand 1)` of one contraction.

    `bias`: the added tensor when it is a DTensor input (it then has a placement in every
    option); `bias_counts`: the op adds a bias with beta != 0, so a Partial output needs a
    Partial bias (and is impossible when the bias is a plain 0-dim tensor, added on every rank).

    >>> [" ".join(map(str, o)) for o in contraction_options(("mk", "kn"), "mn", (8, 6), [], None, False)]
    ['S(0) S(0) R', 'S(1) R S(1)', 'P(sum) S(1) S(0)']
    """
    options: list[tuple[Placement, ...]] = []

    def add(o: Placement, ops: tuple[Placement, Placement], b: Placement) -> None:
        if isinstance(o, Partial) and bias_counts:
            if bias is None:
                return
            b = o
        options.append((o, b, *ops) if bias is not None else (o, *ops))

    def split(label: str) -> tuple[Placement, Placement]:
        a, b = (Shard(ls.index(label)) if label in ls else Replicate() for ls in labels)
        return a, b

    for d, label in enumerate(out):  # kept labels: batch and free dims
        add(Shard(d), split(label), _bias_shard(bias, out_shape, d) if bias is not None else Replicate())
    for label in sorted(set(labels[0] + labels[1]) - set(out)):  # contracted labels
        add(Partial("sum"), split(label), Replicate())
    for k, spec in enumerate(operands):  # linear in one operand
        for op in linear_partial_ops(spec):
            ps: list[Placement] = [Replicate(), Replicate()]
            ps[k] = Partial(op)
            add(Partial(op), (ps[0], ps[1]), Replicate())
    return options


def anchored(
    strategy: OpStrategy, specs: Sequence[DTensorSpec], partial_anchors: Optional[Sequence[bool]] = None
) -> OpStrategy:
    """Keep the candidates that split or partialize an output along a mesh dim only where an
    input already has the placement the candidate asks of it there, and that ask no input to
    become a Partial it is not (the propagator would refuse those anyway).

    `partial_anchors[k]`: whether input k may justify a Partial output (a bias may not: a
    Partial bias alone would turn a cheap bias reduction into a reduction of the output).
    """
    anchors = list(partial_anchors) if partial_anchors is not None else [True] * len(specs)
    kept = []
    for cand in strategy.strategies:
        wanted = [lay.placements if lay is not None else s.placements for s, lay in zip(specs, cand.input_specs)]
        if any(
            isinstance(w, Partial) and w != h and not (k in cand.partialize and isinstance(h, Replicate))
            for k, (s, ws) in enumerate(zip(specs, wanted))
            for h, w in zip(s.placements, ws)
        ):
            continue
        outs = cand.output_specs if isinstance(cand.output_specs, tuple) else (cand.output_specs,)
        ok = True
        for i in range(len(specs[0].placements) if specs else 0):
            placed = [o.placements[i] for o in outs if o is not None]
            same = [k for k, (s, ws) in enumerate(zip(specs, wanted))
                    if not isinstance(ws[i], Replicate) and ws[i] == s.placements[i]]
            if any(isinstance(p, Partial) for p in placed):
                ok = any(anchors[k] for k in same)
            elif any(isinstance(p, Shard) for p in placed):
                ok = bool(same)
            if not ok:
                break
        if ok:
            kept.append(cand)
    return OpStrategy(kept)


def contraction_strategy(schema: OpSchema) -> OpStrategy:
    """Candidates for one call of an op in `CONTRACTIONS`."""
    labels, out, has_bias = CONTRACTIONS[schema.op]
    first = 1 if has_bias else 0
    operands = [schema.args_schema[first], schema.args_schema[first + 1]]
    assert all(isinstance(s, DTensorSpec) for s in operands)
    bias = schema.args_schema[0] if has_bias and isinstance(schema.args_schema[0], DTensorSpec) else None
    out_meta = schema.output_meta()
    assert isinstance(out_meta, TensorMeta)
    bias_counts = has_bias and schema.arg(3, "beta", 1) != 0
    options = contraction_options(labels, out, out_meta.shape, operands, bias, bias_counts)
    specs = schema.input_specs()
    strategy = expand_to_mesh(specs[0].mesh.ndim, options)
    if bias is not None:
        # a replicated bias joins partial sums by being added on one rank only (free)
        strategy = OpStrategy([
            dataclasses.replace(c, partialize=(0,))
            if c.input_specs[0] is not None and any(isinstance(p, Partial) for p in c.input_specs[0].placements)
            else c
            for c in strategy.strategies
        ])
    return anchored(strategy, specs, [False, True, True] if bias is not None else [True, True])


register_op_strategy(list(CONTRACTIONS), positions_alike=True)(contraction_strategy)
