"""Eager dispatch of an aten op on DTensors: look up the plan, run it.

The first call with a given op, modes, argument layouts and non-tensor arguments makes a
plan (`_plans`): the op's rule (`_ops.rule_for`), propagation on the global specs, the
moves each input needs, and this rank's local shapes; every later call with the same key
is a dictionary lookup followed by the plan's `run`.

An argument the op writes (in-place self, `out=`) that had to be moved is written back
into the layout it had, so a DTensor never changes layout behind its owner's back.

The path of one call, `torch.mm(a, b)` with `a` S(0) and `b` R on a (4,) mesh:

| layer | function | does |
|---|---|---|
| tensor | `DTensor.__torch_dispatch__` = `torch_dispatch` | keys the call; a hit goes straight to `LeanPlan.run` |
| tensor | `_make_plan` (first call only) | the `OpSchema` of global specs, then the plan |
| ops | `rule_for` | the op's rule: `SHARDED`, strategy `_matmul.contraction_strategy` |
| ops | `propagate` -> `_choose` -> `_pick` | every candidate priced by `redistribute_cost` |
| redistribute | `plan_between` -> `plan_redistribute` | the cost of each input move; (S(0), R) -> S(0) moves nothing |
| tensor | `Wrapper`, `LeanPlan` | the output's wrapper and the frozen plan |
| tensor | `LeanPlan.run` | the C op on the local pieces, the S(0) output wrapped |

A move would add `move_between` (the plan's program, made once) to the plan and
`run_program` -> `_comm.run(record)` to every call.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch._decomp import decomposition_table

from .. import _comm as comm
from .._explicit import check_explicit
from .._mesh_dry import CACHE_SIZES, PER_RANK_CACHES, DryMesh
from .._layout import contiguous_strides
from .._mesh import AbstractMesh
from .._ops import ACTIVE_MODES, OpKind, OpRule, OpSchema, OutputSharding, ScalarTensor, propagate, rule_for
from .._ops._loss_parallel import LOSS_PARALLEL as _LOSS_MODE, LOSS_PARALLEL_OPS
from .._placement import Replicate
from .._spec import DTensorSpec, TensorMeta
from ._plain import check_plain
from ._torch_loss import warn_if_torch_loss_parallel
from ._plans import (ByMeshPlan, DecomposedPlan, GeneralPlan, LeanPlan, Location, OutsidePlan, Plan, RestridedPlan,
                     ViewPlan, implicit, implicit_replication, misplaced, restride)
from ._redistribute import Move, move_between
from ._runtime import RUNTIME
from ._strided import (Abort, cat_plan, has_strided, in_split_backward, slice_backward_plan, slice_plan, split_plan, translation,
                       unstrided_plan)
from ._wrap import DTENSOR_CLASSES as _DTENSORS
from ._wrap import DTensorBase, Wrapper

__all__ = ["dispatch", "implicit_replication", "torch_dispatch"]

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
_LAZY_VIEWS = {torch.ops.aten._conj.default, torch.ops.aten._neg_view.default}
_CAT = torch.ops.aten.cat.default
# ops that read only metadata: they answer alike inside and outside the mesh
_METADATA_OPS = {torch.ops.aten.is_same_size.default}
# comparisons a rank outside the mesh answers as torch does (its empty pieces agree)
_OUTSIDE_ANSWERS = {torch.ops.aten.equal.default: True, torch.ops.aten.allclose.default: True}
_SLICE_BACKWARD = torch.ops.aten.slice_backward.default
_LOSS_OPS = frozenset(LOSS_PARALLEL_OPS)  # torch's loss_parallel() around them is a mistake to warn of


def torch_dispatch(cls: type, func: Any, types: Any, args: tuple[Any, ...] = (),
                   kwargs: Optional[dict[str, Any]] = None) -> Any:
    """`DTensor.__torch_dispatch__` itself (bound as its classmethod, so an op pays no extra
    call to get here): run the aten op `func` on DTensor arguments."""
    if kwargs is None:
        kwargs = {}
    modes = ACTIVE_MODES[0]
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
            rule = rule_for(func, modes)
            if func in _LOSS_OPS and _LOSS_MODE not in modes:
                warn_if_torch_loss_parallel(func)
            if not (implicit() or rule.plain_as_replicated):
                check_plain(func, modes, args, kwargs)
            return _first_run(key, func, args, kwargs, rule)
        return run(args, kwargs)
    except Exception as exc:  # free until raised (Python 3.11): name the op, rank and layouts
        _add_context(exc, func, args, kwargs)
        raise


def _first_run(key: tuple[Any, ...], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rule: OpRule) -> Any:
    """Make the plan, run it, and cache it; a fresh output whose piece the kernel laid out in
    another memory order than the global tensor's is re-laid, then and on every later call."""
    run = _make_plan(func, args, kwargs, rule).run
    fresh = not any(r.alias_info is not None for r in func._schema.returns)
    if not fresh:
        run = ViewPlan(run).run
    out = run(args, kwargs)
    which = misplaced(out) if fresh else ()
    if any(which):
        run = RestridedPlan(run, which).run
        for o, fix in zip(out if isinstance(out, (list, tuple)) else (out,), which):
            if fix:
                restride(o)
    _PLANS[key] = run
    return out


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


