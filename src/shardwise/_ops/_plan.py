"""Op planning as one pure step: from a described call (`OpCall`) to a frozen plan.

`make_plan` decides everything about how one op call runs on DTensors -- which rule, the
layouts propagation picks, the strided reading of a fused projection's parts, which inputs
move where, the outputs' specs, this rank's local shape, what is written back and what is
returned -- and says it as data. It never talks to processes and never touches a tensor:
the tensor layer (`_tensor._dispatch`) turns the plan into a runner, once, and caches it.

| plan | when | the runner does |
|---|---|---|
| `RunSharded` | the op runs on the pieces (most calls) | move inputs to `targets`, the op (or the rule's `local`), wrap `outputs`, write back |
| `RunDecomposed` | the op has no rule but a decomposition | the decomposition, its pieces dispatched |
| `RunPerMesh` | a foreach / fused call over several meshes, or plain tensors | the call once per mesh |
| `RunOutside` | this rank is outside the call's mesh | nothing: empty pieces of `outputs` |
| `SplitParts`, `SliceParts`, `SliceBackwardParts`, `CatParts` | whole parts of a `_StridedShard` dim (`_strided_plan`) | the local op on the piece |
| `Unstride` | any other call with a `_StridedShard` input | gather the parts back in order, plan again |

>>> import torch
>>> from shardwise._mesh import AbstractMesh
>>> from shardwise._placement import Replicate, Shard
>>> from shardwise._spec import DTensorSpec, TensorMeta
>>> mesh = AbstractMesh((4,))
>>> a = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8, 6]), (6, 1), torch.float32))
>>> b = DTensorSpec(mesh, (Replicate(),), TensorMeta(torch.Size([6, 2]), (2, 1), torch.float32))
>>> plan = make_plan(OpCall(torch.ops.aten.mm.default, (a, b), (), frozenset(), (1,)))
>>> plan.lean, plan.outputs.placements, [t for _, _, t in plan.moves]
(True, (Shard(dim=0),), [None, None])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Optional, Union

from .._placement import Replicate
from .._spec import DTensorSpec, TensorMeta
from ._call import Location, OpCall, PlainTensor
from ._local import LocalFn
from ._propagate import propagate
from ._registry import OpKind, OpRule, rule_for
from ._schema import OutputSharding, ScalarTensor
from ._strided_plan import (CatParts, SliceBackwardParts, SliceParts, SplitParts, Unstride, cat_parts, has_strided,
                            parts_reading, read_back, slice_backward_parts, slice_parts, split_parts, unstride)

__all__ = ["OpPlan", "RunDecomposed", "RunOutside", "RunPerMesh", "RunSharded", "make_plan"]


@dataclass(frozen=True)
class RunSharded:
    """The op on the pieces. `moves`: every tensor input, its spec (a plain tensor's:
    replicated) and the spec it runs in (None: as it is); `writebacks`: moved written
    arguments and the move back; `lean`: none of the extras below `outputs` applies, every
    input is a top-level positional argument and every output a DTensor."""

    op: Any
    moves: tuple[tuple[Location, DTensorSpec, Optional[DTensorSpec]], ...]
    outputs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None]
    shape_arg: Optional[int]  # argument rewritten to output 0's local shape (a `new_*` op)
    local_shape: Optional[tuple[int, ...]]
    lean: bool
    unwrap: tuple[int, ...]  # DTensor positions used as they are
    lists: tuple[Union[int, str], ...]  # list arguments of DTensors none of which moves: unwrapped whole
    flat: bool  # every tensor input is a top-level positional argument
    local: Optional[LocalFn]  # run instead of the aten op
    resolve: bool  # the op returns a lazy conj/neg view: materialize it
    dynamic_mesh: Any  # outputs described after the run (replicated on this mesh), else None
    writebacks: tuple[tuple[Location, DTensorSpec, DTensorSpec], ...]  # (where, as run, as owned)
    relayout: Optional[DTensorSpec]  # self takes this layout (squeeze_)
    returns: Optional[tuple[Location, ...]]  # in-place / out=: return these inputs
    returns_nothing: bool  # a `-> ()` op


@dataclass(frozen=True)
class RunDecomposed:
    """Run PyTorch's decomposition of the op: its pieces have rules, so it runs sharded."""

    decompose: Callable[..., Any]


