"""Eager dispatch of an aten op on DTensors: look up the plan, run it.

The first call with a given op, modes, argument layouts and non-tensor arguments describes
the call (`_ops.OpCall`: specs, scalars, this rank's coordinate, modes) and asks `_ops` for
its plan (`make_plan`, one pure step: the rule, propagation, the moves each input needs,
output specs, local shapes, write-backs). This module only turns that plan into a runner
(`_plans`, `_strided`), through one table from plan type to the function that builds its
runner (`_RUNNERS`: a new plan type is one entry there; one without an entry raises, named):
the moves' programs (`move_between`) and the outputs' wrappers, made once. Every later call
with the same key is a dictionary lookup followed by the runner's `run`.

An argument the op writes (in-place self, `out=`) that had to be moved is written back
into the layout it had, so a DTensor never changes layout behind its owner's back; a plain
one counts as replicated and receives the whole value (`plain.add_(dtensor)` stays plain).

The path of one call, `torch.mm(a, b)` with `a` S(0) and `b` R on a (4,) mesh:

| layer | function | does |
|---|---|---|
| tensor | `DTensor.__torch_dispatch__` = `torch_dispatch` | keys the call; a hit goes straight to `LeanPlan.run` |
| tensor | `_make_plan` (first call only) | the call described as an `OpCall` |
| ops | `make_plan` -> `rule_for` | the op's rule: `SHARDED`, strategy `_matmul.contraction_strategy` |
| ops | `propagate` -> `_choose` -> `_pick` | every candidate priced by `redistribute_cost` |
| redistribute | `plan_between` -> `plan_redistribute` | the cost of each input move; (S(0), R) -> S(0) moves nothing |
| ops | `_plan._sharded` | the frozen `RunSharded`: no move, output S(0), lean |
| tensor | `_RUNNERS[RunSharded]` = `_sharded` | `Wrapper` of the output, `LeanPlan` |
| tensor | `LeanPlan.run` | the C op on the local pieces, the S(0) output wrapped |

A move would add `move_between` (the runner's program, made once) to `_sharded` and
`run_program` -> `_comm.run(record)` to every call.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _comm as comm
from .._explicit import check_explicit
from .._mesh import CACHE_SIZES, PER_RANK_CACHES, DryMesh
from .._layout import contiguous_strides
from .._mesh import AbstractMesh, DeviceMesh
from .._ops import (ACTIVE_MODES, LOSS_PARALLEL_OPS, CatParts, OpCall, OpRule, PlainTensor, RunDecomposed, RunOutside,
                   RunPerMesh, RunSharded, ScalarTensor, SliceBackwardParts, SliceParts, SplitParts, Unstride, make_plan,
                   op_mode, rule_for)
from .._ops import LOSS_PARALLEL as _LOSS_MODE
from .._spec import DTensorSpec, TensorMeta
from ._grad_reduce import watch_plain_leaf
from ._plain import check_plain, forget_checks, meets_plain
from ._torch_loss import torch_loss_parallel_on
from ._plans import (ByMeshPlan, DecomposedPlan, GeneralPlan, LeanPlan, OutsidePlan, Plan, RestridedPlan, ViewPlan,
                     implicit, implicit_replication, misplaced, restride)
from ._redistribute import move_between
from ._runtime import RUNTIME
from ._strided import CatPlan, SliceBackwardPlan, SlicePlan, SplitPlan, UnstridedPlan, in_split_backward
from ._view_links import view_runner, write_runner
from ._wrap import DTENSOR_CLASSES as _DTENSORS
from ._wrap import DTensorBase, Wrapper

__all__ = ["check_plain_afresh", "dispatch", "implicit_replication", "torch_dispatch"]

# Keyed by (op, modes on, one entry per argument, kwargs): a DTensor contributes its spec
# (hashed once, at creation), anything else (type, value): 2, 2.0 and True give different
# dtypes; a list or tuple of scalars (a shape) gives (type, element types, values).
# The cache holds each plan's bound `run` (made once), so a hit is a lookup and one call.
_PLANS: dict[tuple[Any, ...], Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {}
PER_RANK_CACHES.append(_PLANS.clear)
CACHE_SIZES["op plans"] = _PLANS.__len__
_SCALARS = (int, float, bool, complex, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format)
# ops whose float arguments never change a plan (`OpRule.floats_by_type`): an optimizer's lr,
# bias corrections and step sizes change every step, and a key by value made a plan per step
_FLOATS_BY_TYPE: dict[Any, bool] = {}
CACHE_SIZES["ops keyed by float type"] = _FLOATS_BY_TYPE.__len__
_FLOAT = (float,)
_SPEC_OF = operator.attrgetter("_spec")
_NDIM_OF, _DTYPE_OF, _DEVICE_TYPE_OF = (operator.attrgetter(n) for n in ("ndim", "dtype", "device.type"))
_SCALAR_TYPES = frozenset(_SCALARS)
_CAT = torch.ops.aten.cat.default
_LOSS_OPS = frozenset(LOSS_PARALLEL_OPS)  # under torch's loss_parallel() they run as under shardwise's
# A plan is made once and a cached plan skips `check_plain`. One made inside
# implicit_replication() for a call where plain tensors meet DTensors (the user vouches for
# them and nothing is checked) is cached under its key plus this mark, so the same call outside
# the block still checks them once; inside the block a plan made outside serves as well (it is
# the same plan), and calls without plain tensors share one plan in and out of the block.
_IMPLICIT = ("implicit_replication",)


def torch_dispatch(cls: type, func: Any, types: Any, args: tuple[Any, ...] = (),
                   kwargs: Optional[dict[str, Any]] = None) -> Any:
    """`DTensor.__torch_dispatch__` itself (bound as its classmethod, so an op pays no extra
    call to get here): run the aten op `func` on DTensor arguments."""
    if kwargs is None:
        kwargs = {}
    modes = ACTIVE_MODES[0]
    if func in _LOSS_OPS and _LOSS_MODE not in modes and torch_loss_parallel_on():
        with op_mode(_LOSS_MODE):  # a program calling torch's loss_parallel() by its full path
            return torch_dispatch(cls, func, types, args, kwargs)
    free = _FLOATS_BY_TYPE.get(func)
    if free is None:
        free = _FLOATS_BY_TYPE[func] = rule_for(func, frozenset()).floats_by_type
    # The key inlines the two common cases of `_key_part` (a DTensor, a plain scalar), and is
    # unrolled for up to three arguments, most calls: a comprehension is a frame of its own.
    n = len(args)
    if n == 2:
        a, b = args
        key: tuple[Any, ...] = (
            func, modes,
            a._spec if a.__class__ in _DTENSORS else _key_part(a, func, modes, free),
            b._spec if b.__class__ in _DTENSORS else
            (_FLOAT if free and b.__class__ is float else (b.__class__, b)) if b.__class__ in _SCALAR_TYPES
            else _key_part(b, func, modes, free),
        )
    elif n == 1:
        a = args[0]
        key = (func, modes, a._spec if a.__class__ in _DTENSORS else _key_part(a, func, modes, free))
    elif n == 3:
        a, b, c = args
        key = (
            func, modes,
            a._spec if a.__class__ in _DTENSORS else _key_part(a, func, modes, free),
            b._spec if b.__class__ in _DTENSORS else
            (_FLOAT if free and b.__class__ is float else (b.__class__, b)) if b.__class__ in _SCALAR_TYPES
            else _key_part(b, func, modes, free),
            c._spec if c.__class__ in _DTENSORS else
            (_FLOAT if free and c.__class__ is float else (c.__class__, c)) if c.__class__ in _SCALAR_TYPES
            else _key_part(c, func, modes, free),
        )
    else:
        key = (func, modes, *[
            a._spec if a.__class__ in _DTENSORS else _key_part(a, func, modes, free)
            for a in args
        ])
    if kwargs:
        key += (tuple((k, _key_part(v, func, modes, free)) for k, v in kwargs.items()),)
    if func is _CAT:  # the backward of a split keeps a fused output's parts split (`_strided`)
        key += (in_split_backward(),)
    run = _PLANS.get(key)
    try:
        if run is None:
            vouched = implicit()
            if vouched:  # a plan made inside implicit_replication() over plain tensors is kept apart
                marked = key + _IMPLICIT
                run = _PLANS.get(marked)
                if run is not None:
                    return run(args, kwargs)
                if meets_plain(func, args, kwargs):
                    key = marked
            rule = rule_for(func, modes)
            if not (vouched or rule.plain_as_replicated):
                check_plain(func, modes, args, kwargs)
            return _first_run(key, func, args, kwargs, rule)
        return run(args, kwargs)
    except Exception as exc:  # free until raised (Python 3.11): name the op, rank and layouts
        _add_context(exc, func, args, kwargs)
        raise


def _first_run(key: tuple[Any, ...], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rule: OpRule) -> Any:
    """Make the plan, run it, and cache it; a fresh output whose piece the kernel laid out in
    another memory order than the global tensor's is re-laid, then and on every later call."""
    plan, moves_self = _make_plan(func, args, kwargs, key[1])
    run = plan.run
    fresh = rule.fresh_outputs
    written = set() if fresh else rule.written(len(args))
    if not fresh:
        run = write_runner(ViewPlan(run).run, func, written)
    out = run(args, kwargs)
    if not (fresh or written):  # a view: linked to its base when its plan moved the base (`_view_links`)
        run = view_runner(run, func, args, kwargs, out, moves_self)
    which = misplaced(out) if fresh else ()
    if any(which):
        run = RestridedPlan(run, which).run
        for o, fix in zip(out if isinstance(out, (list, tuple)) else (out,), which):
            if fix:
                restride(o)
    _PLANS[key] = run
    return out


