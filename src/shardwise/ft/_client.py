"""A replica group's side of the quorum service: asks, answers, heartbeats and votes, over the store.

Every rank of a group holds a `QuorumClient`; the group's leader (its rank 0) registers,
beats and asks, and every rank reads the answer and votes. When the service is gone (its
host died or restarts), every store call here reconnects and retries until
`connect_timeout`: the leader registers and asks again, and the group carries on with the
restarted service. The service's keys are listed in `_lighthouse`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, TypeVar

import torch.distributed as dist

from ._quorum import Ask, Quorum

__all__ = ["QuorumClient", "parse_address"]

T = TypeVar("T")
CALL_TIMEOUT_S = 10.0  # a store call's own bound (every call here reads or writes keys that exist)


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` of the quorum service; ValueError naming the value otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"lighthouse address {address!r}: host:port expected (SHARDWISE_FT_LIGHTHOUSE or "
                         "Manager(lighthouse_addr=...), as `shardwise run --ft` prints it)")
    return host, int(port)


class QuorumClient:
    """Rank `group_rank` of the `group_size` ranks of replica group `replica_id`, talking to the
    service at `address`. Construction connects (ValueError if the service cannot be reached
    within `connect_timeout`)."""

    def __init__(self, address: str, replica_id: str, group_rank: int, group_size: int,
                 connect_timeout: timedelta, heartbeat_interval: timedelta) -> None:
        self.host, self.port = parse_address(address)
        self.address, self.replica_id = address, replica_id
        self.group_rank, self.group_size = group_rank, group_size
        self.connect_timeout = connect_timeout.total_seconds()
        self.leader = group_rank == 0
        self._last_ask: Optional[Ask] = None
        self._voted: Optional[tuple[str, str]] = None  # (key, value) of this rank's last vote
        self._decided: Optional[tuple[str, str]] = None  # (key, outcome) of the last decision it read
        self.reconnects = 0
        self._stop = threading.Event()
        self.store = self._connect(first=True)
        if self.leader:
            self._register(self.store)
        self._beat: Optional[threading.Thread] = None
        if self.leader:
            self._beat = threading.Thread(target=self._beating, args=(heartbeat_interval.total_seconds(),),
                                          name=f"shardwise-ft-heartbeat-{replica_id}", daemon=True)
            self._beat.start()

    # -- connection -------------------------------------------------------------------------
    def _connect(self, first: bool = False) -> Any:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            # one short attempt at a time (the store's timeout bounds its connecting, and it waits out a
            # backoff of seconds inside a long one): a service back on its port is reached within a second
            attempt = max(0.2, min(1.0, deadline - time.monotonic()))
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False,  # type: ignore[attr-defined]
                                      wait_for_workers=False, timeout=timedelta(seconds=attempt))
                store.set_timeout(timedelta(seconds=CALL_TIMEOUT_S))
                return store
            except (RuntimeError, OSError) as exc:
                if self._stop.is_set():
                    raise ValueError(f"replica group {self.replica_id}: closed while reconnecting") from None
                if time.monotonic() > deadline:
                    what = "reach" if first else "reach again"
                    raise ValueError(f"replica group {self.replica_id}: could not {what} the lighthouse at "
                                     f"{self.address} within {self.connect_timeout:g} s ({exc}); start it first "
                                     "(`shardwise run --ft` does) or fix SHARDWISE_FT_LIGHTHOUSE") from None
                time.sleep(0.2)

    def _register(self, store: Any) -> None:
        n = store.add("ids", 1) - 1
        store.set(f"id/{n}", self.replica_id)

    def _retrying(self, call: Callable[[Any], T]) -> T:
        """`call(store)`, reconnecting while the service is away, and telling a restarted one what
        this rank had written to its predecessor (`_repost`)."""
        while True:
            try:
                return call(self.store)
            except (RuntimeError, OSError) as exc:
                if not _connection_lost(exc):
                    raise
                self._reconnect()

    def _reconnect(self) -> None:
        while True:
            self.store = self._connect()
            self.reconnects += 1
            try:
                self._repost(self.store)
                return
            except (RuntimeError, OSError) as exc:
                if not _connection_lost(exc):
                    raise

    def _repost(self, store: Any) -> None:
        """What the service's predecessor held from this rank: the decision it last read, its last
        vote and, as leader, its registration and last ask. A service that died between two ranks
        reading a step's decision took the decision and the votes with it; reposted, every rank
        still waiting on that step reads the decision the others acted on (or, with nobody having
        read one, the same votes), never a verdict of its own."""
        if self._decided is not None:
            key, outcome = self._decided
            now = store.compare_set(key, "", outcome).decode()
            if now != outcome:  # a rank decided alone meanwhile (it waited out its vote's bound)
                print(f"[shardwise.ft {self.replica_id} rank {self.group_rank}] {key} was {outcome!r} before the "
                      f"lighthouse restarted and {now!r} after: this group acted on the first", file=sys.stderr,
                      flush=True)
        if self._voted is not None:
            store.set(*self._voted)
        if self.leader:
            self._register(store)
            if self._last_ask is not None:
                store.set(f"ask/{self.replica_id}", self._last_ask.dumps())

    def _beating(self, interval: float) -> None:
        store, reconnected = self._connect(), False
        while not self._stop.wait(interval):
            try:
                if reconnected:
                    self._reintroduce(store)
                    reconnected = False
                store.add(f"hb/{self.replica_id}", 1)
            except (RuntimeError, OSError):
                try:
                    store, reconnected = self._connect(), True
                except ValueError:
                    if self._stop.is_set():
                        return

    def _reintroduce(self, store: Any) -> None:
        """To a restarted service, from the heartbeat thread (the main thread may be mid-step for
        a while): this group's id and the step of its last ask. Before this group asks again, the
        service then knows a live group holds that step, and forms no quorum of groups behind it
        (a group restarted meanwhile, at step 0, would otherwise train the job again from there)."""
        self._register(store)
        ask = self._last_ask
        if ask is not None:
            store.set(f"last/{self.replica_id}", str(ask.step))

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            # a store call in flight ends within its own timeout (at most 10 s, `_connect`); a thread
            # still inside one when the interpreter exits would abort the process
            self._beat.join(timeout=15)

    # -- quorum and votes ------------------------------------------------------------------
    def quorum(self, token: str, step: int, timeout: timedelta) -> Quorum:
        """Ask (as leader) for the quorum of the next step and wait for it; every rank of the
        group passes the same `token`. ValueError if the service refuses the group; TimeoutError
        if no quorum forms within `timeout`."""
        quorum = self._ask(token, step, timeout, done=False)
        assert quorum is not None  # (only a finished group is released)
        return quorum

    def linger(self, token: str, step: int, timeout: timedelta) -> Optional[Quorum]:
        """Ask as a group that finished at `step`: the next quorum in which it gives its state to
        a group behind, or None once every live group has finished. TimeoutError after `timeout`."""
        return self._ask(token, step, timeout, done=True)

    def _ask(self, token: str, step: int, timeout: timedelta, done: bool) -> Optional[Quorum]:
        key = f"answer/{self.replica_id}/{token}"
        if self.leader:
            ask = self._last_ask = Ask(self.replica_id, token, step, self.group_size, done)
            self._retrying(lambda s: s.set(f"ask/{self.replica_id}", ask.dumps()))
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            if not self._arrived([key], deadline):
                raise TimeoutError(f"replica group {self.replica_id}: no quorum within {timeout.total_seconds():g} s "
                                   f"(lighthouse {self.address}); fewer groups than min_replicas are alive?")
            reconnects = self.reconnects
            answer = self._retrying(lambda s: s.get(key)).decode()
            if answer.startswith("{"):
                data = json.loads(answer)
                if done and "released" in data:
                    return None
                raise ValueError(data.get("error", answer))
            try:
                return Quorum.loads(self._retrying(lambda s: s.get(f"quorum/{answer}")).decode())
            except dist.DistStoreError:
                if self.reconnects == reconnects:
                    raise
                # the service restarted between its answer and its quorum: the ask (reposted) is answered anew

    def vote(self, quorum: Quorum, ok: bool, timeout: timedelta) -> bool:
        """Post this rank's vote on the quorum's step and return the decision: True when every rank
        of every member voted yes within `timeout`. The first rank to know (all votes read, or
        its wait over) writes the decision with one compare-and-set, and every rank returns
        that one decision, so no two ranks ever disagree on whether the step counts."""
        voted = self._voted = (f"vote/{quorum.quorum_id}/{self.replica_id}/{self.group_rank}", "1" if ok else "0")
        reconnects = self.reconnects  # (a reconnect while posting the vote counts as one during the count)
        self._retrying(lambda s: s.set(*voted))
        keys = [f"vote/{quorum.quorum_id}/{m}/{r}" for m in quorum.voters for r in range(quorum.group_size)]
        decision = f"decision/{quorum.quorum_id}"
        outcome = self._count(keys, decision, timeout.total_seconds(), reconnects)
        self._decided = (decision, self._retrying(lambda s: s.compare_set(decision, "", outcome)).decode())
        return self._decided[1] == "1"

    def _count(self, keys: list[str], decision: str, timeout: float, reconnects: int) -> str:
        """The outcome of the votes `keys`: "1" when all arrive within `timeout` and say yes, else
        "0" (and whatever another rank already decided wins over it, by the compare-and-set). If
        the service restarts meanwhile, the wait starts again, for at least `CALL_TIMEOUT_S`: the
        other ranks repost their votes, or the decision they read, as they reconnect."""
        pause, deadline = 0.001, time.monotonic() + timeout
        while True:
            if self._retrying(lambda s: s.check(keys)):
                try:
                    return "1" if all(v == b"1" for v in self._retrying(lambda s: s.multi_get(keys))) else "0"
                except dist.DistStoreError:  # the service restarted between the check and the read
                    pass
            elif pause == 0.02 and self._retrying(lambda s: s.check([decision])):
                return "0"  # decided already (by a rank whose wait ended, or before a restart): that one stands
            if self.reconnects != reconnects:
                reconnects, deadline = self.reconnects, time.monotonic() + max(timeout, CALL_TIMEOUT_S)
            if time.monotonic() > deadline:
                return "0"
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _arrived(self, keys: list[str], deadline: float) -> bool:
        """Whether every key is set by `deadline`: polled, from 1 ms apart up to 20 ms (a store's
        own wait leaves its client connection mid-reply when it times out)."""
        pause = 0.001
        while not self._retrying(lambda s: s.check(keys)):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return True

    def prefix(self, name: str) -> Any:
        """A store for one use (a process group's rendezvous) under `name`."""
        return dist.PrefixStore(name, self.store)  # type: ignore[attr-defined]


def _connection_lost(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("connection", "broken pipe", "reset", "refused", "socket", "closed", "eof"))