@dataclass(frozen=True)
class RunPerMesh:
    """A `_foreach_*` / `_fused_*` call whose list elements sit on several meshes, or some on
    none: run once per group of element indices (`plain`: the group of plain elements)."""

    groups: tuple[tuple[int, ...], ...]
    length: int
    plain: Optional[int]


@dataclass(frozen=True)
class RunOutside:
    """A rank outside the call's mesh: `outputs` in the layouts propagation gives (Replicate
    where it cannot say), holding nothing; written arguments returned; `answer` for a
    non-tensor result torch gives there."""

    outputs: Any
    returns: Optional[tuple[Location, ...]]
    returns_nothing: bool
    answer: Optional[bool]


OpPlan = Union[RunSharded, RunDecomposed, RunPerMesh, RunOutside, SplitParts, SliceParts, SliceBackwardParts, CatParts,
               Unstride]


def make_plan(call: OpCall) -> OpPlan:
    """The plan of one op call on DTensors, under `call.modes` (pure: see the module docstring)."""
    rule = rule_for(call.op, call.modes)
    found: Optional[OpPlan] = cat_parts(call) or slice_backward_parts(call)
    if found is not None:
        return found
    if rule.kind is OpKind.DECOMPOSED:
        return RunDecomposed(rule.decomposition)
    by_mesh = _per_mesh(call, rule)
    if by_mesh is not None:
        return by_mesh
    _one_mesh(call)
    schema = call.schema()
    if call.mesh() is not None and call.coordinate is None and not rule.metadata_only:
        return _outside(call, rule)
    specs = schema.input_specs()
    if not has_strided(specs):
        return _sharded(call, rule, propagate(schema, rule))
    # a `_StridedShard` input (a fused projection's parts): see `_strided_plan`
    split: Optional[OpPlan] = split_parts(call) or slice_parts(call)
    if split is not None:
        return split
    read = parts_reading(schema, rule)
    result = None if read is None else read_back(propagate(read, rule), specs, rule, call.locations())
    if result is not None:
        return _sharded(call, rule, result)
    return unstride(call, rule.written(len(call.args)))


def _returns(call: OpCall, rule: OpRule, written: set[Union[int, str]]) -> Optional[tuple[Location, ...]]:
    if not (written and rule.returns_written):
        return None
    return tuple(loc for loc in call.locations() if loc[0] in written)


def _outside(call: OpCall, rule: OpRule) -> RunOutside:
    schema = call.schema()
    try:
        outputs: Any = propagate(schema, rule).output_spec
    except Exception:  # a layout only a real run could place: its values are never read here
        mesh = call.mesh()
        meta = schema.output_meta()
        metas = meta if isinstance(meta, tuple) and not isinstance(meta, TensorMeta) else (meta,)
        made = tuple(DTensorSpec(mesh, (Replicate(),) * mesh.ndim, m) if isinstance(m, TensorMeta) else None
                     for m in metas)
        outputs = made if isinstance(meta, tuple) and not isinstance(meta, TensorMeta) else made[0]
    return RunOutside(outputs, _returns(call, rule, rule.written(len(call.args))), rule.returns_nothing,
                      rule.outside_answer)


def _one_mesh(call: OpCall) -> None:
    """ValueError if the call's DTensors sit on different meshes (only `_foreach_*` / `_fused_*`
    calls run per mesh): a strategy lays out the inputs of one mesh."""
    meshes = call.meshes()
    if len(meshes) > 1:
        raise ValueError(
            f"{call.op} got DTensors on {len(meshes)} meshes, {' and '.join(map(repr, meshes))}: an op's DTensors share "
            f"one mesh (only _foreach_* and _fused_* ops run per mesh). Move them onto one with "
            f"x.redistribute(device_mesh=...), or reduce each to a plain tensor first (x.full_tensor()); e.g. a global "
            f"gradient norm over a tp x dp model (its matrices on (dp, tp), its norms' weights on dp) is one norm per "
            f"mesh made whole, then combined")


