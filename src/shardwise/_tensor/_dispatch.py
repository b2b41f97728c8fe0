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
    __slots__ = ("targets", "outputs", "shape_arg", "local_shape", "inplace")

    def __init__(
        self,
        targets: tuple[Optional[DTensorSpec], ...],
        outputs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None],
        shape_arg: Optional[int],
        local_shape: Optional[list[int]],
        inplace: bool,
    ) -> None:
        self.targets = targets
        self.outputs = outputs
        self.shape_arg = shape_arg
        self.local_shape = local_shape
        self.inplace = inplace


_PLANS: dict[OpSchema, _Plan] = {}


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


def _make_plan(schema: OpSchema) -> _Plan:
    result = propagate(schema)
    local_shape = None
    if result.shape_arg is not None:
        spec = result.output_specs
        assert isinstance(spec, DTensorSpec)
        mesh = spec.mesh
        assert isinstance(mesh, DeviceMesh)
        coordinate = mesh._coordinate or (0,) * mesh.ndim
        local_shape = list(spec.local_shape_and_offset(coordinate)[0])
    args = schema.op._schema.arguments
    inplace = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    if inplace and result.input_specs and result.input_specs[0] is not None:
        raise ValueError(
            f"in-place {schema.op} would have to change the layout of its first argument "
            f"({schema}); redistribute that tensor first or use the out-of-place op"
        )
    return _Plan(result.input_specs, result.output_specs, result.shape_arg, local_shape, inplace)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    schema = OpSchema(
        func,
        tuple(_schema_arg(a, func) for a in args),
        tuple((k, _schema_arg(v, func)) for k, v in kwargs.items()) if kwargs else (),
    )
    plan = _PLANS.get(schema)
    if plan is None:
        plan = _make_plan(schema)
        _PLANS[schema] = plan
    local_args = list(args)
    j = 0
    targets = plan.targets
    for k, a in enumerate(args):
        if isinstance(a, DTensor):
            target = targets[j]
            j += 1
            local_args[k] = a._local_tensor if target is None else redistribute_local(a._local_tensor, a._spec, target)
    if plan.shape_arg is not None:
        local_args[plan.shape_arg] = plan.local_shape
    out = func(*local_args, **kwargs)
    if plan.inplace:
        return args[0]
    return _wrap(out, plan.outputs)


def _wrap(out: Any, spec: Any) -> Any:
    if isinstance(spec, DTensorSpec):
        return DTensor(out, spec, requires_grad=False)
    if isinstance(spec, tuple):
        return tuple(_wrap(o, s) for o, s in zip(out, spec))
    return out


from ._dtensor import DTensor  # noqa: E402
