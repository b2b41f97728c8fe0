"""Writes into a view that had to move reach the DTensor it was taken from.

A view of a plain tensor shares its memory, so `buf[:, 16:32] = g` (a `slice`, then `copy_`
into it) writes `buf`. A DTensor's view shares memory only when its piece is a view of the
base's piece. When the view needed a move first (`buf` split on dim 1, sliced on dim 1: the
slice is taken of a gathered copy), its piece belongs to that copy, and a write into it was
lost without a word (torch's DTensor loses it too). This module links such a view to its
base and, after each op that writes it, writes the view's value back into the base:

| view op | written back as |
|---|---|
| `slice`, `split`, `split_with_sizes`, `narrow` (a slice) | `slice_scatter` |
| `select`, `unbind` | `select_scatter` |
| `diagonal` | `diagonal_scatter` |
| `view`, `unsqueeze`, `squeeze`, `alias`, `transpose`, `t`, `permute` | the inverse view, copied |

Any other moved view (`as_strided`, `expand`, `unfold`, ...) is linked too, and a write into
it raises a `ValueError` naming the op and what to do instead: never silently lost. A view
of a linked view (no move: the pieces share memory) carries the link on, so a chain of
views (`buf[:, 16:32][0] = g`) writes through every level.

A view made without a move and of an unlinked base (nearly every view: `w.t()` in a linear)
costs one dict lookup; an op that writes costs one truthiness test while no linked view is
alive. Links are kept by the view's `id` and dropped when the view is freed, as torch's
`_base` lives exactly as long as its view.

A rank outside the base's mesh links nothing: it runs no op (`OutsidePlan`), so its views are
fresh empty pieces that only look moved, and a write there is a no-op with nothing to carry
back (`d.data.mul_(1.0)` outside `d`'s mesh raised the ValueError for `detach`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ._runtime import RUNTIME
from ._wrap import DTENSOR_CLASSES

__all__ = ["ViewLinkPlan", "WriteThroughPlan", "view_runner", "write_runner"]

aten = torch.ops.aten

# id(view) -> (base, how to write the view back into the base: None when the pieces share memory)
_LINKS: dict[int, tuple[Any, Optional[Callable[[Any, Any], Any]]]] = {}

# in-place ops that change only a tensor's shape or strides: nothing to write back
_METADATA_WRITES = frozenset({
    "aten::as_strided_", "aten::transpose_", "aten::t_", "aten::squeeze_", "aten::unsqueeze_", "aten::resize_",
    "aten::resize_as_", "aten::set_", "aten::detach_", "aten::swapdims_", "aten::swapaxes_", "aten::_coalesced_"})


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], k: int, name: str, default: Any) -> Any:
    return args[k] if len(args) > k else kwargs.get(name, default)


def _inverse_permutation(dims: list[int]) -> list[int]:
    n = len(dims)
    inverse = [0] * n
    for k, d in enumerate(dims):
        inverse[d % n] = k
    return inverse


def _scatters(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n_out: int) -> list[Optional[Callable[..., Any]]]:
    """For each output of the view op `func(*args, **kwargs)`: how its value goes back into
    `args[0]` (a function of (base, view) giving the base's new value), or None: no way back."""
    def a(k: int, name: str, default: Any = None) -> Any:
        return _arg(args, kwargs, k, name, default)

    if func is aten.slice.Tensor:
        dim, start, end, step = a(1, "dim", 0), a(2, "start"), a(3, "end"), a(4, "step", 1)
        return [lambda base, v: aten.slice_scatter(base, v, dim, start, end, step)]
    if func is aten.narrow.default:
        dim, start, length = a(1, "dim"), a(2, "start"), a(3, "length")
        return [lambda base, v: aten.slice_scatter(base, v, dim, start, start + length)]
    if func in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = a(2, "dim", 0)
        size = args[0].shape[dim]
        sizes = a(1, "split_size" if func is aten.split.Tensor else "split_sizes")
        if isinstance(sizes, int):
            sizes = [min(sizes, size - s) for s in range(0, size, sizes)] or [0]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [(lambda s, n: lambda base, v: aten.slice_scatter(base, v, dim, s, s + n))(s, n)
                for s, n in zip(starts, sizes)]
    if func is aten.select.int:
        dim, index = a(1, "dim"), a(2, "index")
        return [lambda base, v: aten.select_scatter(base, v, dim, index)]
    if func is aten.unbind.int:
        dim = a(1, "dim", 0)
        return [(lambda i: lambda base, v: aten.select_scatter(base, v, dim, i))(i) for i in range(n_out)]
    if func is aten.diagonal.default:
        offset, dim1, dim2 = a(1, "offset", 0), a(2, "dim1", 0), a(3, "dim2", 1)
        return [lambda base, v: aten.diagonal_scatter(base, v, offset, dim1, dim2)]
    if func in (aten.view.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.alias.default, aten._reshape_alias.default):
        return [lambda base, v: v.reshape(base.shape)]  # a view keeps the logical order of the elements
    if func in (aten.transpose.int, aten.t.default):
        d0, d1 = (0, 1) if func is aten.t.default else (a(1, "dim0"), a(2, "dim1"))
        return [lambda base, v: v.transpose(d0, d1)]
    if func is aten.permute.default:
        inverse = _inverse_permutation(list(a(1, "dims")))
        return [lambda base, v: v.permute(inverse)]
    return [None] * n_out


def _cannot(func: Any) -> Callable[[Any, Any], Any]:
    def refuse(base: Any, view: Any) -> Any:
        raise ValueError(
            f"an in-place write into the result of {func} on a DTensor laid out {base._spec.layout_str()}: that "
            f"view needed the DTensor moved first (its piece is a view of a moved copy), and shardwise writes such "
            f"views back only for slice, select, split, unbind, diagonal and reshaping views. Write the whole "
            f"tensor instead (an out-of-place op, then `copy_` into it), or redistribute it before taking the view")
    return refuse


def _link(view: Any, base: Any, back: Optional[Callable[[Any, Any], Any]]) -> None:
    key = id(view)
    if key not in _LINKS:
        weakref.finalize(view, _LINKS.pop, key, None)
    _LINKS[key] = (base, back)


def _outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclass(frozen=True, slots=True)
class ViewLinkPlan:
    """A view op's runner that links its outputs to the base: `moved` when the plan moves
    the base (its outputs' pieces are not views of the base's piece), else only when the
    base is itself linked (the link carries on)."""

    inner: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    func: Any
    moved: bool

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.inner(args, kwargs)
        self.link(args, kwargs, out)
        return out

    def link(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        base = args[0]
        if self.moved:
            outs = _outputs(out)
            for view, back in zip(outs, _scatters(self.func, args, kwargs, len(outs))):
                if view.__class__ in DTENSOR_CLASSES:
                    _link(view, base, back or _cannot(self.func))
        elif _LINKS and id(base) in _LINKS:
            for view in _outputs(out):  # (a view a decomposition's own view op linked keeps that link)
                if view.__class__ in DTENSOR_CLASSES and id(view) not in _LINKS:
                    _link(view, base, None)


@dataclass(frozen=True, slots=True)
class WriteThroughPlan:
    """The runner of an op that writes DTensor arguments: after it runs, each written one
    that is a linked view is written back into its base."""

    inner: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    written: tuple[Union[int, str], ...]

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.inner(args, kwargs)
        if _LINKS:
            for where in self.written:
                value = args[where] if isinstance(where, int) else kwargs.get(where)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if id(t) in _LINKS:
                        write_back(t)
        return out


def write_back(view: Any) -> None:
    """Write `view`'s value into the DTensor it was taken from, and on up its chain of links."""
    link = _LINKS.get(id(view))
    while link is not None:
        base, back = link
        if back is not None:
            with torch.no_grad():
                base.copy_(back(base, view))  # itself a write: carries on up from `base`
            return
        view, link = base, _LINKS.get(id(base))  # the pieces share memory: look one level up


def view_runner(run: Callable[..., Any], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                out: Any, moved: bool) -> Callable[..., Any]:
    """The runner of a view op's plan, given its first result `out` and whether the plan moves
    the base (read off the plan, so every rank of the mesh decides alike; a rank's own pieces
    could not tell: an empty piece is fresh on some ranks and a view on others): linking when
    it does, else one that only carries existing links."""
    base: Any = args[0] if args else None
    if base.__class__ not in DTENSOR_CLASSES or RUNTIME.coordinate(base._spec.mesh) is None:
        return run  # outside its mesh a rank computes nothing: its empty pieces are fresh, never moved
    plan = ViewLinkPlan(run, func, moved)
    plan.link(args, kwargs, out)
    return plan.run


def write_runner(run: Callable[..., Any], func: Any, written: set[Union[int, str]]) -> Callable[..., Any]:
    """The runner of an op that writes `written` arguments: carrying writes into linked views
    back to their bases, unless the op changes only metadata."""
    if not written or func._schema.name in _METADATA_WRITES:
        return run
    return WriteThroughPlan(run, tuple(sorted(written, key=str))).run
