"""A pipeline timeline: when each stage ran each micro-batch's forward and backward, drawn.

Bubbles, stragglers and a schedule that does not overlap are easiest to see on a
picture with one row per rank (or device) and time to the right. Runtimes record spans
into the active `Timeline` (entered as a context manager around a run; worker threads
see it too), and `from_schedule` draws a pure schedule's ticks the same way, so the
plan and the measured run can be put side by side. Times are `time.perf_counter()`
seconds, one clock for every process on a host, so timelines recorded by several
processes merge with `extend`.

>>> from shardwise.pipeline import ScheduleGPipe
>>> print(Timeline.from_schedule(ScheduleGPipe(2, 2)).render_text(width=18))
rank 0 |F0 F1 ......B0 B1 |
rank 1 |...F0 F1 B0 B1 ...|
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Union

from .._png import Colour, canvas, draw_text, encode_png, fill_rect, text_width
from ._schedule import KINDS, Schedule, _simulate

__all__ = ["TimelineEvent", "Timeline", "current_timeline"]

RankKey = Union[int, str]  # a rank, or a device name such as "cuda:1"


@dataclass(frozen=True)
class TimelineEvent:
    """Stage `stage` ran the forward ("F") or backward ("B"; or its halves, "I" the inputs'
    gradients and "W" the weights') of `microbatch` on `rank` (a rank or a device name) from
    `start` to `end` seconds."""

    rank: RankKey
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


_active: list[Timeline] = []
_active_lock = threading.Lock()


def current_timeline() -> Timeline | None:
    """The innermost timeline entered with `with`, from any thread; None outside one."""
    with _active_lock:
        return _active[-1] if _active else None


class Timeline:
    """Events of a run, recorded from any thread; `with Timeline() as tl:` makes it the
    one `current_timeline()` returns until the block ends."""

    # PNG geometry, in pixels (see `png_size`)
    MARGIN, LABEL_GAP, ROW_HEIGHT, ROW_GAP = 6, 6, 11, 3
    COLOURS: dict[str, Colour] = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (129, 201, 149), "W": (251, 188, 4)}
    IDLE: Colour = (235, 235, 235)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[TimelineEvent] = []

    def record(self, rank: RankKey, stage: int, microbatch: int, kind: str, start: float, end: float) -> None:
        """Add one event (thread-safe)."""
        if kind not in KINDS:
            raise ValueError(f"timeline event kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
        for name, t in (("start", start), ("end", end)):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t:
                raise TypeError(f"timeline event {name} must be a time in seconds (a number), got {t!r}")
        if end < start:
            raise ValueError(f"timeline event ends before it starts: start={start}, end={end}")
        with self._lock:
            self._events.append(TimelineEvent(rank, stage, microbatch, kind, start, end))

    @contextmanager
    def span(self, rank: RankKey, stage: int, microbatch: int, kind: str) -> Iterator[None]:
        """Record the time the block takes as one event."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(rank, stage, microbatch, kind, start, time.perf_counter())

    def extend(self, events: Iterable[TimelineEvent]) -> None:
        """Add events recorded elsewhere (another process of the same host, say)."""
        events = list(events)
        with self._lock:
            self._events.extend(events)

    @property
    def events(self) -> list[TimelineEvent]:
        """A copy of the events, by start time."""
        with self._lock:
            return sorted(self._events, key=lambda e: (e.start, _row_key(e.rank)))

    @classmethod
    def from_schedule(cls, schedule: Schedule, costed: bool = False) -> Timeline:
        """The schedule's ticks as a timeline: tick `k` is the span [k, k + 1). `costed`: each
        action lasts its cost instead (`_schedule.COST`: a backward two forwards), as
        `Schedule.bubble_fraction` prices it."""
        tl = cls()
        for a, start, end in _simulate(schedule, costed):
            tl.record(schedule.stage_rank(a.stage), a.stage, a.microbatch, a.kind, float(start), float(end))
        return tl

    def bubble_fraction(self) -> float:
        """The idle fraction of the rows' time from the first start to the last end: what a
        run's bubbles cost (0.0 with no events). Compare it with the schedule's
        `bubble_fraction()`, the same fraction on its cost model."""
        events = self.events
        if not events:
            return 0.0
        first, last = min(e.start for e in events), max(e.end for e in events)
        busy = 0.0
        for row in self.rows():  # each row's events, overlaps counted once
            reach = first
            for e in (e for e in events if e.rank == row):
                busy += max(0.0, e.end - max(e.start, reach))
                reach = max(reach, e.end)
        span = (last - first) * len(self.rows())
        return 1.0 - busy / span if span > 0 else 0.0

    def __enter__(self) -> Timeline:
        with _active_lock:
            _active.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        with _active_lock:
            _active.remove(self)

    # -- drawing ------------------------------------------------------------------------------

    def rows(self) -> list[RankKey]:
        """The ranks/devices drawn, one row each: ranks in order, then device names."""
        return sorted({e.rank for e in self.events}, key=_row_key)

    def render_text(self, width: int = 72) -> str:
        """One line per rank/device, time scaled to `width` characters: each event's cells
        start with its kind and micro-batch (``F3``, ``B10``; the kind alone where that does
        not fit), idle cells are ``.``."""
        _check_width(width, "character")
        events = self.events
        if not events:
            return ""
        t0, t1 = _extent(events)
        labels = {r: _label(r) for r in self.rows()}
        pad = max(len(s) for s in labels.values())
        lines = []
        for rank, label in labels.items():
            cells = ["."] * width
            for e in events:
                if e.rank != rank:
                    continue
                a, b = _scale(e.start, t0, t1, width), _scale(e.end, t0, t1, width)
                text = f"{e.kind}{e.microbatch}"
                text = text if len(text) <= max(b - a, 1) else e.kind  # never a cut number
                for c in range(a, max(b, a + 1) if a < width else a):
                    cells[c] = text[c - a] if c - a < len(text) else " "
            lines.append(f"{label:<{pad}} |{''.join(cells)}|")
        return "\n".join(lines)

    def png_size(self, width: int = 480) -> tuple[int, int]:
        """(width, height) in pixels of `png_bytes(width)`: the label column, `width`
        pixels of time, one row per rank/device."""
        _check_width(width, "pixel")
        n = len(self.rows())
        label_w = max((text_width(_label(r)) for r in self.rows()), default=0)
        return (2 * self.MARGIN + label_w + self.LABEL_GAP + width,
                2 * self.MARGIN + n * self.ROW_HEIGHT + max(n - 1, 0) * self.ROW_GAP)

    def png_bytes(self, width: int = 480) -> bytes:
        """The timeline as a PNG: forward spans blue, backward green, idle grey, each span
        labelled with its micro-batch number when it is wide enough."""
        _check_width(width, "pixel")
        events = self.events
        if not events:
            raise ValueError("the timeline has no events to draw: record some, or use Timeline.from_schedule")
        t0, t1 = _extent(events)
        img_w, img_h = self.png_size(width)
        pixels = canvas(img_w, img_h)
        x0 = img_w - self.MARGIN - width
        for row, rank in enumerate(self.rows()):
            y = self.MARGIN + row * (self.ROW_HEIGHT + self.ROW_GAP)
            draw_text(pixels, self.MARGIN, y + (self.ROW_HEIGHT - 5) // 2, _label(rank))
            fill_rect(pixels, x0, y, width, self.ROW_HEIGHT, self.IDLE)
            for e in events:
                if e.rank != rank:
                    continue
                a, b = _scale(e.start, t0, t1, width), _scale(e.end, t0, t1, width)
                b = max(b, a + 1)
                fill_rect(pixels, x0 + a, y, b - a - (1 if b - a > 2 else 0), self.ROW_HEIGHT, self.COLOURS[e.kind])
                digits = str(e.microbatch)
                if text_width(digits) + 2 <= b - a:
                    draw_text(pixels, x0 + a + 1, y + (self.ROW_HEIGHT - 5) // 2, digits, (255, 255, 255))
        return encode_png(pixels)

    def render_png(self, path: str | Path, width: int = 480) -> None:
        """Write `png_bytes(width)` to `path`."""
        Path(path).write_bytes(self.png_bytes(width))


_MAX_WIDTH = 1 << 16


def _check_width(width: object, unit: str) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= _MAX_WIDTH:
        raise ValueError(f"width must be an int of 1 to {_MAX_WIDTH} {unit}s, got {width!r}")


def _extent(events: list[TimelineEvent]) -> tuple[float, float]:
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    return t0, (t1 if t1 > t0 else t0 + 1.0)


def _scale(t: float, t0: float, t1: float, width: int) -> int:
    return min(width, max(0, round((t - t0) / (t1 - t0) * width)))


def _label(rank: RankKey) -> str:
    return f"rank {rank}" if isinstance(rank, int) else rank


def _row_key(rank: RankKey) -> tuple[int, int, tuple[tuple[int, str | int], ...]]:
    if isinstance(rank, int):
        return (0, rank, ())
    parts = tuple((1, int(p)) if p.isdigit() else (0, p) for p in re.split(r"(\d+)", rank) if p)
    return (1, 0, parts)
