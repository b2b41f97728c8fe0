"""Dispatch plans: what one op call does, worked out once per cache key and run on every call.

Each plan is a small frozen value with its own `run(args, kwargs)`:

| plan | for | a call runs |
|---|---|---|
| `LeanPlan` | top-level DTensor arguments, the aten op itself on the pieces, fresh outputs | unwrap, move what must move, the C op, wrap |
| `GeneralPlan` | nested arguments, local implementations, in-place and out= ops, outputs known only after the run | the same, then moved arguments written back, self re-laid out, written arguments returned |
| `DecomposedPlan` | an op without a rule whose PyTorch decomposition has pieces with rules | the decomposition (its ops dispatched one by one) |
| `ByMeshPlan` | a `_foreach_*` / `_fused_*` call over DTensors on several meshes | the call once per mesh |
| `OutsidePlan` | a rank outside the DTensors' mesh | nothing: empty pieces out (torch's rule) |
| `ViewPlan` | around any plan of a view op | the plan; under `inference_mode`, on a normal tensor, outside it |

Every move is a `Move` (plan and this rank's program) made when the plan was made, so a
call only runs programs; every output goes through `wrap`.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch

from .._layout import dense_strides_like
from .._mesh import AbstractMesh
from .._ops import LocalCall, LocalFn, Location
from .._placement import Replicate
from .._redistribute import run_program
from .._spec import DTensorSpec, TensorMeta
from ._redistribute import Move, run_move
from ._runtime import RUNTIME
from ._wrap import DTENSOR_CLASSES, DTensorBase, Wrapper, rewrap, wrap

_make_wrapper = torch.Tensor._make_wrapper_subclass
_piece_of = operator.attrgetter("_local_tensor")  # in C: no Python frame per argument list

__all__ = ["ByMeshPlan", "DecomposedPlan", "GeneralPlan", "LeanPlan", "Location", "OutsidePlan", "Plan", "RestridedPlan",
           "ViewPlan", "empty_piece", "implicit", "implicit_replication", "misplaced", "restride"]

_IMPLICIT: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_implicit_replication", default=False)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this block, a plain tensor mixed with DTensors counts as replicated on their
    mesh without being checked: you vouch that it is the same on every rank.

    Outside it such a tensor counts as replicated too, but the first time plain tensors meet
    DTensors at an op the ranks check that they agree (`_plain.check_plain`), so a
    rank-local tensor raises instead of being silently taken as global.
    """
    token = _IMPLICIT.set(True)
    try:
        yield
    finally:
        _IMPLICIT.reset(token)


def implicit() -> bool:
    """Whether `implicit_replication()` is on."""
    return _IMPLICIT.get()


def _piece(a: Any, move: Optional[Move]) -> torch.Tensor:
    """This rank's piece of argument `a` (a DTensor, or a plain tensor counted as replicated),
    moved by `move` when it must be."""
    local = a._local_tensor if a.__class__ in DTENSOR_CLASSES or isinstance(a, DTensorBase) else a
    return local if move is None else run_move(move, local)


@dataclass(frozen=True, slots=True)
class LeanPlan:
    """Unwrap, move, call the C op, wrap: nothing else."""

    call: Callable[..., Any]  # the OpOverload's C op
    unwrap: tuple[int, ...]  # positions whose piece is used as it is
    moved: tuple[tuple[int, Move], ...]  # positions moved first
    shape_arg: Optional[int]  # argument rewritten to output 0's local shape
    local_shape: Optional[list[int]]
    outputs: tuple[Wrapper, ...]  # one per output
    single: Optional[Wrapper]  # the one output's (not a tuple of one)
    only_pieces: bool  # every argument is a DTensor used as it is (the commonest call)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.only_pieces:
            out = self.call(*map(_piece_of, args), **kwargs)
        else:
            local_args = list(args)
            for k in self.unwrap:
                local_args[k] = args[k]._local_tensor
            for k, move in self.moved:
                local_args[k] = _piece(args[k], move)
            if self.shape_arg is not None:
                local_args[self.shape_arg] = self.local_shape
            out = self.call(*local_args, **kwargs)
        # `Wrapper.__call__`, inlined: one call less per output on every op
        w = self.single
        if w is not None:
            r: Any = _make_wrapper(w.cls, w.shape, strides=w.stride, dtype=w.dtype, device=out.device, layout=out.layout)
            r._local_tensor = out
            r._spec = w.spec
            return r
        made = []
        for o, w in zip(out, self.outputs):
            r = _make_wrapper(w.cls, w.shape, strides=w.stride, dtype=w.dtype, device=o.device, layout=o.layout)
            r._local_tensor = o
            r._spec = w.spec
            made.append(r)
        return tuple(made)


def _get(args: Any, kwargs: dict[str, Any], loc: Location) -> Any:
    key, j = loc
    value = args[key] if isinstance(key, int) else kwargs[key]
    return value if j is None else value[j]


