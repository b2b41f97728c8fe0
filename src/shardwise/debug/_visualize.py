"""Pictures of layouts: `visualize_sharding` for one tensor, `layout_table` for a model.

Both are pure layout math (`local_shape_and_offset` at every mesh coordinate), so they work
for any mesh rank and any tensor rank, on a real mesh or an abstract one, with no process
talking. A tensor of 1 or 2 dims is drawn as a grid of its pieces, each cell listing the
ranks that hold it; a tensor of more dims is listed piece by piece (its slice per tensor
dim and the ranks holding it). Pending sums (`Partial`) and ranks holding nothing are said
underneath. `png=` also writes the picture as a PNG (cells coloured by rank).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .._layout import format_placements, local_shape_and_offset, normalize_placements, normalize_shard_order
from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Partial, Placement
from .._spec import DTensorSpec
from .._tensor import DTENSOR_CLASSES
from ._picture import ParamLayout, layout_png, layout_text

__all__ = ["layout_table", "visualize_sharding"]

Box = tuple[tuple[int, int], ...]  # (start, stop) per tensor dim


def _spec_of(x: Any, mesh: Any, placements: Any, shard_order: Any) -> tuple[tuple[int, ...], AbstractMesh, tuple[Placement, ...], Any]:
    if type(x) in DTENSOR_CLASSES:
        x = x._spec
    if isinstance(x, DTensorSpec):
        if mesh is not None or placements is not None:
            raise ValueError("visualize_sharding got a DTensor (or its spec) and mesh=/placements=: the layout is the "
                             "tensor's own; pass a shape to draw another layout")
        return tuple(x.shape), x.mesh, tuple(x.placements), x.shard_order
    if isinstance(x, (tuple, list, torch.Size)) and all(isinstance(s, int) and not isinstance(s, bool) for s in x):
        if not isinstance(mesh, AbstractMesh) or placements is None:
            raise TypeError(f"visualize_sharding({tuple(x)}) draws a shape on a mesh: pass mesh= (a DeviceMesh or an "
                            f"AbstractMesh) and placements=, e.g. mesh=AbstractMesh((2, 2)), placements=[Shard(0), "
                            f"Replicate()]")
        shape = tuple(int(s) for s in x)
        pl = tuple(normalize_placements(placements, mesh.ndim, len(shape)))
        return shape, mesh, pl, normalize_shard_order(pl, shard_order, len(shape))
    raise TypeError(f"visualize_sharding draws a DTensor, its spec, or a shape with mesh= and placements=; got "
                    f"{type(x).__name__}")


def _pieces(shape: tuple[int, ...], mesh: AbstractMesh, placements: tuple[Placement, ...], order: Any
            ) -> tuple[dict[Box, list[int]], list[int]]:
    """Each distinct piece (its box) -> the ranks holding it; and the ranks holding nothing."""
    ranks = mesh.mesh.flatten().tolist() if isinstance(mesh, DeviceMesh) else list(range(mesh.size()))
    boxes: dict[Box, list[int]] = {}
    empty = []
    for rank, coord in zip(ranks, itertools.product(*(range(n) for n in mesh.shape))):
        local, offset = local_shape_and_offset(shape, mesh.shape, placements, coord, order)
        if any(n == 0 for n in local):
            empty.append(rank)
            continue
        boxes.setdefault(tuple((o, o + n) for o, n in zip(offset, local)), []).append(rank)
    return boxes, empty


def _ranks(ranks: Sequence[int]) -> str:
    """`0,1,2,3,8` as `0-3,8`."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def _grid(shape: tuple[int, ...], boxes: dict[Box, list[int]]) -> list[str]:
    """A 1-D or 2-D tensor as a table: a row per cut of dim 0, a column per cut of the last dim."""
    if len(shape) == 1:
        shape, boxes = (1,) + shape, {((0, 1),) + b: r for b, r in boxes.items()}
    cuts = [sorted({e for b in boxes for e in b[d]} | {0, shape[d]}) for d in (0, 1)]
    rows, cols = list(zip(cuts[0], cuts[0][1:])), list(zip(cuts[1], cuts[1][1:]))
    cells = [[_ranks(next((r for b, r in boxes.items() if b[0][0] <= lo < b[0][1] and b[1][0] <= c0 < b[1][1]), []))
              for c0, _ in cols] for lo, _ in rows]
    col_heads = [f"{a}:{b}" for a, b in cols]
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(col_heads)]
    row_heads = [f"{a}:{b}" for a, b in rows] if shape[0] > 1 or len(rows) > 1 else [""]
    left = max(len(h) for h in row_heads)
    rule = " " * left + " +" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [" " * left + "  " + " ".join(f" {h:^{w}} " for h, w in zip(col_heads, widths)), rule]
    for head, row in zip(row_heads, cells):
        lines.append(f"{head:>{left}} |" + "|".join(f" {c:^{w}} " for c, w in zip(row, widths)) + "|")
        lines.append(rule)
    return lines


