"""The propagator: from an op call's input specs to the layouts its inputs need and its
outputs get. Pure (meta tensors give global output shapes); results cached per schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .._layout import format_placements
from .._spec import DTensorSpec, TensorMeta
from ._registry import get_rule
from ._schema import Layout, OpSchema, OutputSharding

__all__ = ["PropagationResult", "propagate", "ScalarTensor"]


@dataclass(frozen=True)
class ScalarTensor:
    """A plain 0-dim tensor argument: treated as a replicated scalar."""

    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class PropagationResult:
    input_specs: tuple[Optional[DTensorSpec], ...]  # per DTensor argument: target spec, None to keep
    output_specs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None]
    shape_arg: Optional[int]


def _to_meta(a: Any) -> Any:
    if isinstance(a, DTensorSpec):
        return torch.empty_strided(a.shape, a.tensor_meta.stride, dtype=a.dtype, device="meta")
    if isinstance(a, ScalarTensor):
        return torch.empty((), dtype=a.dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x) for x in a)
    return a


def _meta_of(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return TensorMeta(out.shape, tuple(out.stride()), out.dtype)
    if isinstance(out, (list, tuple)):
        return tuple(_meta_of(o) for o in out)
    return None


_CACHE: dict[OpSchema, PropagationResult] = {}


def propagate(schema: OpSchema) -> PropagationResult:
    hit = _CACHE.get(schema)
    if hit is not None:
        return hit
    rule = get_rule(schema.op)
    if rule is None:
        raise NotImplementedError(
            f"shardwise has no sharding rule for {schema.op} yet; it was called as {schema}. "
            f"Run it on local tensors (dtensor.to_local()) or full tensors (dtensor.full_tensor()) meanwhile"
        )
    meta_out = schema.op(*_to_meta(schema.args_schema), **{k: _to_meta(v) for k, v in schema.kwargs_schema})
    out_meta = _meta_of(meta_out)
    sharding = rule(schema, out_meta)
    result = _assemble(schema, sharding, out_meta)
    _CACHE[schema] = result
    return result


def _assemble(schema: OpSchema, sharding: OutputSharding, out_meta: Any) -> PropagationResult:
    specs = schema.tensor_specs()
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(f"{schema.op} got DTensors on different meshes: {mesh!r} and {s.mesh!r}; redistribute one onto the other's mesh")
    targets = tuple(
        None if lay is None else spec.with_placements(lay.placements, lay.shard_order)
        for spec, lay in zip(specs, sharding.input_layouts)
    )

    def out_spec(lay: Optional[Layout], meta: Any) -> Optional[DTensorSpec]:
        if lay is None or meta is None:
            return None
        return DTensorSpec(mesh, lay.placements, meta, lay.shard_order)

    outs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None]
    if isinstance(sharding.output_layouts, tuple):
        outs = tuple(out_spec(lay, m) for lay, m in zip(sharding.output_layouts, out_meta))
    else:
        outs = out_spec(sharding.output_layouts, out_meta)
    return PropagationResult(targets, outs, sharding.shape_arg)


def describe(specs: list[DTensorSpec]) -> str:
    return ", ".join(format_placements(s.placements) for s in specs)