# -- making a plan -----------------------------------------------------------------------------


def _schema_arg(a: Any, mesh: Optional[AbstractMesh]) -> Any:
    if isinstance(a, DTensorBase):
        return a._spec
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:
            return ScalarTensor(a.dtype, a.device.type)
        if mesh is None:
            raise TypeError(f"a plain tensor of shape {tuple(a.shape)} reached DTensor dispatch without a DTensor beside it")
        meta = TensorMeta(a.shape, contiguous_strides(a.shape), a.dtype)
        return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta)
    if isinstance(a, (list, tuple)):
        return tuple(_schema_arg(x, mesh) for x in a)
    return a


def _is_input(a: Any) -> bool:
    return isinstance(a, DTensorBase) or (isinstance(a, torch.Tensor) and a.ndim > 0)


def _locations(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Location]:
    found: list[Location] = []
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        if _is_input(value):
            found.append((key, None))
        elif isinstance(value, (list, tuple)):
            found.extend((key, j) for j, x in enumerate(value) if _is_input(x))
    return found


def _first_mesh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[AbstractMesh]:
    for value in list(args) + list(kwargs.values()):
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(x, DTensorBase):
                return x._spec.mesh
    return None


def _move(spec: DTensorSpec, target: Optional[DTensorSpec]) -> Optional[Move]:
    return None if target is None else move_between(spec, target)


def _make_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rule: OpRule) -> Plan:
    if func is _CAT and in_split_backward():
        found: Optional[Plan] = cat_plan(func, args, kwargs)
        if found is not None:
            return found
    if func is _SLICE_BACKWARD:
        found = slice_backward_plan(func, args, kwargs)
        if found is not None:
            return found
    if rule.kind is OpKind.DECOMPOSED:
        return DecomposedPlan(decomposition_table.get(func) or func.decompose)
    by_mesh = _by_mesh(func, args)
    if by_mesh is not None:
        return by_mesh
    mesh = _first_mesh(args, kwargs)
    real = OpSchema(
        func,
        tuple(_schema_arg(a, mesh) for a in args),
        tuple((k, _schema_arg(v, mesh)) for k, v in kwargs.items()) if kwargs else (),
    )
    specs = real.input_specs()
    if mesh is not None and RUNTIME.coordinate(mesh) is None and func not in _METADATA_OPS:
        return _outside_plan(func, args, kwargs, rule, real)
    if not has_strided(specs):
        return _plan_from(func, args, kwargs, rule, real, specs)
    # a `_StridedShard` input (a fused projection's parts): see `_strided`
    where = tuple(_locations(args, kwargs))
    split = split_plan(func, args, kwargs) or slice_plan(func, args, kwargs)
    if split is not None:
        return split
    view = translation(func, rule, where)
    if view is not None:
        schema = OpSchema(func, tuple(_translated(a, view.spec) for a in real.args_schema),
                          tuple((k, _translated(v, view.spec)) for k, v in real.kwargs_schema))
        try:
            return _plan_from(func, args, kwargs, rule, schema, specs, view.answer)
        except Abort:
            pass
    return unstrided_plan(func, args, kwargs, where, _written_args(func, args), dispatch)


