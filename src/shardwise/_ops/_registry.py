"""The one registry of op rules: for each aten op overload, how it runs on DTensors.

An `OpRule` is everything shardwise knows about one overload:

| field | meaning |
|---|---|
| `kind` | how it runs (`OpKind`, below) |
| `strategy` | its candidate layouts (`OpSchema -> OpStrategy`; pure) |
| `local` | a local implementation run on the pieces instead of the aten op (random draws, masked lookups) |
| `relayout` | an in-place op that gives self a new shape or layout (`squeeze_`): self takes the result's |
| `plain_as_replicated` | plain tensors mixed with DTensors count as replicated (loss_parallel's targets) |
| `mode` | the mode this rule is the variant for, or None for the op's base rule |
| `scalars_free` | its float arguments never change a plan (plans cached by their type) |
| `positions_alike` | it treats every position of a sharded dim alike (fused projections' parts plan as `Shard`) |
| `metadata_only` | it reads only metadata, so a rank outside the mesh answers as one inside it (`is_same_size`) |
| `outside_answer` | what a rank outside the mesh returns, as torch's empty pieces would answer (`equal`: True) |

Facts read off the op itself are properties of the rule: `decomposition`, `lazy_view` (the
result is a lazy conj/neg view), `per_element` (a `_foreach_*` / `_fused_*` op), and what it
writes and returns (`written`, `returns_written`, `returns_nothing`, `fresh_outputs`, `inplace`).

`register_op_strategy(ops, ...)` is the one decorator that adds rules; `register_op_kind`
adds rules that have no strategy (replicated by design). Both refuse a second rule for the
same overload and mode, naming both places. A *mode* (`op_mode("loss_parallel")`) switches
an op to its variant rule while the mode is on; it is part of every cache key that
depends on it, never a swap of caches.

An overload nobody registered gets a rule derived once: `DECOMPOSED` when PyTorch has a
decomposition for it that writes none of its arguments (its pieces have rules) or a
composite kernel (`linear`, `matmul`: they reach dispatch whole only under
`inference_mode`), else `FALLBACK` (gathered and run replicated, with a warning).

>>> rule_for(torch.ops.aten.mm.default).kind
<OpKind.SHARDED: 'sharded'>
>>> rule_for(torch.ops.aten.nonzero.default).kind
<OpKind.REPLICATED: 'replicated'>
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch._decomp import decomposition_table

from ._local import LocalFn
from ._schema import OpSchema, StrategyType

__all__ = [
    "ACTIVE_MODES",
    "OpKind",
    "OpRule",
    "StrategyFn",
    "active_modes",
    "get_op_strategy",
    "op_mode",
    "register_op_kind",
    "register_op_strategy",
    "registered_ops",
    "rule_for",
]

OpOverload = torch._ops.OpOverload
# A strategy function maps an op call (global specs of its inputs, on an abstract or real
# mesh) to its candidate strategies. Pure: it never talks to processes.
StrategyFn = Callable[[OpSchema], StrategyType]


class OpKind(enum.Enum):
    """How an op runs on DTensors."""

    SHARDED = "sharded"  # its strategy picks the layouts; it runs on the local pieces
    POINTWISE = "pointwise"  # SHARDED, elementwise: inputs laid out alike
    VIEW = "view"  # SHARDED, a view or shape op
    REPLICATED = "replicated"  # by design: inputs gathered, run whole on every rank, no warning
    DECOMPOSED = "decomposed"  # no strategy: runs as PyTorch's decomposition, its pieces sharded
    FALLBACK = "fallback"  # no strategy, no decomposition: gathered, with a warning (strict: error)


@dataclass(frozen=True)
class OpRule:
    """What shardwise does with one aten op overload (see the module docstring)."""

    op: OpOverload
    kind: OpKind
    strategy: Optional[StrategyFn] = None
    local: Optional[LocalFn] = None
    relayout: bool = False
    plain_as_replicated: bool = False
    mode: Optional[str] = None
    where: str = ""
    # its float arguments (an lr, a bias correction, an eps) never change a plan: plans are
    # cached by their type, not their value (elementwise ops always; foreach and fused
    # optimizer steps by registration), so a value that changes every step makes no new plan
    scalars_free: bool = False
    # it treats every position of a sharded dim alike (a contraction, a sum, a factory that
    # reads no value), as elementwise and view ops do: an input split into the parts of a fused
    # projection (`_StridedShard`) can be planned as a plain `Shard` and read back as parts
    positions_alike: bool = False
    # it reads only metadata: a rank outside the mesh answers it as a rank inside does
    metadata_only: bool = False
    # what a rank outside the mesh returns (torch's empty pieces compare equal), if not tensors
    outside_answer: Optional[bool] = None

    @property
    def decomposition(self) -> Callable[..., Any]:
        """PyTorch's decomposition of the op (a `DECOMPOSED` rule runs it), else its composite kernel."""
        return decomposition_table.get(self.op) or self.op.decompose

    @property
    def lazy_view(self) -> bool:
        """Whether the op returns a lazy conjugate / negative view (a bit on the tensor), which a
        piece must materialize: its wrapper could not carry the bit."""
        return self.op._schema.name in _LAZY_VIEWS

    @property
    def per_element(self) -> bool:
        """A `_foreach_*` / `_fused_*` op: element k of each list meets only element k of the others."""
        name = self.op._schema.name
        return name.startswith("aten::_foreach_") or name.startswith("aten::_fused_")

    def written(self, n_args: int) -> set[Union[int, str]]:
        """Positions / names of the arguments a call with `n_args` positional arguments writes
        (in-place self, out= tensors)."""
        found: set[Union[int, str]] = set()
        for k, a in enumerate(self.op._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                found.add(a.name if a.kwarg_only or k >= n_args else k)
        return found

    @property
    def returns_written(self) -> bool:
        """Whether the op returns the arguments it writes (`add_`, `out=`) rather than new tensors
        (batch norm writes its running statistics but returns fresh outputs)."""
        returns = self.op._schema.returns
        return not returns or any(r.alias_info is not None and r.alias_info.is_write for r in returns)

    @property
    def returns_nothing(self) -> bool:
        """A `-> ()` op (`_foreach_add_`): it must return None to torch."""
        return not self.op._schema.returns

    @property
    def fresh_outputs(self) -> bool:
        """Whether every output is a new tensor (no view or alias of an argument)."""
        return not any(r.alias_info is not None for r in self.op._schema.returns)

    @property
    def inplace(self) -> bool:
        """Whether the op writes its first argument (self) in place."""
        arguments = self.op._schema.arguments
        return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write

    @property
    def floats_by_type(self) -> bool:
        """Whether plans of this op are cached by its float arguments' type, not their value."""
        return self.scalars_free or self.kind is OpKind.POINTWISE

    def __str__(self) -> str:
        extra = [name for name, on in (("local", self.local), ("relayout", self.relayout),
                                        ("plain as replicated", self.plain_as_replicated)) if on]
        mode = f" under {self.mode}" if self.mode else ""
        return f"{self.op}{mode}: {self.kind.value}" + (f" ({', '.join(extra)})" if extra else "")


# the ops whose result is a lazy conjugate / negative view of their input (no copy made)
_LAZY_VIEWS = frozenset({"aten::_conj", "aten::_neg_view"})
_RULES: dict[tuple[OpOverload, Optional[str]], OpRule] = {}
_DERIVED: dict[OpOverload, OpRule] = {}
_MODAL: set[OpOverload] = set()  # ops with a variant for some mode


def _caller() -> str:
    """file:line of the registration: the caller of the public function calling this."""
    frame = sys._getframe(2)
    path = frame.f_code.co_filename
    short = path[path.rfind("shardwise/"):] if "shardwise/" in path else path
    return f"{short}:{frame.f_lineno}"


def _add(rule: OpRule) -> None:
    if not isinstance(rule.op, OpOverload):
        raise TypeError(f"op rules are registered for aten op overloads (aten.add.Tensor), got {rule.op!r}")
    key = (rule.op, rule.mode)
    old = _RULES.get(key)
    if old is not None:
        mode = f" under mode {rule.mode!r}" if rule.mode else ""
        raise ValueError(
            f"{rule.op}{mode} already has a rule, registered at {old.where}; a second one at {rule.where} would "
            f"silently replace it: keep one (exclude the op from one of the lists)"
        )
    _RULES[key] = rule
    if rule.mode is not None:
        _MODAL.add(rule.op)


Ops = Union[OpOverload, Iterable[OpOverload]]


def _targets(ops: Ops) -> list[OpOverload]:
    return [ops] if isinstance(ops, OpOverload) else list(ops)


def register_op_strategy(
    ops: Ops,
    *,
    kind: OpKind = OpKind.SHARDED,
    local: Union[LocalFn, Mapping[OpOverload, LocalFn], None] = None,
    relayout: Iterable[OpOverload] = (),
    mode: Optional[str] = None,
    plain_as_replicated: bool = False,
    scalars_free: bool = False,
    positions_alike: bool = False,
    metadata_only: bool = False,
) -> Callable[[StrategyFn], StrategyFn]:
    """Register the decorated strategy function for one aten op overload or a list of them::

        @register_op_strategy([aten.relu.default, aten.gelu.default], kind=OpKind.POINTWISE)
        def activation_strategy(schema: OpSchema) -> OpStrategy: ...

    `local`: a local implementation for every op, or one per op (a mapping); `relayout`: the
    ops among `ops` that give self a new layout in place; `mode`: register the variant used
    while that mode is on (the op's base rule is registered separately); `scalars_free`: the
    ops' float arguments never change their layouts or shapes (see `OpRule.scalars_free`);
    `positions_alike`: they treat every position of a sharded dim alike (`OpRule.positions_alike`);
    `metadata_only`: they read only metadata (`OpRule.metadata_only`)."""
    targets = _targets(ops)
    reshaping = set(relayout)
    where = _caller()

    def wrap(fn: StrategyFn) -> StrategyFn:
        for op in targets:
            impl = local.get(op) if isinstance(local, Mapping) else local
            _add(OpRule(op, kind, fn, impl, op in reshaping, plain_as_replicated, mode, where, scalars_free,
                        positions_alike, metadata_only))
        return fn

    return wrap


def register_op_kind(
    ops: Ops,
    kind: OpKind,
    *,
    local: Union[LocalFn, Mapping[OpOverload, LocalFn], None] = None,
    relayout: Iterable[OpOverload] = (),
    outside_answers: Optional[Mapping[OpOverload, bool]] = None,
) -> None:
    """Register rules without a strategy (`OpKind.REPLICATED`: run whole on every rank);
    `outside_answers`: what a rank outside the mesh returns for some of them (`OpRule.outside_answer`)."""
    if kind is not OpKind.REPLICATED:
        raise ValueError(f"register_op_kind registers {OpKind.REPLICATED}, got {kind}: give other kinds a strategy")
    reshaping = set(relayout)
    where = _caller()
    for op in _targets(ops):
        impl = local.get(op) if isinstance(local, Mapping) else local
        answer = None if outside_answers is None else outside_answers.get(op)
        _add(OpRule(op, kind, None, impl, op in reshaping, False, None, where, outside_answer=answer))


def _writes_an_argument(op: OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _derived(op: OpOverload) -> OpRule:
    rule = _DERIVED.get(op)
    if rule is None:
        if op in decomposition_table and not _writes_an_argument(op):
            rule = OpRule(op, OpKind.DECOMPOSED, where="torch._decomp")
        elif torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), torch._C.DispatchKey.CompositeImplicitAutograd):  # type: ignore[no-untyped-call]
            # reaches dispatch only under inference_mode (linear, matmul): its composite kernel
            rule = OpRule(op, OpKind.DECOMPOSED, where="CompositeImplicitAutograd")
        else:
            rule = OpRule(op, OpKind.FALLBACK, where="(none registered)")
        _DERIVED[op] = rule
    return rule


