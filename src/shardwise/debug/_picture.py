"""Pictures of how each parameter is laid out on the mesh: terminal text and a PNG.

Pure layout math (`local_shape_and_offset` per mesh coordinate) turned into a map: each
tensor is drawn as a small grid of cells, every cell marked with the rank(s) holding it.
One rank alone is its digit; several ranks (a replicated piece) share a letter listed in
the legend. The PNG colours cells by owner and writes each panel's name with the 3x5
pixel font of `shardwise._png` (the one PNG writer), so no plotting library is needed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .._layout import local_shape_and_offset
from .._placement import Placement
from .._png import canvas, draw_text, encode_png

__all__ = ["ParamLayout", "layout_text", "layout_png"]


@dataclass(frozen=True)
class ParamLayout:
    name: str
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] = ()


def _owners(p: ParamLayout, mesh_shape: Sequence[int], rows: int, cols: int) -> list[list[frozenset[int]]]:
    """Ranks holding each cell of a rows x cols map of the tensor (seen as 2-D: dim 0 by the
    rest; a 1-D tensor as one row)."""
    shape2 = (p.shape[0], max(1, _prod(p.shape[1:]))) if len(p.shape) >= 2 else (1, _prod(p.shape))
    grid: list[list[set[int]]] = [[set() for _ in range(cols)] for _ in range(rows)]
    for rank, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        local, offset = local_shape_and_offset(p.shape, tuple(mesh_shape), p.placements, coord, p.shard_order)
        if any(n == 0 for n in local):
            continue
        if len(p.shape) >= 2:  # only dim 1 of the rest is drawn split (dims past it are rarely split)
            inner = _prod(p.shape[2:])
            r0, r1 = offset[0], offset[0] + local[0]
            c0, c1 = offset[1] * inner, (offset[1] + local[1]) * inner
        else:
            r0, r1 = 0, 1
            c0, c1 = (offset[0], offset[0] + local[0]) if p.shape else (0, 1)
        for i in range(rows):
            row = (2 * i + 1) * shape2[0] / (2 * rows)  # the cell's centre, in tensor rows
            if not r0 <= row < r1:
                continue
            for j in range(cols):
                col = (2 * j + 1) * shape2[1] / (2 * cols)
                if c0 <= col < c1:
                    grid[i][j].add(rank)
    return [[frozenset(c) for c in row] for row in grid]


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _group(params: Sequence[ParamLayout]) -> list[tuple[str, ParamLayout]]:
    """One entry per layout pattern: blocks.0.x and blocks.1.x with the same layout -> blocks.*.x."""
    seen: dict[tuple[str, tuple[int, ...], tuple[Placement, ...]], ParamLayout] = {}
    for p in params:
        key = (re.sub(r"\.\d+\.", ".*.", p.name), p.shape, p.placements)
        seen.setdefault(key, p)
    return [(k[0], p) for k, p in seen.items()]


def layout_text(params: Sequence[ParamLayout], mesh_shape: Sequence[int], mesh_names: Sequence[str],
                width: int = 16) -> list[str]:
    """Terminal lines: per parameter pattern, its layout and a map of which rank holds what."""
    letters: dict[frozenset[int], str] = {}
    lines: list[str] = []
    for name, p in _group(params):
        rows = 1 if len(p.shape) < 2 else 4
        grid = _owners(p, mesh_shape, rows, width)
        layout = ", ".join(f"{n}: {pl}" for n, pl in zip(mesh_names, p.placements))
        for i, row in enumerate(grid):
            cells = "".join(_symbol(c, letters) for c in row)
            head = f"{name:<28} {str(tuple(p.shape)):<10} {layout:<18}" if i == 0 else " " * 58
            lines.append(f"{head} |{cells}|")
    legend = ", ".join(f"{s} = ranks {','.join(map(str, sorted(r)))}" for r, s in letters.items())
    lines.append(f"cells: a digit is the one rank holding that part; {legend or 'no part is shared'}")
    return lines


def _symbol(ranks: frozenset[int], letters: dict[frozenset[int], str]) -> str:
    if len(ranks) == 1:
        return str(next(iter(ranks)))
    if not ranks:
        return " "
    if ranks not in letters:
        letters[ranks] = "abcdefghijklmnopqrstuvwxyz"[len(letters) % 26]
    return letters[ranks]


# -- PNG ----------------------------------------------------------------------------------------

_COLOURS = [(66, 133, 244), (234, 67, 53), (251, 188, 5), (52, 168, 83), (171, 71, 188), (0, 172, 193),
            (255, 112, 67), (158, 157, 36)]


def layout_png(params: Sequence[ParamLayout], mesh_shape: Sequence[int], width: int = 48) -> bytes:
    """A PNG: one panel per parameter pattern, cells coloured by the rank holding them (a
    piece held by several ranks is striped in their colours), the name written above."""
    panels = _group(params)
    scale, label_h, gap = 4, 8, 6
    cell_rows = [1 if len(p.shape) < 2 else 12 for _, p in panels]
    img_w = width * scale + 2 * gap
    img_h = sum(label_h + r * scale + gap for r in cell_rows) + gap
    pixels = canvas(img_w, img_h)
    y = gap
    for (name, p), rows in zip(panels, cell_rows):
        draw_text(pixels, gap, y, f"{name} {tuple(p.shape)}".lower())
        y += label_h
        for i, row in enumerate(_owners(p, mesh_shape, rows, width)):
            for j, ranks in enumerate(row):
                owners = sorted(ranks)
                for dy in range(scale):
                    for dx in range(scale):
                        colour = _COLOURS[owners[(dx + dy) % len(owners)] % len(_COLOURS)] if owners else (230, 230, 230)
                        pixels[y + i * scale + dy][gap + j * scale + dx] = colour
        y += rows * scale + gap
    return encode_png(pixels)