def check_plain_afresh(mesh: DeviceMesh) -> None:
    """A module was just sharded over `mesh`: its first step checks its plain tensors at every
    site on `mesh` (`_plain`), whatever ran before in this process. A cached plan skips the
    check, so the plans are made again (pure: no communication) when any site was forgotten."""
    if forget_checks(mesh):
        _PLANS.clear()


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the aten op `func` on DTensor arguments (what `__torch_dispatch__` does)."""
    return torch_dispatch(type, func, (), args, kwargs)


def _describe(a: Any) -> str:
    if isinstance(a, DTensorBase):
        return f"{a._spec.layout_str()}{list(a.shape)} (local {list(a._local_tensor.shape)})"
    if isinstance(a, torch.Tensor):
        return f"plain {list(a.shape)}"
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return "[" + ", ".join(_describe(x) for x in a) + "]"
    text = repr(a)
    return text if len(text) <= 40 else text[:37] + "..."


def _add_context(exc: BaseException, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Add a note naming the op, this rank and the inputs' layouts to an error raised while
    running `func` on DTensors (once: the innermost op, when ops nest)."""
    if getattr(exc, "_shardwise_op", None) is not None:
        return
    try:
        exc._shardwise_op = func  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that takes no attributes: no note either
        return
    mesh = next((a._spec.mesh for a in args if type(a) in _DTENSORS), None)
    if isinstance(mesh, DryMesh):
        where = f"simulated rank {mesh.get_rank()} of a dry run"
    else:
        where = f"rank {dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"
    inputs = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    if isinstance(exc, comm.CollectiveError):  # the op leads the message: what the user called
        exc.add_operation(f"{func} on inputs {', '.join(inputs)}")
        return
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(f"shardwise: raised by {func} on {where}, inputs {', '.join(inputs)}")