def _outside_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rule: OpRule, schema: OpSchema) -> OutsidePlan:
    """The plan on a rank outside the inputs' mesh: outputs in the layouts propagation gives
    (Replicate where it cannot say), holding nothing."""
    try:
        outputs: Any = propagate(schema, rule).output_spec
    except Exception:  # a layout only a real run could place: its values are never read here
        mesh = _first_mesh(args, kwargs)
        assert mesh is not None  # the caller found it
        meta = schema.output_meta()
        metas = meta if isinstance(meta, tuple) and not isinstance(meta, TensorMeta) else (meta,)
        made = tuple(DTensorSpec(mesh, (Replicate(),) * mesh.ndim, m) if isinstance(m, TensorMeta) else None
                     for m in metas)
        outputs = made if isinstance(meta, tuple) and not isinstance(meta, TensorMeta) else made[0]
    written = _written_args(func, args)
    returns = tuple(loc for loc in _locations(args, kwargs) if loc[0] in written) if written and _returns_written(func) else None
    return OutsidePlan(outputs, returns, not func._schema.returns, _OUTSIDE_ANSWERS.get(func))


def _by_mesh(func: Any, args: tuple[Any, ...]) -> Optional[ByMeshPlan]:
    """For a `_foreach_*` / `_fused_*` call whose list elements sit on more than one mesh, or
    on none (plain tensors), the plan that runs it once per mesh; None for any other call."""
    name = func._schema.name
    if not (name.startswith("aten::_foreach_") or name.startswith("aten::_fused_")):
        return None
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return None
    n = len(lists[0])
    groups: dict[Any, list[int]] = {}
    for k in range(n):
        mesh = next((a[k]._spec.mesh for a in lists if len(a) == n and isinstance(a[k], DTensorBase)), None)
        groups.setdefault(mesh, []).append(k)
    if len(groups) < 2 and None not in groups:
        return None
    plain = list(groups).index(None) if None in groups else None
    return ByMeshPlan(dispatch, func, tuple(tuple(g) for g in groups.values()), n, plain)


def _translated(a: Any, read: Any) -> Any:
    if isinstance(a, DTensorSpec):
        return read(a)
    if isinstance(a, tuple):
        return tuple(_translated(x, read) for x in a)
    return a


def _plan_from(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rule: OpRule, schema: OpSchema,
               specs: list[DTensorSpec], answer: Any = None) -> Plan:
    """The plan of one call: `schema` is what propagation sees, `specs` the inputs' real specs,
    `answer` (if any) turns propagation's answer into the real one."""
    result = propagate(schema, rule)
    if answer is not None:
        result = answer(result, specs)
    mesh = _first_mesh(args, kwargs)
    where = _locations(args, kwargs)
    moves = tuple((loc, _move(s, t)) for loc, s, t in zip(where, specs, result.input_specs))
    check_explicit(func, moves)
    outputs = result.output_spec
    single = outputs if isinstance(outputs, DTensorSpec) else None
    shape_arg, local_shape = _local_shape(result, single)
    written = _written_args(func, args)
    relayout = single if rule.relayout and bool(args) and isinstance(args[0], DTensorBase) else None
    if rule.relayout and args and isinstance(args[0], DTensorBase):
        _check_growth(func, args[0], single)
        written.discard(0)  # self takes the result's layout: nothing to move back
    else:
        _check_inplace_shape(func, args, outputs)
    writebacks = tuple(
        (loc, move_between(t, s)) for loc, s, t in zip(where, specs, result.input_specs)
        if t is not None and loc[0] in written
    )
    if relayout is not None:
        written.add(0)
    returns = tuple(loc for loc in where if loc[0] in written) if written and _returns_written(func) else None
    flat = all(isinstance(k, int) and j is None for k, j in where)
    lean_outputs = _lean_outputs(outputs)
    if (flat and rule.local is None and func not in _LAZY_VIEWS and not result.dynamic and not writebacks
            and relayout is None and returns is None and lean_outputs is not None and hasattr(func, "_op")):
        # a plain tensor (implicit replication) that stays put is passed as it is
        positions = [(int(k), m) for (k, _), m in moves]
        unwrap = tuple(k for k, m in positions if m is None and isinstance(args[k], DTensorBase))
        moved = tuple((k, m) for k, m in positions if m is not None)
        wrappers = tuple(Wrapper(o) for o in lean_outputs)
        only_pieces = not moved and shape_arg is None and len(unwrap) == len(args)
        return LeanPlan(func._op, unwrap, moved, shape_arg, local_shape, wrappers,
                        wrappers[0] if single is not None else None, only_pieces)
    # a list argument of DTensors none of which moves (a foreach / fused optimizer step's) is
    # unwrapped whole, in C, instead of element by element
    lists = tuple(k for k in {k for (k, j), _ in moves if j is not None}
                  if all(m is None for (kk, j), m in moves if kk == k)
                  and _DTENSORS.issuperset(map(type, args[k] if isinstance(k, int) else kwargs[k])))
    return GeneralPlan(
        func=func,
        moves=tuple(((k, j), m) for (k, j), m in moves if k not in lists),
        lists=lists,
        flat=flat,
        outputs=outputs,
        shape_arg=shape_arg,
        local_shape=local_shape,
        local=rule.local,
        input_specs=tuple(t if t is not None else s for s, t in zip(specs, result.input_specs)),
        resolve=func in _LAZY_VIEWS,
        dynamic_mesh=mesh if result.dynamic else None,
        writebacks=writebacks,
        relayout=relayout,
        returns=returns,
        returns_nothing=not func._schema.returns,
    )


