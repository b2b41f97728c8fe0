"""Timeline: recording from threads, the active timeline, text and PNG drawings, and the one
PNG writer in the codebase."""

from __future__ import annotations

import doctest
import struct
import threading
import zlib
from pathlib import Path

import pytest

import shardwise
from shardwise.pipeline import (Schedule, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble, Timeline,
                                TimelineEvent, current_timeline)
from shardwise.pipeline import _timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_png(data: bytes) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """Width, height and RGB rows of an 8-bit truecolour PNG with unfiltered rows (what
    shardwise writes); chunks are walked and their CRCs checked."""
    assert data[:8] == PNG_SIGNATURE
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = body
        pos += 12 + length
    width, height, depth, colour_type, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0
        rows.append([(line[1 + 3 * x], line[2 + 3 * x], line[3 + 3 * x]) for x in range(width)])
    return width, height, rows


# -- text --------------------------------------------------------------------------------------

def test_text_of_a_two_stage_two_microbatch_gpipe_schedule() -> None:
    tl = Timeline.from_schedule(ScheduleGPipe(2, 2))
    assert tl.render_text(width=18) == (
        "rank 0 |F0 F1 ......B0 B1 |\n"
        "rank 1 |...F0 F1 B0 B1 ...|"
    )
    assert tl.render_text(width=6) == (  # one character per tick: labels cut to the kind
        "rank 0 |FF..BB|\n"
        "rank 1 |.FFBB.|"
    )


def test_text_of_1f1b_with_two_digit_microbatches() -> None:
    tl = Timeline.from_schedule(Schedule1F1B(2, 11))
    assert tl.render_text(width=72) == (
        "rank 0 |F0 F1 ...B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 F8 B7 F9 B8 F10B9 ...B10|\n"
        "rank 1 |...F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8 F9 B9 F10B10...|"
    )
    # two characters per tick: "F10" does not fit and is drawn as its kind, never as "F1"
    assert tl.render_text(width=48) == (
        "rank 0 |F0F1..B0F2B1F3B2F4B3F5B4F6B5F7B6F8B7F9B8F B9..B |\n"
        "rank 1 |..F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7F8B8F9B9F B ..|"
    )


def test_from_schedule_has_one_unit_event_per_action() -> None:
    s = Schedule1F1B(3, 4)
    events = Timeline.from_schedule(s).events
    assert len(events) == 2 * 3 * 4
    ticks = s.ticks()
    for e in events:
        assert e.end - e.start == 1.0
        action = next(a for a in ticks[int(e.start)] if a.stage == e.stage)
        assert (action.kind, action.microbatch, s.stage_rank(action.stage)) == (e.kind, e.microbatch, e.rank)


def test_measured_times_are_scaled_to_the_width_and_devices_are_rows() -> None:
    tl = Timeline()
    tl.record("cuda:10", 1, 0, "F", 10.5, 11.0)
    tl.record("cuda:2", 0, 0, "F", 10.0, 10.5)
    tl.record("cuda:2", 0, 0, "B", 11.5, 12.0)
    tl.record("cuda:10", 1, 0, "B", 11.0, 11.5)
    assert tl.rows() == ["cuda:2", "cuda:10"]  # natural order, not "cuda:10" < "cuda:2"
    assert tl.render_text(width=8) == (
        "cuda:2  |F0....B0|\n"
        "cuda:10 |..F0B0..|"
    )


# -- recording ---------------------------------------------------------------------------------