def _listing(boxes: dict[Box, list[int]]) -> list[str]:
    out = []
    for box, ranks in sorted(boxes.items()):
        where = ", ".join(f"{a}:{b}" for a, b in box)
        out.append(f"  [{where}]  ranks {_ranks(ranks)}")
    return out


def visualize_sharding(tensor_or_shape: Union[Any, Sequence[int]], *, mesh: Optional[AbstractMesh] = None,
                       placements: Optional[Sequence[Placement]] = None, shard_order: Any = None, header: str = "",
                       png: Union[str, Path, None] = None, print_out: bool = True) -> str:
    """Draw which rank holds which piece of a tensor: a DTensor, its spec, or a shape with
    `mesh=` (any DeviceMesh or AbstractMesh) and `placements=`. Prints the picture (unless
    `print_out=False`) and returns it; with `png=path`, also writes it as a PNG."""
    shape, the_mesh, pl, order = _spec_of(tensor_or_shape, mesh, placements, shard_order)
    boxes, empty = _pieces(shape, the_mesh, pl, order)
    names = the_mesh.mesh_dim_names or tuple(str(i) for i in range(the_mesh.ndim))
    title = f"{header + ': ' if header else ''}shape {shape} on mesh {the_mesh.shape} {names}, {format_placements(pl)}"
    lines = [title]
    if len(shape) == 0:
        lines.append(f"  a scalar, held by ranks {_ranks(sorted(r for rs in boxes.values() for r in rs))}")
    elif len(shape) <= 2:
        lines += _grid(shape, boxes)
    else:
        lines += _listing(boxes)
    pending = [f"{type(p).__name__}({getattr(p, 'reduce_op', 'sum')}) over {names[m]}" for m, p in enumerate(pl)
               if isinstance(p, Partial)]
    if pending:
        lines.append("pending: " + "; ".join(pending) + ": each rank holds a term, the value is their reduction")
    if empty:
        lines.append(f"ranks {_ranks(empty)} hold empty pieces (uneven split)")
    text = "\n".join(lines)
    if png is not None:
        Path(png).write_bytes(layout_png([ParamLayout(header or "tensor", shape, pl, _order_items(order))],
                                         the_mesh.shape))
    if print_out:
        print(text)
    return text


def _order_items(order: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    if not order:
        return ()
    items = order.items() if hasattr(order, "items") else order
    return tuple((int(d), tuple(ms)) for d, ms in items)


def layout_table(model: nn.Module, *, png: Union[str, Path, None] = None, width: int = 16) -> str:
    """A table of every DTensor parameter of `model`: its name (layers with the same layout
    folded into `blocks.*`), global shape, placement per mesh dim and a map of which rank
    holds what (a digit: one rank; a letter: the ranks of the legend). With `png=path`,
    also a PNG of the maps. Parameters that are not DTensors are counted at the end."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"layout_table takes an nn.Module, got {type(model).__name__}")
    layouts, plain, mesh = [], [], None
    for name, p in model.named_parameters():
        if type(p) in DTENSOR_CLASSES:
            spec = p._spec  # type: ignore[attr-defined]
            if mesh is None:
                mesh = spec.mesh
            if spec.mesh == mesh:
                layouts.append(ParamLayout(name, tuple(spec.shape), tuple(spec.placements), _order_items(spec.shard_order)))
                continue
        plain.append(name)
    if mesh is None:
        return f"{type(model).__name__} has no DTensor parameters ({len(plain)} plain)"
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    lines = [f"{type(model).__name__} on mesh {mesh.shape} {names}"] + layout_text(layouts, mesh.shape, names, width)
    if plain:
        lines.append(f"not on this mesh ({len(plain)}): {', '.join(plain[:6])}{' ...' if len(plain) > 6 else ''}")
    if png is not None:
        Path(png).write_bytes(layout_png(layouts, mesh.shape))
    return "\n".join(lines)
