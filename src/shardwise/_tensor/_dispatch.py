"""Eager dispatch of an aten op on DTensors: look up the plan, redistribute, run locally, wrap.

The first call with a given op, argument layouts and non-tensor arguments builds a plan
(propagation on the global specs plus this rank's local shapes); every later call with
the same key is a dictionary lookup followed by the local op.

An argument the op writes (in-place self, `out=`) that had to be moved is written back
into the layout it had, so a DTensor never changes layout behind its owner's back.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch._decomp import decomposition_table

from .._layout import contiguous_strides
from .._mesh import DeviceMesh
from .._placement import Replicate
from .._spec import DTensorSpec, TensorMeta
from .._ops import RELAYOUT_OPS, REPLICATED_OPS, OpSchema, ScalarTensor, get_op_strategy, propagate
from ._redistribute import redistribute_local

__all__ = ["dispatch", "implicit_replication", "plain_as_replicated", "register_local_impl"]

# Ops whose local computation is not the op on the local pieces: random ops draw from the
# placement-invariant generator instead, so every layout gives the same global values; a
# vocab-sharded embedding masks the ids outside the rank's rows.
# impl(func, local_args, local_kwargs, output_spec) -> local output; registered with
# `with_input_specs=True`, also `input_specs=`: each DTensor input's spec as the op runs.
LocalImpl = Callable[..., Any]
_LOCAL_IMPLS: dict[Any, LocalImpl] = {}
_WITH_INPUT_SPECS: set[Any] = set()


def register_local_impl(ops: Any, *, with_input_specs: bool = False) -> Callable[[LocalImpl], LocalImpl]:
    """Run `impl` instead of the aten op on local pieces for these ops (random ops, masked
    lookups). With `with_input_specs`, `impl` also receives `input_specs=`: the spec every
    DTensor input has once moved to the chosen strategy's layout, in flattened input order."""
    targets = ops if isinstance(ops, (list, tuple)) else [ops]

    def wrap(impl: LocalImpl) -> LocalImpl:
        for op in targets:
            _LOCAL_IMPLS[op] = impl
            if with_input_specs:
                _WITH_INPUT_SPECS.add(op)
            else:
                _WITH_INPUT_SPECS.discard(op)
        return impl

    return wrap

