"""Pictures of how each parameter is laid out on the mesh: terminal text and a PNG.

Pure layout math (`local_shape_and_offset` per mesh coordinate) turned into a map: each
tensor is drawn as a small grid of cells, every cell marked with the rank(s) holding it.
One rank alone is its digit; several ranks (a replicated piece) share a letter listed in
the legend. The PNG colours cells by owner and writes each panel's name with a built-in
3x5 pixel font, so no plotting library is needed.
"""

from __future__ import annotations

import itertools
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from .._layout import local_shape_and_offset
from .._placement import Placement

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
_FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "a": "010101111101101", "b": "110101110101110", "c": "011100100100011", "d": "110101101101110",
    "e": "111100110100111", "f": "111100110100100", "g": "011100101101011", "h": "101101111101101",
    "i": "111010010010111", "j": "001001001101010", "k": "101101110101101", "l": "100100100100111",
    "m": "101111111101101", "n": "110101101101101", "o": "010101101101010", "p": "110101110100100",
    "q": "010101101110011", "r": "110101110101101", "s": "011100010001110", "t": "111010010010010",
    "u": "101101101101111", "v": "101101101101010", "w": "101101111111101", "x": "101101010101101",
    "y": "101101010010010", "z": "111001010100111", "0": "111101101101111", "1": "010110010010111",
    "2": "110001010100111", "3": "110001010001110", "4": "101101111001001", "5": "111100110001110",
    "6": "011100111101111", "7": "111001010010010", "8": "111101111101111", "9": "111101111001110",
    ".": "000000000000010", "*": "000101010101000", "_": "000000000000111", "(": "010100100100010",
    ")": "010001001001010", ",": "000000000010100", " ": "000000000000000", ":": "000010000010000",
}


def layout_png(params: Sequence[ParamLayout], mesh_shape: Sequence[int], width: int = 48) -> bytes:
    """A PNG: one panel per parameter pattern, cells coloured by the rank holding them (a
    piece held by several ranks is striped in their colours), the name written above."""
    panels = _group(params)
    scale, label_h, gap = 4, 8, 6
    cell_rows = [1 if len(p.shape) < 2 else 12 for _, p in panels]
    img_w = width * scale + 2 * gap
    img_h = sum(label_h + r * scale + gap for r in cell_rows) + gap
    pixels = [[(255, 255, 255)] * img_w for _ in range(img_h)]
    y = gap
    for (name, p), rows in zip(panels, cell_rows):
        _text(pixels, gap, y, f"{name} {tuple(p.shape)}".lower())
        y += label_h
        for i, row in enumerate(_owners(p, mesh_shape, rows, width)):
            for j, ranks in enumerate(row):
                owners = sorted(ranks)
                for dy in range(scale):
                    for dx in range(scale):
                        colour = _COLOURS[owners[(dx + dy) % len(owners)] % len(_COLOURS)] if owners else (230, 230, 230)
                        pixels[y + i * scale + dy][gap + j * scale + dx] = colour
        y += rows * scale + gap
    return _encode(pixels)


def _text(pixels: list[list[tuple[int, int, int]]], x: int, y: int, text: str) -> None:
    for ch in text:
        glyph = _FONT.get(ch, _FONT[" "])
        for k, bit in enumerate(glyph):
            if bit == "1" and y + k // 3 < len(pixels) and x + k % 3 < len(pixels[0]):
                pixels[y + k // 3][x + k % 3] = (40, 40, 40)
        x += 4


def _encode(pixels: list[list[tuple[int, int, int]]]) -> bytes:
    """RGB rows -> PNG bytes (signature, IHDR, one zlib IDAT, IEND)."""
    h, w = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
