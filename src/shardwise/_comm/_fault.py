"""When a collective fails: which operation, and which ranks did not arrive, died or disagreed.

A backend error says little ("Connection closed by peer [127.0.0.1]:PORT", "Timed out
waiting 30000ms"). Every collective through the door has a number on its group (the
ranks issue the same collectives in the same order, so the same number), and every
process notes its host and pid in the process group's store once. When a collective
fails, the rank writes "I reached #n on this group and it failed" to the store, then
watches the store for up to `GRACE` seconds for the other ranks of the group:

| another rank of the group | is reported as |
|---|---|
| wrote the same #n | arrived, and failed too |
| wrote another failure (another collective, or #m on this group) | failing elsewhere: named, so both sides show |
| wrote nothing; its process is gone (same host: no pid, or a zombie) | died |
| wrote nothing; its process lives (or lives on another host) | did not arrive: stalled, or busy elsewhere |

The store traffic happens on failure only; a success costs a counter per collective. The
outer layers (full_tensor, an op's input move, a redistribute, a checkpoint step, a
data-parallel bucket) add what they were doing to the error on its way up, so the message
reads from the user's call down to the collective. If the store itself cannot be reached
(its host died), the error says so and names what it can.

The store must outlive the readers. When a rank hosts it (rank 0 under a plain
`init_process_group`), that rank is often the first to fail and its program exits as soon
as its error goes uncaught, taking the records with it. So each rank, when it has read what
it needs, writes that it is done, and the host (only the host) waits before raising until
every other rank is done, gone or known to be stalled, at most a collective timeout + 2 GRACE
+ 1 s after its own failure (`_store_host`): a peer blocked when the host failed has failed
and read by then; a stalled one never reads, so the host does not wait for it.

Ranks that issue collectives of different sizes make gloo abort the process; with
`SHARDWISE_CHECK=1`, every collective is preceded by an all_gather of a fixed-size
descriptor (its number, kind, sizes, dtype), so a disagreement or a skipped collective is
a `CollectiveError` naming both sides before the real collective starts. It costs one
small extra collective (a latency, ~50-100 us on gloo over loopback) per collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .._process import PROCESS, collective_timeout, note_process
from ._store_host import say_done, stay_for_readers

__all__ = ["GRACE", "CollectiveError", "checking", "diagnose", "group_ranks", "next_number", "note_process",
           "verify_agreement"]

GRACE = 2.0  # seconds a failing rank watches for the others' reports
_PREFIX = "shardwise/fault"
_NUMBERS: dict[Any, int] = {}  # collectives issued on each group (keyed by the group object)
_RANKS: dict[Any, tuple[int, ...]] = {}
_DIAGNOSED: set[str] = set()  # groups whose failure this process has diagnosed


class CollectiveError(RuntimeError):
    """A collective (or point-to-point message) that failed or timed out on this rank.

    `operation`: what was being done, outermost first (e.g. ["full_tensor", "redistribute
    (S(0),) -> (R,) on mesh (4,)", "all_gather of [2, 3] float32 over mesh dim 0"]); `rank`:
    this rank; `died`, `missing` (did not arrive, alive), `arrived` (failed alongside) and
    `elsewhere` (rank -> what it was failing in instead): the other ranks of the group;
    `cause`: the backend's error."""

    def __init__(self, operation: Sequence[str], rank: int, *, ranks: Sequence[int] = (), died: Sequence[int] = (),
                 missing: Sequence[int] = (), arrived: Sequence[int] = (), elsewhere: Optional[dict[int, str]] = None,
                 cause: str = "", reason: str = "", outside: str = "", found: Optional[dict[int, str]] = None) -> None:
        self.operation = list(operation)
        self.rank = rank
        self.ranks, self.died, self.missing, self.arrived = list(ranks), list(died), list(missing), list(arrived)
        self.elsewhere = dict(elsewhere or {})
        self.cause = cause
        self._reason = reason
        self.outside = outside
        self.found = dict(found or {})  # rank -> what that rank (failing elsewhere) found
        PROCESS.collective_failed = True
        super().__init__(self._render())

    @property
    def faulty(self) -> list[int]:
        """The ranks to look at: died, did not arrive, or were elsewhere."""
        return sorted(set(self.died) | set(self.missing) | set(self.elsewhere))

    @property
    def reason(self) -> str:
        """The diagnosis without the operation."""
        return self._reason or self._diagnosis()

    def add_operation(self, what: str) -> CollectiveError:
        """Put `what` (an outer operation) before the others in the message; returns self."""
        self.operation.insert(0, what)
        self.args = (self._render(),)
        return self

    def _diagnosis(self) -> str:
        parts = []
        if self.died:
            parts.append(f"{_ranks(self.died)} died (process gone)")
        if self.missing:
            parts.append(f"{_ranks(self.missing)} did not arrive (alive: stalled, or waiting in another collective)")
        for r, what in sorted(self.elsewhere.items()):
            there = f", where it found: {self.found[r]}" if r in self.found else ""
            parts.append(f"rank {r} was in {what} instead{there}")
        if self.arrived:
            parts.append(f"{_ranks(self.arrived)} arrived and failed too")
        if self.outside:
            parts.append(self.outside)
        if not parts:
            parts.append("no other rank of the group could be checked")
        return "; ".join(parts) + (f" (cause: {self.cause})" if self.cause else "")

    def _render(self) -> str:
        return f"rank {self.rank}: {' > '.join(self.operation)} failed: {self.reason}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of `group` (cached)."""
    found = _RANKS.get(group)
    if found is None:
        try:
            found = tuple(dist.get_process_group_ranks(group))
        except Exception:
            found = ()
        _RANKS[group] = found
    return found


def next_number(group: Any) -> int:
    """The number of the collective about to be issued on `group` (1, 2, ...), counted here."""
    n = _NUMBERS.get(group, 0) + 1
    _NUMBERS[group] = n
    return n


def _group_key(ranks: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]


def _gone(store: Any, rank: int) -> Optional[bool]:
    """Whether `rank`'s process has exited (None: cannot tell, e.g. it runs on another host)."""
    key = f"{_PREFIX}/pid/{rank}"
    try:  # check first: a get of a missing key waits for the store's whole timeout
        if not store.check([key]):
            return None
        host, pid = store.get(key).decode().split()
    except Exception:
        return None
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return None
    return False


def diagnose(operation: Sequence[str], ranks: Sequence[int], number: Optional[int], cause: BaseException,
             grace: float = GRACE, kind: type[CollectiveError] = CollectiveError) -> CollectiveError:
    """The error for a failure of collective `number` on the group of global `ranks` (None:
    a point-to-point message, whose group is `ranks`), after watching the store for the
    others' reports."""
    rank = dist.get_rank()
    started = time.monotonic()
    text = _cause(cause)
    store = _store()
    others = [r for r in ranks if r != rank]
    if store is None or not others:
        return kind(operation, rank, ranks=ranks, cause=text)
    key = _group_key(ranks)
    if key in _DIAGNOSED:
        grace = 0.0  # this group failed here before: one look at the store, no second wait
    _DIAGNOSED.add(key)
    mine = json.dumps({"group": key, "number": number, "what": " > ".join(operation)})
    try:
        store.set(f"{_PREFIX}/report/{rank}", mine)
        if number is not None:
            store.set(f"{_PREFIX}/at/{key}/{number}/{rank}", "1")
    except Exception as exc:
        return kind(operation, rank, ranks=ranks, cause=f"{text}; the process group's store is "
                               f"unreachable too ({exc}), so its host (often rank 0) has probably died")
    arrived: set[int] = set()
    died: set[int] = set()
    elsewhere: dict[int, str] = {}
    deadline = time.monotonic() + grace
    while True:
        for r in others:
            if r in arrived or r in died or r in elsewhere:
                continue
            try:
                if number is not None and store.check([f"{_PREFIX}/at/{key}/{number}/{r}"]):
                    arrived.add(r)
                elif store.check([f"{_PREFIX}/report/{r}"]):
                    report = json.loads(store.get(f"{_PREFIX}/report/{r}"))
                    if report.get("group") == key and report.get("number") == number and number is None:
                        arrived.add(r)  # failing in the same exchange of messages
                    elif report.get("group") != key or report.get("number") != number:
                        where = report.get("what", "another collective")
                        if report.get("group") == key and report.get("number") is not None and number is not None:
                            where += f" (collective #{report['number']} of this group, this rank was at #{number})"
                        elsewhere[r] = where
                elif _gone(store, r):
                    died.add(r)
            except Exception:
                continue
        if len(arrived) + len(died) + len(elsewhere) == len(others) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    found: dict[int, str] = {}
    for r in list(elsewhere):  # a rank failing elsewhere may have found who it waited for: follow it
        blame = _blame(store, r, time.monotonic() + grace + 1.0)
        if blame:
            found[r] = blame
    missing = [r for r in others if r not in arrived and r not in died and r not in elsewhere]
    outside = ""
    if not (missing or died or elsewhere):  # the group is blameless: it waited on someone outside it
        outside = _outside(store, set(ranks))
    error = kind(operation, rank, ranks=ranks, died=sorted(died), missing=missing, arrived=sorted(arrived),
                 elsewhere=elsewhere, cause=text, outside=outside, found=found)
    # stalled, not late: they did not arrive within a whole collective timeout (after a peer's
    # death the others fail at once, and a rank still on its way is merely late)
    stalled = error.missing if _timed_out(cause) else []
    _post_blame(store, rank, error, stalled)
    _finish_reading(store, rank, started, error, stalled)
    return error


def _timed_out(cause: BaseException) -> bool:
    text = str(cause).lower()
    return "timed out" in text or "timeout" in text


def _finish_reading(store: Any, rank: int, started: float, error: CollectiveError,
                    stalled: Sequence[int] = ()) -> None:
    """Say this rank is done with the store; if it hosts the store, wait for the others to be
    done too (bounded; see `_store_host`) but for the `stalled` ones, and say so in the error
    if some were not."""
    say_done(store, rank)
    until = started + collective_timeout().total_seconds() + 2 * GRACE + 1.0
    pending = stay_for_readers(store, rank, until, lambda ranks: _still_reading(store, ranks, stalled))
    if pending:
        error.add_note(f"rank {rank} hosts the process group's store: before raising, it waited "
                       f"{time.monotonic() - started:.0f} s for {_ranks(pending)} to read their own diagnosis from it, "
                       f"in vain (stalled, busy, or not failing)")


def _still_reading(store: Any, ranks: list[int], stalled: Sequence[int]) -> list[int]:
    """Of `ranks` (not done reading yet), those the store's host still waits for: alive, and
    failing too or not known to be stalled. Known stalled: found alive but not arriving within
    a collective timeout by this rank's diagnosis (`stalled`) or by one another rank posted,
    and no failure reported."""
    known = set(stalled)
    try:
        world = dist.get_world_size()
        for q in range(world):
            key = f"{_PREFIX}/stalled/{q}"
            if store.check([key]):
                known.update(json.loads(store.get(key)))
    except Exception:
        pass
    waiting = []
    for r in ranks:
        if _gone(store, r):
            continue
        try:
            failing = bool(store.check([f"{_PREFIX}/report/{r}"]))
        except Exception:
            failing = False
        if failing or r not in known:
            waiting.append(r)
    return waiting


def _post_blame(store: Any, rank: int, error: CollectiveError, stalled: Sequence[int]) -> None:
    """Tell the others what this rank found (for ranks whose own peers were waiting on this one),
    and the store's host which ranks it found `stalled`."""
    found = []
    if error.died:
        found.append(f"{_ranks(error.died)} died")
    if error.missing:
        found.append(f"{_ranks(error.missing)} did not arrive")
    for r, what in error.elsewhere.items():
        found.append(f"rank {r} was in {what} instead")
    if error.outside:
        found.append(error.outside)
    try:
        store.set(f"{_PREFIX}/blame/{rank}", "; ".join(found) or "nothing")
        if stalled:
            store.set(f"{_PREFIX}/stalled/{rank}", json.dumps(sorted(stalled)))
    except Exception:
        pass


def _blame(store: Any, rank: int, deadline: float) -> str:
    """What `rank` found when it failed (waits for it until `deadline`); '' if nothing."""
    key = f"{_PREFIX}/blame/{rank}"
    while True:
        try:
            if store.check([key]):
                found = store.get(key).decode()
                return "" if found == "nothing" else found
        except Exception:
            return ""
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.05)


def _outside(store: Any, group: set[int]) -> str:
    """What the ranks outside `group` look like: those that died, and those that reported no failure."""
    try:
        world = dist.get_world_size()
    except Exception:
        return ""
    dead: list[int] = []
    silent: list[int] = []
    for r in range(world):
        if r in group:
            continue
        try:
            if store.check([f"{_PREFIX}/report/{r}"]):
                continue
        except Exception:
            return ""
        (dead if _gone(store, r) else silent).append(r)
    parts = []
    if dead:
        parts.append(f"{_ranks(dead)} died (process gone)")
    if silent:
        parts.append(f"{_ranks(silent)} did not arrive (alive: stalled, or waiting in another collective) and "
                     f"reported no failure")
    return f"every rank of this group arrived; outside it, {'; '.join(parts)}" if parts else ""


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"nothing completed within the collective timeout ({collective_timeout().total_seconds():g} s, "
                f"SHARDWISE_COLLECTIVE_TIMEOUT): {text}")
    return text.split(" This is typically")[0]