def _key_part(a: Any, func: Any, modes: frozenset[str], free: bool = False) -> Any:
    """`a`'s part of the plan cache key; with `free` (the op's `floats_by_type`), a float, or a
    float in a list, counts by its type only."""
    if isinstance(a, DTensorBase):
        return a._spec
    if isinstance(a, _SCALARS):
        return _FLOAT if free and a.__class__ is float else (a.__class__, a)
    if isinstance(a, torch.Tensor):
        if a.requires_grad:  # a plain leaf, or a view of one (`weight.t()`): its DTensor gradient is made plain
            _watch(a if a.is_leaf else a._base)
        if a.ndim == 0:
            return ScalarTensor(a.dtype, a.device.type)
        # counts as replicated; `check_plain` makes sure it is the first time at each site
        return ("plain", a.shape, a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        types = tuple(map(type, a))
        if _SCALAR_TYPES.issuperset(types):  # a shape, a list of dims: no walk
            if free and float in types:  # a foreach step's per-parameter scalars
                return (a.__class__, types)
            return (a.__class__, types, tuple(a))
        if _DTENSORS.issuperset(types):  # a foreach / fused optimizer list: the specs, read in C
            return (a.__class__, tuple(map(_SPEC_OF, a)))
        if types and types.count(torch.Tensor) == len(types):  # an optimizer's step counts: 0-dim, one kind
            kinds = set(zip(map(_NDIM_OF, a), map(_DTYPE_OF, a), map(_DEVICE_TYPE_OF, a)))
            if len(kinds) == 1:
                ndim, dtype, device = kinds.pop()
                if ndim == 0:
                    return (a.__class__, len(a), ScalarTensor(dtype, device))
        return (a.__class__, tuple(_key_part(x, func, modes, free) for x in a))
    return (a.__class__, a)


def _watch(leaf: Optional[torch.Tensor]) -> None:
    """Hook a plain leaf (not a fake or functional stand-in of one) that meets DTensors."""
    if leaf is not None and leaf.requires_grad and leaf.is_leaf and \
            (leaf.__class__ is torch.Tensor or isinstance(leaf, torch.nn.Parameter)):
        watch_plain_leaf(leaf)


# -- from a plan to its runner ---------------------------------------------------------------------


def _described(a: Any) -> Any:
    """`a` as planning sees it (`_ops.OpCall`): a DTensor its spec, a plain tensor its metadata."""
    if isinstance(a, DTensorBase):
        return a._spec
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:
            return ScalarTensor(a.dtype, a.device.type)
        return PlainTensor(TensorMeta(a.shape, contiguous_strides(a.shape), a.dtype))
    if isinstance(a, (list, tuple)):
        return tuple(_described(x) for x in a)
    return a


def _first_mesh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[AbstractMesh]:
    for value in list(args) + list(kwargs.values()):
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(x, DTensorBase):
                return x._spec.mesh
    return None


def _make_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], modes: frozenset[str]) -> tuple[Plan, bool]:
    """The runner of the plan `_ops.make_plan` makes for this call (`_RUNNERS`), and whether the
    plan moves the first argument (the same on every rank of the mesh)."""
    mesh = _first_mesh(args, kwargs)
    call = OpCall(func, tuple(map(_described, args)), tuple((k, _described(v)) for k, v in kwargs.items()), modes,
                  None if mesh is None else RUNTIME.coordinate(mesh), func is _CAT and in_split_backward())
    plan = make_plan(call)
    build = _RUNNERS.get(type(plan))
    if build is None:
        known = ", ".join(sorted(t.__name__ for t in _RUNNERS))
        raise TypeError(f"{func}: _ops.make_plan returned a {type(plan).__qualname__}, a plan type with no runner: "
                        f"add one entry for it to _tensor._dispatch._RUNNERS (runners exist for {known})")
    return build(plan, func, args), any(loc[0] == 0 and t is not None for loc, _, t in getattr(plan, "moves", ()))