def _per_mesh(call: OpCall, rule: OpRule) -> Optional[RunPerMesh]:
    """For a `_foreach_*` / `_fused_*` call whose list elements sit on more than one mesh, or
    on none (plain tensors), the plan that runs it once per mesh; None for any other call."""
    if not rule.per_element:
        return None
    lists = [a for a in call.args if isinstance(a, tuple) and a and _is_tensor(a[0])]
    if not lists:
        return None
    n = len(lists[0])
    groups: dict[Any, list[int]] = {}
    for k in range(n):
        mesh = next((a[k].mesh for a in lists if len(a) == n and isinstance(a[k], DTensorSpec)), None)
        groups.setdefault(mesh, []).append(k)
    if len(groups) < 2 and None not in groups:
        return None
    plain = list(groups).index(None) if None in groups else None
    return RunPerMesh(tuple(tuple(g) for g in groups.values()), n, plain)


def _is_tensor(a: Any) -> bool:
    return isinstance(a, (DTensorSpec, PlainTensor, ScalarTensor))


def _sharded(call: OpCall, rule: OpRule, result: OutputSharding) -> RunSharded:
    """The plan of a call that runs on the pieces, from propagation's answer `result`."""
    where = call.locations()
    specs = call.schema().input_specs()
    moves = tuple((loc, s, t) for loc, s, t in zip(where, specs, result.input_specs))
    outputs = result.output_spec
    single = outputs if isinstance(outputs, DTensorSpec) else None
    local_shape = None
    if result.shape_arg is not None:
        assert single is not None
        coordinate = call.coordinate or (0,) * single.mesh.ndim
        local_shape = tuple(single.local_shape_and_offset(coordinate)[0])
    written = rule.written(len(call.args))
    self_spec = call.args[0] if call.args and isinstance(call.args[0], DTensorSpec) else None
    relayout = single if rule.relayout and self_spec is not None else None
    if rule.relayout and self_spec is not None:
        _check_growth(call.op, self_spec, single)
        written.discard(0)  # self takes the result's layout: nothing to move back
    elif rule.inplace and self_spec is not None and isinstance(outputs, DTensorSpec) and outputs.shape != self_spec.shape:
        raise ValueError(
            f"in-place {call.op} would change a DTensor's shape from {tuple(self_spec.shape)} to "
            f"{tuple(outputs.shape)}: use the out-of-place op (e.g. x = x.transpose(0, 1))"
        )
    writebacks = tuple((loc, t, s) for loc, s, t in moves if t is not None and loc[0] in written)
    if relayout is not None:
        written.add(0)
    returns = _returns(call, rule, written)
    flat = all(isinstance(k, int) and j is None for k, j in where)
    lean = (flat and rule.local is None and not rule.lazy_view and not result.dynamic and not writebacks
            and relayout is None and returns is None and _all_dtensors(outputs) and hasattr(call.op, "_op"))
    kwargs = dict(call.kwargs)
    lists = tuple(k for k in {k for (k, j), _, _ in moves if j is not None}
                  if all(t is None for (kk, _), _, t in moves if kk == k)
                  and all(isinstance(x, DTensorSpec) for x in (call.args[k] if isinstance(k, int) else kwargs[k])))
    return RunSharded(
        op=call.op,
        moves=moves,
        outputs=outputs,
        shape_arg=result.shape_arg,
        local_shape=local_shape,
        lean=lean,
        unwrap=tuple(int(k) for (k, _), _, t in moves if t is None and isinstance(call.args[int(k)], DTensorSpec))
        if flat else (),
        lists=lists,
        flat=flat,
        local=rule.local,
        resolve=rule.lazy_view,
        dynamic_mesh=call.mesh() if result.dynamic else None,
        writebacks=writebacks,
        relayout=relayout,
        returns=returns,
        returns_nothing=rule.returns_nothing,
    )


def _all_dtensors(outputs: Any) -> bool:
    """Whether every output is a DTensor (the lean runner wraps them all)."""
    if isinstance(outputs, DTensorSpec):
        return True
    return isinstance(outputs, tuple) and bool(outputs) and all(isinstance(o, DTensorSpec) for o in outputs)


def _check_growth(op: Any, self_spec: DTensorSpec, out: Optional[DTensorSpec]) -> None:
    if out is None or math.prod(out.shape) > math.prod(self_spec.shape):
        got = "an unknown shape" if out is None else tuple(out.shape)
        raise ValueError(
            f"{op} would grow a DTensor from shape {tuple(self_spec.shape)} to {got}: a DTensor's storage "
            f"cannot grow in place; make a new one (shardwise.empty(shape, device_mesh=..., placements=...))"
        )
