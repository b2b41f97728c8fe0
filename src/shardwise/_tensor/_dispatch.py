"""Eager dispatch of an aten op on DTensors: look up the plan, redistribute, run locally, wrap.

The first call with a given op, argument layouts and non-tensor arguments builds a plan
(propagation on the abstract layouts plus this rank's local shapes); every later call with
the same key is a dictionary lookup followed by the local op.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .._mesh import DeviceMesh
from .._spec import DTensorSpec
from .._ops import OpSchema, ScalarTensor, propagate
from ._redistribute import redistribute_local

__all__ = ["dispatch"]


class _Plan:
    """What to do for one cache key: per DTensor argument position, the spec to move it to
    (None: use its local tensor as is), the output specs, and a local shape argument."""

    __slots__ = ("moves", "outputs", "single", "shape_arg", "local_shape", "inplace")

    def __init__(
        self,
        moves: tuple[tuple[int, Optional[DTensorSpec]], ...],
        outputs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None],
        shape_arg: Optional[int],
        local_shape: Optional[list[int]],
        inplace: bool,
    ) -> None:
        self.moves = moves
        self.outputs = outputs
        self.single = outputs if isinstance(outputs, DTensorSpec) else None
        self.shape_arg = shape_arg
        self.local_shape = local_shape
        self.inplace = inplace


# Keyed by (op, one entry per argument, kwargs): a DTensor argument contributes its spec
# (hashed once, at creation), anything else (type, value) -- 2, 2.0 and True give
# different dtypes, so the type is part of the key.
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_SCALARS = (int, float, bool, complex, type(None), str, torch.dtype)


def _schema_arg(a: Any, func: Any) -> Any:
    if isinstance(a, DTensor):
        return a._spec
    if isinstance(a, torch.Tensor):
        if a.ndim == 0:
            return ScalarTensor(a.dtype, a.device.type)
        # ValueError, not TypeError: torch turns a TypeError inside `a + b` into NotImplemented,
        # and Python would replace this message with "unsupported operand type(s)".
        raise ValueError(
            f"{func} got a plain torch.Tensor of shape {tuple(a.shape)} mixed with DTensors: wrap it with "
            f"shardwise.distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, placements) first"
        )
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        raise NotImplementedError(f"{func} takes a list of tensors; list-of-DTensor ops arrive with the propagation issue")
    if isinstance(a, list):
        return tuple(a)
    return a


def _make_plan(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Plan:
    schema = OpSchema(
        func,
        tuple(_schema_arg(a, func) for a in args),
        tuple((k, _schema_arg(v, func)) for k, v in kwargs.items()) if kwargs else (),
    )
    result = propagate(schema)
    local_shape = None
    if result.shape_arg is not None:
        spec = result.output_specs
        assert isinstance(spec, DTensorSpec)
        mesh = spec.mesh
        assert isinstance(mesh, DeviceMesh)
        coordinate = mesh._coordinate or (0,) * mesh.ndim
        local_shape = list(spec.local_shape_and_offset(coordinate)[0])
    arguments = func._schema.arguments
    inplace = bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    if inplace and result.input_specs and result.input_specs[0] is not None:
        raise ValueError(
            f"in-place {func} would have to change the layout of its first argument "
            f"({schema}); redistribute that tensor first or use the out-of-place op"
        )
    positions = [k for k, a in enumerate(args) if isinstance(a, DTensor)]
    moves = tuple(zip(positions, result.input_specs))
    return _Plan(moves, result.output_specs, result.shape_arg, local_shape, inplace)


def _key_part(a: Any, func: Any) -> Any:
    if isinstance(a, DTensor):
        return a._spec
    if isinstance(a, _SCALARS):
        return (a.__class__, a)
    if isinstance(a, list):
        return (list, tuple(_key_part(x, func) for x in a))
    return (a.__class__, _schema_arg(a, func))


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    key = (func, *[_key_part(a, func) for a in args])
    if kwargs:
        key += (tuple((k, _key_part(v, func)) for k, v in kwargs.items()),)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(func, args, kwargs)
        _PLANS[key] = plan
    local_args = list(args)
    for k, target in plan.moves:
        a = args[k]
        local_args[k] = a._local_tensor if target is None else redistribute_local(a._local_tensor, a._spec, target)
    if plan.shape_arg is not None:
        local_args[plan.shape_arg] = plan.local_shape
    out = func(*local_args, **kwargs)
    if plan.inplace:
        return args[0]
    if plan.single is not None:
        return DTensor(out, plan.single, requires_grad=False)
    return _wrap(out, plan.outputs)


def _wrap(out: Any, spec: Any) -> Any:
    if isinstance(spec, DTensorSpec):
        return DTensor(out, spec, requires_grad=False)
    if isinstance(spec, tuple):
        return tuple(_wrap(o, s) for o, s in zip(out, spec))
    return out


from ._dtensor import DTensor  # noqa: E402