_IMPLICIT: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_implicit_replication", default=False)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this block, a plain tensor mixed with DTensors counts as replicated on their mesh.

    Use it for tensors that really are the same on every rank (a mask, a position table);
    outside it, mixing them is an error, because a rank-local tensor would be silently
    treated as global. One-element tensors (shape `()`, `(1,)`, `(1, 1)`) always count as
    replicated, as scalars do.
    """
    token = _IMPLICIT.set(True)
    try:
        yield
    finally:
        _IMPLICIT.reset(token)


# Ops that take plain tensors as replicated while a mode says so (loss_parallel's targets).
_PLAIN_AS_REPLICATED: set[Any] = set()


def plain_as_replicated(ops: Iterable[Any], on: bool) -> None:
    """Let these ops take plain tensors mixed with DTensors as replicated (or stop)."""
    if on:
        _PLAIN_AS_REPLICATED.update(ops)
    else:
        _PLAIN_AS_REPLICATED.difference_update(ops)


# Where a DTensor input sits: (positional index or keyword name, index in a list or None).
Location = tuple[Union[int, str], Optional[int]]


class _Plan:
    """What to do for one cache key."""

    __slots__ = (
        "moves", "simple", "outputs", "single", "shape_arg", "local_shape", "writebacks", "returns", "impl",
        "resolve", "dynamic_mesh", "impl_specs", "relayout", "decompose", "fast", "unwrap", "moved", "call", "wraps",
    )

    def __init__(self) -> None:
        self.moves: tuple[tuple[Any, Optional[DTensorSpec]], ...] = ()
        self.simple = True  # every DTensor input is a top-level positional argument
        self.outputs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None] = None
        self.single: Optional[DTensorSpec] = None
        self.shape_arg: Optional[int] = None
        self.local_shape: Optional[list[int]] = None
        self.writebacks: tuple[Location, ...] = ()
        self.returns: Optional[tuple[Location, ...]] = None  # in-place / out=: return these inputs
        self.impl: Optional[LocalImpl] = None
        self.impl_specs: Optional[tuple[DTensorSpec, ...]] = None  # input specs for impls that ask
        self.resolve = False  # the local op returns a lazy conj/neg view: materialize it
        self.dynamic_mesh: Optional[DeviceMesh] = None  # outputs described after the run (replicated)
        self.relayout = False  # an in-place op that gives self a new shape or layout (squeeze_)
        self.decompose: Optional[Callable[..., Any]] = None  # run as PyTorch's decomposition of the op
        # The lean path (`fast`): top-level DTensor arguments, the op itself on local pieces, and
        # fresh outputs; everything it needs is worked out here, once.
        self.fast = False
        self.unwrap: tuple[int, ...] = ()  # positions whose local piece is used as it is
        self.moved: tuple[tuple[int, DTensorSpec], ...] = ()  # positions redistributed first
        self.call: Callable[..., Any] = _no_call  # the C op (an OpOverload's `_op`)
        self.wraps: tuple[_Out, ...] = ()  # one per output; a single output when `single` is set


def _no_call(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a plan off the lean path has no direct call")


# What wrapping one output needs, precomputed: (class, shape, stride, dtype, spec).
_Out = tuple[type, torch.Size, tuple[int, ...], torch.dtype, DTensorSpec]


def _out(spec: DTensorSpec) -> _Out:
    meta = spec.tensor_meta
    return (class_for(spec), meta.shape, meta.stride, meta.dtype, spec)


def _set_lean(plan: _Plan, func: Any, args: tuple[Any, ...]) -> None:
    """Mark `plan` for the lean path when nothing but unwrap, call and wrap is needed."""
    outputs = plan.outputs
    if isinstance(outputs, DTensorSpec):
        wraps: tuple[_Out, ...] = (_out(outputs),)
    elif isinstance(outputs, tuple) and outputs and all(isinstance(o, DTensorSpec) for o in outputs):
        wraps = tuple(_out(o) for o in outputs if isinstance(o, DTensorSpec))
    else:
        return
    if not plan.simple or plan.impl is not None or plan.resolve or plan.dynamic_mesh is not None:
        return
    if plan.writebacks or plan.relayout or plan.returns is not None or not hasattr(func, "_op"):
        return
    # a plain tensor (implicit replication) that stays put is passed as it is
    plan.unwrap = tuple(k for k, t in plan.moves if t is None and isinstance(args[k], DTensor))
    plan.moved = tuple((k, t) for k, t in plan.moves if t is not None)
    plan.call = func._op
    plan.wraps = wraps
    plan.fast = True


# Keyed by (op, one entry per argument, kwargs): a DTensor contributes its spec (hashed
# once, at creation), anything else (type, value): 2, 2.0 and True give different dtypes;
# a list or tuple of scalars (a shape) gives (type, element types, values).
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_SCALARS = (int, float, bool, complex, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_SCALAR_TYPES = frozenset(_SCALARS)


def _plain_error(func: Any, a: torch.Tensor) -> ValueError:
    # ValueError, not TypeError: torch turns a TypeError inside `a + b` into NotImplemented,
    # and Python would replace this message with "unsupported operand type(s)".
    return ValueError(
        f"{func} got a plain torch.Tensor of shape {tuple(a.shape)} mixed with DTensors: wrap it with "
        f"shardwise.distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, placements), "
        f"or, if it is the same on every rank, run the op inside shardwise.implicit_replication()"
    )


def _key_part(a: Any, func: Any) -> Any:
    if isinstance(a, DTensor):
        return a._spec
    if isinstance(a, _SCALARS):
        return (a.__class__, a)
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:
            return ScalarTensor(a.dtype, a.device.type)
        if _IMPLICIT.get() or a.numel() == 1 or func in _PLAIN_AS_REPLICATED:  # numel 1: a scalar in disguise
            return ("plain", a.shape, a.dtype, a.device.type)
        raise _plain_error(func, a)
    if isinstance(a, (list, tuple)):
        types = tuple(map(type, a))
        if _SCALAR_TYPES.issuperset(types):  # a shape, a list of dims: no walk
            return (a.__class__, types, tuple(a))
        return (a.__class__, tuple(_key_part(x, func) for x in a))
    return (a.__class__, a)


def _schema_arg(a: Any, mesh: Optional[DeviceMesh]) -> Any:
    if isinstance(a, DTensor):
        return a._spec
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:
            return ScalarTensor(a.dtype, a.device.type)
        assert mesh is not None
        meta = TensorMeta(a.shape, contiguous_strides(a.shape), a.dtype)
        return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta)
    if isinstance(a, (list, tuple)):
        return tuple(_schema_arg(x, mesh) for x in a)
    return a


def _is_input(a: Any) -> bool:
    return isinstance(a, DTensor) or (isinstance(a, torch.Tensor) and a.ndim > 0)


def _locations(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Location]:
    found: list[Location] = []
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        if _is_input(value):
            found.append((key, None))
        elif isinstance(value, (list, tuple)):
            found.extend((key, j) for j, x in enumerate(value) if _is_input(x))
    return found


def _first_mesh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[DeviceMesh]:
    for value in list(args) + list(kwargs.values()):
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(x, DTensor):
                mesh = x._spec.mesh
                assert isinstance(mesh, DeviceMesh)
                return mesh
    return None


def _decomposition(func: Any) -> Optional[Callable[..., Any]]:
    """PyTorch's decomposition of an op that has no strategy and writes none of its arguments:
    its pieces have strategies, so it runs sharded instead of gathered."""
    if get_op_strategy(func) is not None or func in REPLICATED_OPS:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return None
    return decomposition_table.get(func)


def _run_decomposition(decompose: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Tensors a decomposition creates come from global shapes and scalars: the same on
    # every rank, so they count as replicated.
    with implicit_replication():
        return decompose(*args, **kwargs)


def _make_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Plan:
    decompose = _decomposition(func)
    if decompose is not None:
        plan = _Plan()
        plan.decompose = decompose
        return plan
    mesh = _first_mesh(args, kwargs)
    schema = OpSchema(
        func,
        tuple(_schema_arg(a, mesh) for a in args),
        tuple((k, _schema_arg(v, mesh)) for k, v in kwargs.items()) if kwargs else (),
    )
    result = propagate(schema)
    plan = _Plan()
    where = _locations(args, kwargs)
    plan.moves = tuple(zip(where, result.input_specs))
    plan.simple = all(isinstance(k, int) and j is None for k, j in where)
    if plan.simple:
        plan.moves = tuple((k, t) for (k, _), t in plan.moves)
    plan.outputs = result.output_spec
    plan.single = result.output_spec if isinstance(result.output_spec, DTensorSpec) else None
    if result.shape_arg is not None:
        spec = plan.single
        assert spec is not None and isinstance(spec.mesh, DeviceMesh)
        coordinate = spec.mesh._coordinate or (0,) * spec.mesh.ndim
        plan.shape_arg = result.shape_arg
        plan.local_shape = list(spec.local_shape_and_offset(coordinate)[0])
    plan.impl = _LOCAL_IMPLS.get(func)
    if func in _WITH_INPUT_SPECS:
        plan.impl_specs = tuple(t if t is not None else s for s, t in zip(schema.input_specs(), result.input_specs))
    plan.resolve = func in _LAZY_VIEWS
    if result.dynamic:
        plan.dynamic_mesh = mesh
    written = _written_args(func, args, kwargs)
    plan.relayout = func in RELAYOUT_OPS and bool(args) and isinstance(args[0], DTensor)
    if plan.relayout:
        _check_growth(func, args[0], plan.single)
        written.discard(0)  # self takes the result's layout: nothing to move back
    else:
        _check_inplace_shape(func, args, result.output_spec)
    plan.writebacks = tuple(loc for loc, target in zip(where, result.input_specs) if target is not None and loc[0] in written)
    if plan.relayout:
        written.add(0)
    if written and _returns_written(func):
        plan.returns = tuple(loc for loc in where if loc[0] in written)
    _set_lean(plan, func, args)
    return plan


_LAZY_VIEWS = {torch.ops.aten._conj.default, torch.ops.aten._neg_view.default}


def _check_inplace_shape(func: Any, args: tuple[Any, ...], out: Any) -> None:
    """An in-place op may not change its self's shape (a DTensor's global shape is fixed)."""
    arguments = func._schema.arguments
    inplace = bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    if inplace and args and isinstance(args[0], DTensor) and isinstance(out, DTensorSpec):
        if out.shape != args[0].shape:
            raise ValueError(
                f"in-place {func} would change a DTensor's shape from {tuple(args[0].shape)} to "
                f"{tuple(out.shape)}: use the out-of-place op (e.g. x = x.transpose(0, 1))"
            )


def _check_growth(func: Any, self: DTensor, out: Optional[DTensorSpec]) -> None:
    if out is None or math.prod(out.shape) > math.prod(self.shape):
        got = "an unknown shape" if out is None else tuple(out.shape)
        raise ValueError(
            f"{func} would grow a DTensor from shape {tuple(self.shape)} to {got}: a DTensor's storage "
            f"cannot grow in place; make a new one (shardwise.empty(shape, device_mesh=..., placements=...))"
        )


def _relayout(owner: DTensor, local: torch.Tensor, spec: DTensorSpec) -> None:
    """Give `owner` the layout (and global shape) of an in-place op's result."""
    owner._local_tensor = local
    owner._spec = spec
    owner.__class__ = class_for(spec)  # a split batch dim may come or go (see `_dtensor`)
    # the wrapper's own sizes and strides are metadata only: set them below the Python key
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        torch.ops.aten.as_strided_.default(owner, spec.shape, spec.tensor_meta.stride)


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[Union[int, str]]:
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