def test_recording_from_many_threads_keeps_every_event() -> None:
    tl = Timeline()

    def work(rank: int) -> None:
        for i in range(300):
            with tl.span(rank, rank, i, "F"):
                pass

    threads = [threading.Thread(target=work, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = tl.events
    assert len(events) == 6 * 300
    assert sorted((e.rank, e.microbatch) for e in events) == [(r, i) for r in range(6) for i in range(300)]
    assert all(e.end >= e.start for e in events)
    assert [e.start for e in events] == sorted(e.start for e in events)


def test_the_active_timeline_is_visible_from_worker_threads() -> None:
    assert current_timeline() is None
    seen: list[Timeline | None] = []
    with Timeline() as outer:
        assert current_timeline() is outer
        with Timeline() as inner:
            worker = threading.Thread(target=lambda: seen.append(current_timeline()))
            worker.start()
            worker.join()
        assert current_timeline() is outer
    assert seen == [inner]
    assert current_timeline() is None


def test_the_active_timeline_is_left_when_the_run_raises() -> None:
    with pytest.raises(KeyError):
        with Timeline():
            raise KeyError("stage failed")
    assert current_timeline() is None


def test_extend_merges_events_recorded_elsewhere() -> None:
    a, b = Timeline(), Timeline()
    a.record(0, 0, 0, "F", 1.0, 2.0)
    b.record(1, 1, 0, "F", 2.0, 3.0)
    a.extend(b.events)
    assert a.events == [TimelineEvent(0, 0, 0, "F", 1.0, 2.0), TimelineEvent(1, 1, 0, "F", 2.0, 3.0)]


@pytest.mark.parametrize("schedule", [ScheduleGPipe(3, 4), Schedule1F1B(4, 8), ScheduleInterleaved1F1B(2, 2, 4),
                                      ScheduleInterleavedZeroBubble(4, 1, 8), ScheduleZBVZeroBubble(2, 4),
                                      ScheduleDualPipeV(2, 4), ScheduleLoopedBFS(2, 2, 3)], ids=repr)
def test_a_costed_timeline_of_a_schedule_measures_the_schedules_own_bubble(schedule: Schedule) -> None:
    costed = Timeline.from_schedule(schedule, costed=True)
    assert costed.bubble_fraction() == pytest.approx(schedule.bubble_fraction(), abs=1e-12)
    kinds = {e.kind for e in costed.events}
    assert kinds <= set("FBIW") and ("W" in kinds) == ("I" in kinds)


def test_a_measured_bubble_counts_each_rows_idle_time_once() -> None:
    tl = Timeline()
    for rank, stage, kind, start, end in [(0, 0, "F", 0.0, 1.0), (0, 0, "I", 1.0, 2.0), (0, 0, "W", 3.0, 4.0),
                                          (1, 1, "F", 1.0, 2.0), (1, 1, "F", 1.5, 2.5)]:  # (overlap counted once)
        tl.record(rank, stage, 0, kind, start, end)
    assert tl.bubble_fraction() == pytest.approx(1 - (3.0 + 1.5) / 8.0)
    assert Timeline().bubble_fraction() == 0.0


def test_recording_errors() -> None:
    tl = Timeline()
    with pytest.raises(ValueError, match="kind must be one of 'F', 'B', 'I', 'W', got 'X'"):
        tl.record(0, 0, 0, "X", 0.0, 1.0)
    with pytest.raises(ValueError, match="ends before it starts: start=2.0, end=1.0"):
        tl.record(0, 0, 0, "F", 2.0, 1.0)
    with pytest.raises(ValueError, match="no events to draw"):
        tl.png_bytes()
    assert tl.render_text() == ""


# -- PNG ---------------------------------------------------------------------------------------

def test_png_of_a_gpipe_schedule(tmp_path: Path) -> None:
    tl = Timeline.from_schedule(ScheduleGPipe(2, 2))
    data = tl.png_bytes(width=120)
    assert data[:8] == PNG_SIGNATURE
    width, height, rows = decode_png(data)
    # margins 6 + label "rank 0" (6 glyphs * 4 - 1 = 23) + gap 6 + 120; margins 6 + 2 rows of 11 + gap 3
    assert (width, height) == (161, 37) == tl.png_size(120)
    x0, tick = 161 - 6 - 120, 20  # 6 ticks over 120 pixels

    def cell(rank: int, t: int) -> tuple[int, int, int]:
        return rows[6 + rank * 14 + 1][x0 + t * tick + 10]

    blue, green, grey = Timeline.COLOURS["F"], Timeline.COLOURS["B"], Timeline.IDLE
    assert [cell(0, t) for t in range(6)] == [blue, blue, grey, grey, green, green]
    assert [cell(1, t) for t in range(6)] == [grey, blue, blue, green, green, grey]
    # the micro-batch digit "1" of F1 on rank 0 is drawn in white inside its cell
    digit = [rows[6 + 3 + dy][x0 + tick + 1 + dx] for dy in range(5) for dx in range(3)]
    assert "".join("1" if px == (255, 255, 255) else "0" for px in digit) == "010110010010111"

    path = tmp_path / "timeline.png"
    tl.render_png(path, width=120)
    assert path.read_bytes() == data


def test_png_size_follows_rows_and_width() -> None:
    tl = Timeline()
    tl.record("cuda:0", 0, 0, "F", 0.0, 1.0)
    tl.record("cuda:1", 1, 0, "F", 1.0, 2.0)
    tl.record("cuda:2", 2, 0, "F", 2.0, 3.0)
    width, height, _ = decode_png(tl.png_bytes(width=300))
    assert (width, height) == (6 + 23 + 6 + 300 + 6, 6 + 3 * 11 + 2 * 3 + 6)


def test_timeline_doctests_pass() -> None:
    result = doctest.testmod(_timeline)
    assert result.attempted > 0 and result.failed == 0


def test_one_png_writer_in_the_codebase() -> None:
    src = Path(shardwise.__file__).parent
    writers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                     if "\\x89PNG" in p.read_text() or 'b"IHDR"' in p.read_text())
    assert writers == ["_png.py"]