# The modes on now, in a one-element list: dispatch reads `ACTIVE_MODES[0]` on every call
# (the same frozenset object until a mode changes) and keys its plans with it.
ACTIVE_MODES: list[frozenset[str]] = [frozenset()]
_MODES = ACTIVE_MODES


def active_modes() -> frozenset[str]:
    """The modes on now."""
    return _MODES[0]


@contextlib.contextmanager
def op_mode(name: str) -> Iterator[None]:
    """Inside the block, ops with a variant rule for mode `name` use it."""
    before = _MODES[0]
    _MODES[0] = before | {name}
    try:
        yield
    finally:
        _MODES[0] = before


def rule_for(op: OpOverload, modes: Optional[frozenset[str]] = None) -> OpRule:
    """The rule `op` runs by under `modes` (default: the modes on now)."""
    if op in _MODAL:
        for mode in sorted(_MODES[0] if modes is None else modes):
            variant = _RULES.get((op, mode))
            if variant is not None:
                return variant
    rule = _RULES.get((op, None))
    return rule if rule is not None else _derived(op)


def get_op_strategy(op: OpOverload) -> Optional[StrategyFn]:
    """The strategy function of `op`'s base rule, if it has one."""
    rule = _RULES.get((op, None))
    return None if rule is None else rule.strategy


def registered_ops() -> list[OpOverload]:
    """Every overload with a registered base rule."""
    return [op for op, mode in _RULES if mode is None]


def registered_rules() -> list[OpRule]:
    """Every registered rule, variants included, in registration order."""
    return list(_RULES.values())


__all__ += ["registered_rules"]