def _lean_outputs(outputs: Any) -> Optional[tuple[DTensorSpec, ...]]:
    """Every output's spec, when each is a DTensor (the lean plan wraps them all)."""
    if isinstance(outputs, DTensorSpec):
        return (outputs,)
    if isinstance(outputs, tuple) and outputs and all(isinstance(o, DTensorSpec) for o in outputs):
        return tuple(o for o in outputs if isinstance(o, DTensorSpec))
    return None


def _local_shape(result: OutputSharding, single: Optional[DTensorSpec]) -> tuple[Optional[int], Optional[list[int]]]:
    """The argument holding output 0's shape and this rank's piece of that shape (a `new_*` op)."""
    if result.shape_arg is None:
        return None, None
    assert single is not None
    coordinate = RUNTIME.coordinate(single.mesh) or (0,) * single.mesh.ndim
    return result.shape_arg, list(single.local_shape_and_offset(coordinate)[0])


def _check_inplace_shape(func: Any, args: tuple[Any, ...], out: Any) -> None:
    """An in-place op may not change its self's shape (a DTensor's global shape is fixed)."""
    arguments = func._schema.arguments
    inplace = bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    if inplace and args and isinstance(args[0], DTensorBase) and isinstance(out, DTensorSpec):
        if out.shape != args[0].shape:
            raise ValueError(
                f"in-place {func} would change a DTensor's shape from {tuple(args[0].shape)} to "
                f"{tuple(out.shape)}: use the out-of-place op (e.g. x = x.transpose(0, 1))"
            )


def _check_growth(func: Any, self: DTensorBase, out: Optional[DTensorSpec]) -> None:
    if out is None or math.prod(out.shape) > math.prod(self.shape):
        got = "an unknown shape" if out is None else tuple(out.shape)
        raise ValueError(
            f"{func} would grow a DTensor from shape {tuple(self.shape)} to {got}: a DTensor's storage "
            f"cannot grow in place; make a new one (shardwise.empty(shape, device_mesh=..., placements=...))"
        )


def _written_args(func: Any, args: tuple[Any, ...]) -> set[Union[int, str]]:
    """Positions / names of the arguments the op writes (in-place self, out= tensors)."""
    written: set[Union[int, str]] = set()
    for k, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only or k >= len(args):
                written.add(a.name)
            else:
                written.add(k)
    return written


def _returns_written(func: Any) -> bool:
    """Whether the op returns the arguments it writes (`add_`, `out=`) rather than new tensors
    (batch norm writes its running statistics but returns fresh outputs)."""
    returns = func._schema.returns
    return not returns or any(r.alias_info is not None and r.alias_info.is_write for r in returns)