def _get(args: Any, kwargs: dict[str, Any], loc: Location) -> Any:
    key, j = loc
    value = args[key] if isinstance(key, int) else kwargs[key]
    return value if j is None else value[j]


def _local(a: Any, target: Optional[DTensorSpec]) -> torch.Tensor:
    if isinstance(a, DTensor):
        return a._local_tensor if target is None else redistribute_local(a._local_tensor, a._spec, target)
    # a plain tensor under implicit_replication: replicated, so its local piece is itself
    if target is None:
        return a  # type: ignore[no-any-return]
    spec = DTensorSpec(target.mesh, (Replicate(),) * target.mesh.ndim, target.tensor_meta)
    return redistribute_local(a, spec, target)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the aten op `func` on DTensor arguments: the lean path, or `_run` for the rest."""
    # the key inlines the two common cases of `_key_part`: a DTensor and a plain scalar
    key = (func, *[
        a._spec if isinstance(a, DTensor) else (a.__class__, a) if a.__class__ in _SCALAR_TYPES else _key_part(a, func)
        for a in args
    ])
    if kwargs:
        key += (tuple((k, _key_part(v, func)) for k, v in kwargs.items()),)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(func, args, kwargs)
        _PLANS[key] = plan
    if plan.fast:
        local_args = list(args)
        for k in plan.unwrap:
            local_args[k] = args[k]._local_tensor
        for k, target in plan.moved:
            local_args[k] = _local(args[k], target)
        if plan.shape_arg is not None:
            local_args[plan.shape_arg] = plan.local_shape
        out = plan.call(*local_args, **kwargs)
        if plan.single is not None:
            cls, shape, stride, dtype, spec = plan.wraps[0]
            r: Any = _make_wrapper(cls, shape, strides=stride, dtype=dtype, device=out.device, layout=out.layout)
            r._local_tensor = out
            r._spec = spec
            return r
        return tuple([_wrap_one(o, w) for o, w in zip(out, plan.wraps)])
    return _run(plan, func, args, kwargs)


def _run(plan: _Plan, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The general path: nested arguments, local impls, in-place and out= ops, decompositions."""
    if plan.decompose is not None:
        return _run_decomposition(plan.decompose, args, kwargs)
    if plan.simple:
        local_args = list(args)
        for k, target in plan.moves:
            local_args[k] = _local(args[k], target)
        local_kwargs = kwargs
    else:
        local_args, local_kwargs = _unwrap_nested(args, kwargs, plan)
    if plan.shape_arg is not None:
        local_args[plan.shape_arg] = plan.local_shape
    if plan.impl is None:
        out = func(*local_args, **local_kwargs)
    elif plan.impl_specs is None:
        out = plan.impl(func, local_args, local_kwargs, plan.outputs)
    else:
        out = plan.impl(func, local_args, local_kwargs, plan.outputs, input_specs=plan.impl_specs)
    if plan.resolve:
        out = out.resolve_conj().resolve_neg()
    if plan.dynamic_mesh is not None:
        return _wrap_replicated(out, plan.dynamic_mesh)
    if plan.writebacks:
        _write_back(args, kwargs, local_args, local_kwargs, plan)
    if plan.relayout:
        assert plan.single is not None
        _relayout(args[0], out if isinstance(out, torch.Tensor) else local_args[0], plan.single)
    if plan.returns is not None:
        if not func._schema.returns:  # `-> ()` ops must return None to torch
            return None
        returned = [_get(args, kwargs, loc) for loc in plan.returns]
        return returned[0] if len(returned) == 1 else tuple(returned)
    if plan.single is not None:
        return DTensor(out, plan.single, requires_grad=False)
    return _wrap(out, plan.outputs)