# One builder per plan type of `_ops.OpPlan`: (plan, op, args) -> its runner. A new plan type
# is one entry here (tests/tensor/test_dispatch_runners.py checks every `OpPlan` has one).
_Build = Callable[[Any, Any, tuple[Any, ...]], Plan]


def _sharded(plan: RunSharded, func: Any, args: tuple[Any, ...]) -> Plan:
    """`LeanPlan` or `GeneralPlan` for `plan`: its moves made (`move_between`) and checked
    against explicit mode, its outputs' wrappers made."""
    moves = tuple((loc, None if t is None else move_between(s, t)) for loc, s, t in plan.moves)
    check_explicit(plan.op, moves)
    local_shape = None if plan.local_shape is None else list(plan.local_shape)
    outputs = plan.outputs
    if plan.lean:
        moved = tuple((int(k), m) for (k, _), m in moves if m is not None)
        wrappers = tuple(Wrapper(o) for o in (outputs if isinstance(outputs, tuple) else (outputs,))
                         if isinstance(o, DTensorSpec))
        only_pieces = not moved and plan.shape_arg is None and len(plan.unwrap) == len(args)
        return LeanPlan(plan.op._op, plan.unwrap, moved, plan.shape_arg, local_shape, wrappers,
                        wrappers[0] if isinstance(outputs, DTensorSpec) else None, only_pieces)
    return GeneralPlan(
        func=plan.op,
        moves=tuple(((k, j), m) for (k, j), m in moves if k not in plan.lists),
        lists=plan.lists,
        flat=plan.flat,
        outputs=outputs,
        shape_arg=plan.shape_arg,
        local_shape=local_shape,
        local=plan.local,
        input_specs=tuple(t if t is not None else s for _, s, t in plan.moves),
        resolve=plan.resolve,
        dynamic_mesh=plan.dynamic_mesh,
        writebacks=tuple((loc, move_between(t, s)) for loc, t, s in plan.writebacks),
        relayout=plan.relayout,
        returns=plan.returns,
        returns_nothing=plan.returns_nothing,
    )