@dataclass(frozen=True, slots=True)
class GeneralPlan:
    """Everything the lean plan skips: nested arguments, local implementations, written
    arguments, relayout, outputs described after the run."""

    func: Any
    moves: tuple[tuple[Location, Optional[Move]], ...]  # every DTensor input, and how it moves (but `lists`')
    lists: tuple[Union[int, str], ...]  # list arguments of DTensors that all stay put: unwrapped whole
    flat: bool  # every DTensor input is a top-level positional argument
    outputs: Union[DTensorSpec, tuple[Optional[DTensorSpec], ...], None]
    shape_arg: Optional[int]
    local_shape: Optional[list[int]]
    local: Optional[LocalFn]  # run instead of the aten op
    input_specs: tuple[DTensorSpec, ...]  # each DTensor input's spec as the op runs (for `local`)
    resolve: bool  # the op returns a lazy conj/neg view: materialize it
    dynamic_mesh: Optional[AbstractMesh]  # outputs described after the run (replicated)
    writebacks: tuple[tuple[Location, Move], ...]  # moved written arguments, and the move back
    relayout: Optional[DTensorSpec]  # self takes this layout (squeeze_)
    returns: Optional[tuple[Location, ...]]  # in-place / out=: return these inputs
    returns_nothing: bool  # a `-> ()` op

    def _unwrap(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        if self.flat:
            local_args = list(args)
            for (k, _), move in self.moves:
                local_args[k] = _piece(args[k], move)  # type: ignore[index]
            return local_args, kwargs
        local_args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
        local_kwargs = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
        for key in self.lists:
            if isinstance(key, int):
                local_args[key] = list(map(_piece_of, args[key]))
            else:
                local_kwargs[key] = list(map(_piece_of, kwargs[key]))
        for (key, j), move in self.moves:
            holder: Any = local_args if isinstance(key, int) else local_kwargs
            value = _piece(_get(args, kwargs, (key, j)), move)
            if j is None:
                holder[key] = value
            else:
                holder[key][j] = value
        return local_args, local_kwargs

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        local_args, local_kwargs = self._unwrap(args, kwargs)
        if self.shape_arg is not None:
            local_args[self.shape_arg] = self.local_shape
        if self.local is None:
            out = self.func(*local_args, **local_kwargs)
        else:
            call = LocalCall(self.func, local_args, local_kwargs, self.input_specs, self.outputs, RUNTIME)
            out = self.local(call)
            local_args = call.args  # a local implementation may replace an argument (a re-laid copy)
        if self.resolve:
            out = out.resolve_conj().resolve_neg()
        if self.dynamic_mesh is not None:
            return _wrap_replicated(out, self.dynamic_mesh)
        for loc, back in self.writebacks:
            owner = _get(args, kwargs, loc)
            value = run_program(back.program, _get(local_args, local_kwargs, loc))
            # a plain owner counts as replicated: its move back is to Replicate, the whole value
            (owner._local_tensor if isinstance(owner, DTensorBase) else owner).copy_(value)
        if self.relayout is not None:
            rewrap(args[0], out if isinstance(out, torch.Tensor) else local_args[0], self.relayout)
        if self.returns is not None:
            if self.returns_nothing:  # `-> ()` ops must return None to torch
                return None
            returned = [_get(args, kwargs, loc) for loc in self.returns]
            return returned[0] if len(returned) == 1 else tuple(returned)
        return _wrap_outputs(out, self.outputs)


@dataclass(frozen=True, slots=True)
class DecomposedPlan:
    """Run PyTorch's decomposition of the op: its pieces have rules, so it runs sharded."""

    decompose: Callable[..., Any]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Tensors a decomposition creates come from global shapes and scalars: the same on
        # every rank, so they count as replicated.
        with implicit_replication():
            return self.decompose(*args, **kwargs)


def _order(shape: Any, stride: Any) -> tuple[int, ...]:
    """The tensor dims of size > 1, outermost first (by stride, then dim): a layout's memory order."""
    return tuple(sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: (-stride[d], d)))


