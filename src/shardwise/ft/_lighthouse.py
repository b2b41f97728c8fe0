"""The quorum service: a TCPStore that replica groups write to, and a loop that answers them.

torch.distributed's own `TCPStore` is the whole network side: no new server, nothing to
install. The process that hosts it (started by `shardwise run --ft`, or `Lighthouse` in a
program) also runs the loop below over it, every few milliseconds:

| key | written by | holds |
|---|---|---|
| `ids` (a counter), `id/<n>` | a group's leader, once per connection | its replica id |
| `hb/<id>` (a counter) | the leader's heartbeat thread | liveness: the loop notes when it moves |
| `last/<id>` | the heartbeat thread, reconnected | the step of the group's last ask to a predecessor |
| `ask/<id>` | the leader, once a step | an `Ask` (JSON) |
| `answer/<id>/<token>` | the loop | the quorum id, `{"error": ...}`, or (to a finished group) `{"released": ...}` |
| `quorum/<quorum id>` | the loop | the `Quorum` (JSON) |
| `vote/<quorum id>/<id>/<rank>` | every rank of every member | whether its step succeeded |
| `decision/<quorum id>` | the first rank to know, by compare-and-set | whether the step commits |

Everything read is JSON or a replica id checked for length and characters, so nothing sent
to the service can run code; anything malformed is logged and ignored, and the service
carries on. The loop forgets keys of quorums three behind (answers, quorums, votes), so a
long run keeps a bounded store. Quorum ids start with a random incarnation, so a service
restarted on the same port never answers with an id its predecessor used; the groups
reconnect to it, ask again and carry on (`_client`). A restarted service knows nothing of the
job's progress: a live group's heartbeat thread, reconnecting, tells it the step of the
group's last ask (`last/<id>`), so that a group restarted meanwhile, at step 0, cannot form a
quorum of its own while the live groups are mid-step and train the job again from the start.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Optional, TextIO

import torch.distributed as dist

from ._quorum import Ask, Quorum, QuorumRule, decide

__all__ = ["Lighthouse", "valid_id"]

_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def valid_id(replica_id: str) -> bool:
    """Replica ids are short names: letters, digits and `_.:-`."""
    return bool(_ID.fullmatch(replica_id))


class Lighthouse:
    """Host the quorum store on `host:port` (port 0: any free port) and answer quorums by `rule`;
    a group whose heartbeat has not moved for `heartbeat_timeout` seconds is not waited for."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, rule: QuorumRule = QuorumRule(),
                 heartbeat_timeout: float = 1.0, log: Optional[TextIO] = None) -> None:
        self.rule, self.heartbeat_timeout = rule, heartbeat_timeout
        self.store: Any = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                                   timeout=timedelta(seconds=30))
        self.address = f"{host}:{self.store.port}"
        self.incarnation = secrets.token_hex(4)
        self.log = log if log is not None else sys.stderr
        self._ids: list[str] = []
        self._beats: dict[str, tuple[int, float]] = {}  # id -> (heartbeat count, when it last moved)
        self._asking: dict[str, tuple[Ask, float, str]] = {}  # id -> (ask, when read, its answer key)
        self._answered: dict[str, str] = {}  # id -> the answer key last answered
        self._last_steps: dict[str, int] = {}  # id -> the step of its last ask
        self._refused: set[str] = set()  # groups whose last ask was refused: finished groups do not wait for them
        self._group_size: Optional[int] = None
        self._previous: tuple[str, ...] = ()
        self._formed = 0
        self._old: deque[tuple[Quorum, list[str]]] = deque()  # recent quorums and their answer keys
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- running ----------------------------------------------------------------------------
    def start(self) -> Lighthouse:
        """Answer in a background thread (`stop()` ends it)."""
        self._thread = threading.Thread(target=self.serve, name="shardwise-lighthouse", daemon=True)
        self._thread.start()
        return self

    def serve(self, interval: float = 0.005) -> None:
        """Answer until `stop()`."""
        self._say(f"lighthouse {self.incarnation} on {self.address}: min_replicas={self.rule.min_replicas}, "
                  f"join_timeout={self.rule.join_timeout}s, heartbeat_timeout={self.heartbeat_timeout}s")
        while not self._stop.is_set():
            self.tick(time.monotonic())
            time.sleep(interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Lighthouse:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- one pass ---------------------------------------------------------------------------
    def tick(self, now: float) -> Optional[Quorum]:
        """Read what the groups wrote; form and write a quorum if the rule says so."""
        self._read_ids()
        for rid in self._ids:
            self._read_beat(rid, now)
            self._read_ask(rid, now)
        fresh = [rid for rid, (_, seen) in self._beats.items() if now - seen < self.heartbeat_timeout]
        asking = {rid: (ask, seen) for rid, (ask, seen, _) in self._asking.items()}
        quorum = decide(self.rule, asking, self._previous, fresh, now, f"{self.incarnation}-{self._formed}",
                        self._last_steps)
        if quorum is not None:
            self._publish(quorum, fresh)
        done = [rid for rid, (ask, _, _) in self._asking.items() if ask.done]
        if done and all(rid in self._refused or (rid in self._asking and self._asking[rid][0].done) for rid in fresh):
            self._release()
        return quorum

    def _release(self) -> None:
        """Every live group has finished (or was refused): nobody is left to give state to, and the
        finished ones go."""
        for rid, (ask, _, key) in list(self._asking.items()):
            if ask.done:
                self._answer(key, json.dumps({"released": f"every live group finished (this one at step {ask.step})"}))
                self._answered[rid] = key
                del self._asking[rid]

    def _read_ids(self) -> None:
        count = self.store.add("ids", 0)
        for n in range(len(self._ids), count):
            try:
                rid = self.store.get(f"id/{n}").decode()
            except (RuntimeError, UnicodeDecodeError) as exc:
                self._say(f"ignored registration {n}: {exc}")
                rid = ""
            self._ids.append(rid if valid_id(rid) and rid not in self._ids else "")
            if rid and not valid_id(rid):
                self._say(f"ignored registration {n}: {rid[:64]!r} is not a replica id (letters, digits, _.:-)")

    def _read_beat(self, rid: str, now: float) -> None:
        if not rid:
            return
        count = self.store.add(f"hb/{rid}", 0)
        if self._beats.get(rid, (-1, 0.0))[0] != count:
            self._beats[rid] = (count, now)
        if rid not in self._last_steps and self.store.check([f"last/{rid}"]):
            raw = self.store.get(f"last/{rid}")  # a live group's last ask, before this incarnation
            if raw.isdigit() and len(raw) <= 18:
                self._last_steps[rid] = int(raw)
            else:
                self._last_steps[rid] = -1
                self._say(f"ignored the last step of {rid}: {raw[:64]!r} is not a step number")

    def _read_ask(self, rid: str, now: float) -> None:
        if not rid or not self.store.check([f"ask/{rid}"]):
            return
        raw = self.store.get(f"ask/{rid}")
        try:
            ask = Ask.loads(raw.decode())
            if ask.replica_id != rid or not valid_id(ask.token):
                raise ValueError(f"ask names replica {ask.replica_id!r} (written under {rid!r}) with token "
                                 f"{ask.token[:64]!r}: a replica's own id and a short token are expected")
        except (ValueError, UnicodeDecodeError) as exc:
            if self._answered.get(rid) != f"bad:{raw[:64]!r}":
                self._say(f"ignored an ask of {rid}: {exc}")
                self._answered[rid] = f"bad:{raw[:64]!r}"
            return
        key = f"answer/{rid}/{ask.token}"
        if self._answered.get(rid) == key or (rid in self._asking and self._asking[rid][2] == key):
            return
        if self._group_size is not None and ask.group_size != self._group_size:
            self._answer(key, json.dumps({"error": (
                f"replica group {rid} has {ask.group_size} ranks and the others {self._group_size}: every replica "
                "group must have the same shape (launch each with the same -n)")}))
            self._answered[rid] = key
            self._refused.add(rid)
            return
        self._refused.discard(rid)
        self._asking[rid] = (ask, now, key)
        self._last_steps[rid] = ask.step

    def _publish(self, quorum: Quorum, fresh: list[str]) -> None:
        self._group_size = quorum.group_size
        self.store.set(f"quorum/{quorum.quorum_id}", quorum.dumps())
        keys = []
        for rid in quorum.members:
            _, _, key = self._asking.pop(rid)
            self._answer(key, quorum.quorum_id)
            self._answered[rid] = key
            keys.append(key)
        joined = sorted(set(quorum.members) - set(self._previous))
        left = sorted(set(self._previous) - set(quorum.members))
        if quorum.final:
            self._say(f"quorum {quorum.quorum_id} at step {quorum.step}, final: "
                      + "; ".join(f"{m} heals from {s}" for m, s in sorted(quorum.heal_from.items()))
                      + f", which finished there; no step is taken")
        elif joined or left or quorum.heal_from:
            why = {m: "heartbeat stale" if m not in fresh else "did not ask within join_timeout" for m in left}
            self._say(f"quorum {quorum.quorum_id} at step {quorum.step}: members {list(quorum.members)}"
                      + (f"; joined {joined}" if joined else "") + (f"; left {why}" if left else "")
                      + "".join(f"; {m} heals from {s}" for m, s in sorted(quorum.heal_from.items())))
        self._previous = quorum.members
        self._formed += 1
        self._old.append((quorum, keys))
        while len(self._old) > 3:
            self._forget(*self._old.popleft())

    def _answer(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def _forget(self, quorum: Quorum, keys: list[str]) -> None:
        for key in keys:
            self.store.delete_key(key)
        self.store.delete_key(f"quorum/{quorum.quorum_id}")
        self.store.delete_key(f"decision/{quorum.quorum_id}")
        for rid in quorum.members:
            for rank in range(quorum.group_size):
                self.store.delete_key(f"vote/{quorum.quorum_id}/{rid}/{rank}")

    def _say(self, line: str) -> None:
        print(f"[shardwise.ft] {line}", file=self.log, flush=True)
