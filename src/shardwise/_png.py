"""The one PNG writer in shardwise: RGB pixel rows to PNG bytes, plus a 3x5 pixel font.

Pictures (parameter layouts, pipeline timelines) are small diagrams of coloured cells
with a few words on them. Encoding them by hand (signature, IHDR, one zlib IDAT, IEND)
and drawing text with a built-in font keeps plotting libraries out of the dependencies;
every picture in the codebase goes through this module so there is one encoder to trust.
"""

from __future__ import annotations

import struct
import zlib

__all__ = [
    "Colour", "Pixels", "FONT", "GLYPH_WIDTH", "GLYPH_HEIGHT", "GLYPH_ADVANCE", "canvas", "fill_rect",
    "draw_text", "text_width", "encode_png",
]

Colour = tuple[int, int, int]
Pixels = list[list[Colour]]

GLYPH_WIDTH, GLYPH_HEIGHT, GLYPH_ADVANCE = 3, 5, 4

FONT: dict[str, str] = {  # 3x5 glyphs, rows top to bottom, 3 bits each
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
    "-": "000000111000000", "/": "001001010100100",
}

_INK: Colour = (40, 40, 40)


def canvas(width: int, height: int, colour: Colour = (255, 255, 255)) -> Pixels:
    """A `height` x `width` image filled with one colour."""
    return [[colour] * width for _ in range(height)]


def fill_rect(pixels: Pixels, x: int, y: int, w: int, h: int, colour: Colour) -> None:
    """Paint the rectangle with top-left (x, y) and size w x h, clipped to the image."""
    for row in pixels[max(y, 0):max(y + h, 0)]:
        row[max(x, 0):max(x + w, 0)] = [colour] * len(row[max(x, 0):max(x + w, 0)])


def text_width(text: str) -> int:
    """Pixels the text takes when drawn (each glyph 3 wide, 1 pixel between glyphs)."""
    return max(0, len(text) * GLYPH_ADVANCE - 1)


def draw_text(pixels: Pixels, x: int, y: int, text: str, colour: Colour = _INK) -> None:
    """Write `text` with its top-left corner at (x, y); letters are drawn lower-case and
    characters the font lacks as blanks; pixels outside the image are dropped."""
    for ch in text:
        glyph = FONT.get(ch.lower(), FONT[" "])
        for k, bit in enumerate(glyph):
            py, px = y + k // GLYPH_WIDTH, x + k % GLYPH_WIDTH
            if bit == "1" and 0 <= py < len(pixels) and 0 <= px < len(pixels[0]):
                pixels[py][px] = colour
        x += GLYPH_ADVANCE


def encode_png(pixels: Pixels) -> bytes:
    """RGB rows -> PNG bytes (signature, IHDR, one zlib IDAT, IEND); 8-bit truecolour."""
    h, w = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