def misplaced(out: Any) -> tuple[bool, ...]:
    """Per output: whether a DTensor's piece is laid out in another memory order than its
    spec's (global) strides say, e.g. a kernel that got contiguous moved pieces where the
    global tensors were transposed."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return tuple(
        isinstance(o, DTensorBase)
        and _order(o._local_tensor.shape, o._local_tensor.stride()) != _order(o._local_tensor.shape, o._spec.tensor_meta.stride)
        for o in outs
    )


def restride(o: DTensorBase) -> None:
    """Copy `o`'s piece into the memory order of its spec's strides (so `.contiguous()`, views
    and `is_contiguous()` answer for the piece what they answer for the global tensor)."""
    local = o._local_tensor
    laid = torch.empty_strided(local.shape, dense_strides_like(local.shape, o._spec.tensor_meta.stride), dtype=local.dtype,
                               device=local.device, requires_grad=False)
    laid.copy_(local)
    o._local_tensor = laid


@dataclass(frozen=True, slots=True)
class RestridedPlan:
    """A plan whose fresh outputs come out of the kernel in another memory order than the
    global tensor's: their pieces are re-laid after each run (found on the first run)."""

    inner: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    which: tuple[bool, ...]  # per output

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.inner(args, kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for o, fix in zip(outs, self.which):
            if fix:
                restride(o)
        return out


class Plan(Protocol):
    """What every plan is: a `run(args, kwargs)` for each call of its cache key."""

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


def _wrap_replicated(out: Any, mesh: AbstractMesh) -> Any:
    """Wrap the outputs of a replicated run whose shapes were only known after it."""
    if isinstance(out, torch.Tensor):
        meta = TensorMeta(out.shape, tuple(out.stride()), out.dtype)
        return wrap(out, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(o, mesh) for o in out)
    return out


def _wrap_outputs(out: Any, spec: Any) -> Any:
    if isinstance(spec, DTensorSpec):
        return wrap(out, spec)
    if isinstance(spec, tuple):
        return tuple(_wrap_outputs(o, s) for o, s in zip(out, spec))
    return out


@dataclass(frozen=True, slots=True)
class ByMeshPlan:
    """A `_foreach_*` / `_fused_*` call whose list elements live on different meshes (a
    gradient-norm clip over a pipeline stage's TP and DP parameters), or some on none (the
    plain parameters a torch-style plan leaves beside its DTensors): element k touches only
    the k-th tensor of each list, so the call runs once per mesh, on that mesh's elements,
    the plain elements run as the plain op (a DTensor beside them, such as a clip
    coefficient, taken whole), and the results go back in the caller's order."""

    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
    func: Any
    groups: tuple[tuple[int, ...], ...]  # element indices per mesh, in first-seen order
    length: int  # elements per list
    plain: Optional[int] = None  # the group of plain elements, if any

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        results: list[Any] = [None] * self.length
        returned = False
        for g, indices in enumerate(self.groups):
            def take(a: Any) -> Any:
                if isinstance(a, (list, tuple)) and len(a) == self.length:
                    return [a[k] for k in indices]
                return a
            some, named = tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}
            if g == self.plain:
                out = self.func(*_whole(some), **_whole(named))
            else:
                out = self.dispatch(self.func, some, named)
            if isinstance(out, (list, tuple)) and len(out) == len(indices):
                returned = True
                for k, o in zip(indices, out):
                    results[k] = o
        return results if returned else None


def _whole(a: Any) -> Any:
    """`a` with every DTensor in it as its whole value (a replicated one's piece, as is)."""
    if isinstance(a, DTensorBase):
        if all(p.is_replicate() for p in a._spec.placements):
            return a._local_tensor
        return a.full_tensor()  # type: ignore[attr-defined]
    if isinstance(a, (list, tuple)):
        return type(a)(_whole(x) for x in a)
    if isinstance(a, dict):
        return {k: _whole(v) for k, v in a.items()}
    return a


def empty_piece(meta: TensorMeta, device: Any) -> torch.Tensor:
    """What a rank outside a DTensor's mesh holds, as in torch: a 0-dim zero for a 0-dim
    tensor, else an empty 1-D tensor (no data of the global shape is ever allocated there)."""
    if len(meta.shape) == 0:
        return torch.zeros((), dtype=meta.dtype, device=device)
    return torch.empty((0,), dtype=meta.dtype, device=device)


def _empty_outputs(spec: Any, device: Any) -> Any:
    if isinstance(spec, DTensorSpec):
        return wrap(empty_piece(spec.tensor_meta, device), spec)
    if isinstance(spec, (list, tuple)):
        return tuple(_empty_outputs(s, device) for s in spec)
    return None


@dataclass(frozen=True, slots=True)
class OutsidePlan:
    """An op on DTensors whose mesh does not hold this rank (torch's rule): nothing is computed
    or sent; each tensor output is an empty piece of the output's layout, any other output
    None, and an op that writes its arguments returns them as they are."""

    outputs: Any  # the output spec(s) propagation gives
    returns: Optional[tuple[Location, ...]]  # in-place / out=: return these inputs
    returns_nothing: bool
    answer: Any = None  # a non-tensor result where torch gives one (equal: True)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.answer is not None:
            return self.answer
        if self.returns is not None:
            if self.returns_nothing:
                return None
            returned = [_get(args, kwargs, loc) for loc in self.returns]
            return returned[0] if len(returned) == 1 else tuple(returned)
        device = next((a._local_tensor.device for a in list(args) + list(kwargs.values()) if isinstance(a, DTensorBase)),
                      torch.device("cpu"))
        return _empty_outputs(self.outputs, device)


_inference_on = torch.is_inference_mode_enabled


@dataclass(frozen=True, slots=True)
class ViewPlan:
    """A view op's plan. Under `inference_mode` a view of a normal (not inference) tensor must
    be a normal tensor too: torch's view tracking gives it the base's version counter, which an
    inference tensor cannot take. The wrapper of a DTensor's view is made inside the op, so it
    would be an inference tensor: `w.t()` on a parameter inside `torch.inference_mode()` would
    raise (it does with torch's DTensor). Such a view is made with inference mode off."""

    inner: Callable[[tuple[Any, ...], dict[str, Any]], Any]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _inference_on() and args and isinstance(args[0], torch.Tensor) and not args[0].is_inference():
            with torch.inference_mode(False):
                return self.inner(args, kwargs)
        return self.inner(args, kwargs)