def _decomposed(plan: RunDecomposed, func: Any, args: tuple[Any, ...]) -> Plan:
    return DecomposedPlan(plan.decompose)


def _per_mesh(plan: RunPerMesh, func: Any, args: tuple[Any, ...]) -> Plan:
    return ByMeshPlan(dispatch, func, plan.groups, plan.length, plan.plain)


def _outside(plan: RunOutside, func: Any, args: tuple[Any, ...]) -> Plan:
    return OutsidePlan(plan.outputs, plan.returns, plan.returns_nothing, plan.answer)


def _split(plan: SplitParts, func: Any, args: tuple[Any, ...]) -> Plan:
    return SplitPlan(plan.dim, plan.local_sizes, tuple(map(Wrapper, plan.outputs)))


def _slice(plan: SliceParts, func: Any, args: tuple[Any, ...]) -> Plan:
    return SlicePlan(plan.dim, plan.start, plan.length, Wrapper(plan.output))


def _slice_backward(plan: SliceBackwardParts, func: Any, args: tuple[Any, ...]) -> Plan:
    return SliceBackwardPlan(plan.dim, plan.start, plan.local_shape, Wrapper(plan.output))


def _cat(plan: CatParts, func: Any, args: tuple[Any, ...]) -> Plan:
    return CatPlan(plan.dim, Wrapper(plan.output))


def _unstrided(plan: Unstride, func: Any, args: tuple[Any, ...]) -> Plan:
    return UnstridedPlan(func, tuple((loc, move_between(s, t)) for loc, s, t in plan.moves),
                         tuple((loc, move_between(s, t)) for loc, s, t in plan.written), dispatch)


_RUNNERS: dict[type, _Build] = {
    RunSharded: _sharded,
    RunDecomposed: _decomposed,
    RunPerMesh: _per_mesh,
    RunOutside: _outside,
    SplitParts: _split,
    SliceParts: _slice,
    SliceBackwardParts: _slice_backward,
    CatParts: _cat,
    Unstride: _unstrided,
}