def _wrap_one(local: torch.Tensor, w: _Out) -> DTensor:
    cls, shape, stride, dtype, spec = w
    r: Any = _make_wrapper(cls, shape, strides=stride, dtype=dtype, device=local.device, layout=local.layout)
    r._local_tensor = local
    r._spec = spec
    return r  # type: ignore[no-any-return]


def _unwrap_nested(args: tuple[Any, ...], kwargs: dict[str, Any], plan: _Plan) -> tuple[list[Any], dict[str, Any]]:
    local_args: list[Any] = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
    local_kwargs = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
    for (key, j), target in plan.moves:
        holder: Any = local_args if isinstance(key, int) else local_kwargs
        value = _local(_get(args, kwargs, (key, j)), target)
        if j is None:
            holder[key] = value
        else:
            holder[key][j] = value
    return local_args, local_kwargs


def _write_back(args: Any, kwargs: dict[str, Any], local_args: Any, local_kwargs: dict[str, Any], plan: _Plan) -> None:
    """Results written into a moved copy go back into the owner's layout and storage."""
    targets = dict(plan.moves) if not plan.simple else {(k, None): t for k, t in plan.moves}
    for loc in plan.writebacks:
        owner = _get(args, kwargs, loc)
        written = _get(local_args, local_kwargs, loc)
        target = targets[loc]
        assert isinstance(owner, DTensor) and target is not None
        owner._local_tensor.copy_(redistribute_local(written, target, owner._spec))


def _wrap_replicated(out: Any, mesh: DeviceMesh) -> Any:
    """Wrap the outputs of a replicated run whose shapes were only known after it."""
    if isinstance(out, torch.Tensor):
        meta = TensorMeta(out.shape, tuple(out.stride()), out.dtype)
        return DTensor(out, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta), requires_grad=False)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(o, mesh) for o in out)
    return out


def _wrap(out: Any, spec: Any) -> Any:
    if isinstance(spec, DTensorSpec):
        return DTensor(out, spec, requires_grad=False)
    if isinstance(spec, tuple):
        return tuple(_wrap(o, s) for o, s in zip(out, spec))
    return out


from ._dtensor import DTensor, class_for  # noqa: E402

_make_wrapper = torch.Tensor._make_wrapper_subclass