def checking() -> bool:
    """Whether every collective is checked across ranks first (env `SHARDWISE_CHECK=1`)."""
    return os.environ.get("SHARDWISE_CHECK", "") not in ("", "0")


def verify_agreement(operation: Sequence[str], group: Any, size: int, number: int, signature: Sequence[int],
                     timeout: Optional[timedelta] = None) -> None:
    """SHARDWISE_CHECK: gather every rank's (number, signature) over `group` (a fixed size, so
    it cannot itself disagree) and raise a `CollectiveError` naming both sides if they differ."""
    row = torch.tensor([number, *signature][:8] + [0] * (8 - min(8, len(signature) + 1)), dtype=torch.int64)
    out = torch.empty(size * 8, dtype=torch.int64)
    work = dist.all_gather_into_tensor(out, row, group=group, async_op=True)
    ranks = group_ranks(group)
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as exc:
        raise diagnose(list(operation) + ["the SHARDWISE_CHECK agreement"], ranks, number, exc) from exc
    rows = out.view(size, 8).tolist()
    if all(r == rows[0] for r in rows):
        return
    store, rank = _store(), dist.get_rank()
    started = time.monotonic()
    key = _group_key(ranks)
    mine = " > ".join(operation)
    by_row: dict[tuple[int, ...], list[int]] = {}
    for r, row_r in zip(ranks, rows):
        by_row.setdefault(tuple(row_r), []).append(r)
    sides: dict[str, list[int]] = {}
    try:  # every rank saw the difference: each writes what it is issuing, then reads one of each side's
        store.set(f"{_PREFIX}/check/{key}/{number}/{rank}", mine)
        for row_r, rs in by_row.items():
            if rank in rs:
                what = mine
            else:
                at = f"{_PREFIX}/check/{key}/{row_r[0]}/{rs[0]}"
                store.wait([at], timedelta(seconds=GRACE))
                what = store.get(at).decode()
            sides[f"#{row_r[0]} {what} {_signature(row_r[1:])}"] = rs
    except Exception:
        sides = {f"#{row_r[0]} {_signature(row_r[1:])}": rs for row_r, rs in by_row.items()}
    biggest = max(sides.values(), key=len)
    described = "; ".join(f"{_ranks(rs)} issue{'s' if len(rs) == 1 else ''} {what}" for what, rs in sides.items())
    reason = f"the ranks of the group disagree (SHARDWISE_CHECK): {described}"
    try:  # for ranks outside this group that wait on this one
        store.set(f"{_PREFIX}/report/{rank}", json.dumps({"group": key, "number": number, "what": mine}))
        store.set(f"{_PREFIX}/blame/{rank}", reason)
    except Exception:
        pass
    error = CollectiveError(list(operation), rank, ranks=ranks,
                            elsewhere={r: what for what, rs in sides.items() if rs is not biggest for r in rs},
                            reason=reason)
    _finish_reading(store, rank, started, error)
    raise error


def _signature(values: Sequence[int]) -> str:
    kinds = ["collective", "all_gather", "all_to_all", "all_reduce", "reduce_scatter", "broadcast"]
    kind = kinds[values[0]] if 0 <= values[0] < len(kinds) else "collective"
    return f"({kind}, sizes and dtype digest {values[1]:x})"
