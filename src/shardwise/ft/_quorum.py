"""The quorum rule: which replica groups take the next step together, at which step, healed by whom.

Pure: the lighthouse (`_lighthouse`) feeds it what it has read from the store and writes
back what it returns, so the rule is tested without processes or clocks.

Each replica group's leader *asks* once per step (`Ask`: its replica id, its count of
committed steps, its group size). The rule forms a quorum when

- at least `min_replicas` groups are asking, and
- every member of the previous quorum whose heartbeat is still fresh is asking (the fast
  path: nobody alive is left behind), or `join_timeout` seconds have passed since the
  first such member asked (a member that is alive but not asking, hung in a collective, is
  left out rather than waited for). While no live member is asking, they are mid-step, and
  a group that asks then (a restarted one) waits for them: it never forms a quorum of its
  own beside them. With no fresh previous member (the first quorum, or every member gone),
  the clock starts at the first ask, so groups started together join one quorum.

A quorum never goes back in time: while a live group (fresh heartbeat) that is not asking
last asked at a step beyond every asker's, it holds the newest state, and the askers
(restarted, behind) wait for it rather than train on from an older step without it (it
may have been left out of the last quorum for not asking in time, and be mid-step still).

A group not in the previous quorum joins whenever it is asking when a quorum forms. The
quorum's step is the highest step asked; a member behind it heals from an up-to-date
member (spread over them in turn) before the step, and takes part in it.

A group that has finished (its loop ended; `Manager.shutdown`) asks as *done*: it takes no
more steps, but until every live group has finished it stays to give its state. A group
that asks behind it (one that missed the last quorum, or restarted after the others ended)
gets a *final* quorum at once: it heals from a finished group to the job's last step, and
no step is taken (no reduction, no commit); its loop then ends too. Without that, a group
that missed the last step would take it again alone, on its own part of the batch, and end
with parameters no other group has.

| situation | quorum |
|---|---|
| members A B C asking at step 7 | A B C, step 7, nobody heals |
| A B asking, C's heartbeat stale | A B (at once) |
| A B asking, C fresh but silent | A B after `join_timeout` |
| A B at 7, restarted C at 0 | A B C, step 7, C heals from A |
| restarted C asking, A B alive mid-step | nothing yet: C waits for A B |
| restarted A B at 0 asking, C alive (left out) last at 6 | nothing yet: A B wait for C |
| B at 9 asking, A C done at 10 | final: A B C at 10, B heals from A, no step |
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = ["Ask", "Quorum", "QuorumRule", "decide"]


@dataclass(frozen=True)
class Ask:
    """One group's request for the next quorum: `token` names this ask (its answer's key), unique
    over the group's asks and restarts."""

    replica_id: str
    token: str
    step: int
    group_size: int
    done: bool = False  # finished: it only gives its state to groups behind it

    def dumps(self) -> str:
        return json.dumps({"replica_id": self.replica_id, "token": self.token, "step": self.step,
                           "group_size": self.group_size, "done": self.done})

    @staticmethod
    def loads(text: str) -> Ask:
        """An ask from the store; ValueError for anything else (a foreign or broken write)."""
        data = _object(text, "ask")
        done = data.get("done", False)
        if not isinstance(done, bool):
            raise ValueError(f"ask {text[:200]!r}: done must be true or false")
        ask = Ask(_str(data, "replica_id"), _str(data, "token"), _int(data, "step"), _int(data, "group_size"), done)
        if ask.step < 0 or ask.group_size < 1:
            raise ValueError(f"ask {text[:200]!r}: step must be >= 0, group_size >= 1")
        return ask


@dataclass(frozen=True)
class Quorum:
    """The groups (`members`, sorted) that take step `step` together, as quorum `quorum_id`;
    `heal_from[m]` is the member that group `m` heals from (only members behind `step`). A
    final quorum names the finished members that give their state (`done`): the others heal
    from them and no step is taken."""

    quorum_id: str
    members: tuple[str, ...]
    step: int
    group_size: int
    heal_from: Mapping[str, str]
    done: tuple[str, ...] = ()

    @property
    def final(self) -> bool:
        return bool(self.done)

    @property
    def voters(self) -> tuple[str, ...]:
        """The members that vote on the step (in a final quorum, on their heal)."""
        return tuple(m for m in self.members if m not in self.done)

    def dumps(self) -> str:
        return json.dumps({"quorum_id": self.quorum_id, "members": list(self.members), "step": self.step,
                           "group_size": self.group_size, "heal_from": dict(self.heal_from),
                           "done": list(self.done)})

    @staticmethod
    def loads(text: str) -> Quorum:
        data = _object(text, "quorum")
        members, heal, done = data.get("members"), data.get("heal_from"), data.get("done", [])
        if not (isinstance(members, list) and all(isinstance(m, str) for m in members) and isinstance(heal, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in heal.items())
                and isinstance(done, list) and all(isinstance(m, str) and m in members for m in done)):
            raise ValueError(f"quorum {text[:200]!r}: members must be a list of ids, heal_from a map of ids, done "
                             "a list of members")
        return Quorum(_str(data, "quorum_id"), tuple(members), _int(data, "step"), _int(data, "group_size"),
                      dict(heal), tuple(done))

    def rank_of(self, replica_id: str) -> int:
        """The member's place in the quorum (its rank in the groups' process group)."""
        return self.members.index(replica_id)


@dataclass(frozen=True)
class QuorumRule:
    """When a quorum forms (see the module docstring)."""

    min_replicas: int = 1
    join_timeout: float = 1.0  # seconds

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas={self.min_replicas}: at least 1 group must take a step")
        if self.join_timeout < 0:
            raise ValueError(f"join_timeout={self.join_timeout}: seconds, >= 0")


def decide(rule: QuorumRule, asking: Mapping[str, tuple[Ask, float]], previous: Sequence[str],
           fresh: Sequence[str], now: float, quorum_id: str,
           last_steps: Optional[Mapping[str, int]] = None) -> Optional[Quorum]:
    """The quorum to form now, or None to wait. `asking`: replica id -> (its pending ask, when
    it arrived), groups of one size (the lighthouse refuses others); `previous`: the last
    quorum's members; `fresh`: groups whose heartbeat is fresh; `last_steps`: the step of
    each group's last ask."""
    finished = {g: ask.step for g, (ask, _) in asking.items() if ask.done}
    working = {g: v for g, v in asking.items() if not v[0].done}
    if not working:
        return None  # finished groups only give
    front = max(finished.values(), default=-1)
    if front > max(ask.step for ask, _ in working.values()):  # the job ended ahead of them: a final quorum
        givers = sorted(g for g, step in finished.items() if step == front)
        heal = {m: givers[i % len(givers)] for i, m in enumerate(sorted(working))}
        members = tuple(sorted([*working, *givers]))
        return Quorum(quorum_id, members, front, asking[members[0]][0].group_size, heal, tuple(givers))
    asking = working
    if len(asking) < rule.min_replicas:
        return None
    top = max(ask.step for ask, _ in asking.values())
    if any((last_steps or {}).get(g, -1) > top for g in fresh if g not in asking and g not in finished):
        return None  # a live group holds newer state than any asker: wait for it
    expected = [m for m in previous if m in set(fresh) and m not in finished]
    if expected:
        waited_on = [t for m, (_, t) in asking.items() if m in expected]
        if not waited_on:  # the live members are mid-step: a newcomer waits for them (no split brain)
            return None
        if not all(m in asking for m in expected) and now - min(waited_on) < rule.join_timeout:
            return None
    elif now - min(t for _, t in asking.values()) < rule.join_timeout:
        return None
    members = tuple(sorted(asking))
    step = top
    current = [m for m in members if asking[m][0].step == step]
    behind = [m for m in members if asking[m][0].step < step]
    heal = {m: current[i % len(current)] for i, m in enumerate(behind)}
    return Quorum(quorum_id, members, step, asking[members[0]][0].group_size, heal)


def _object(text: str, what: str) -> dict[str, object]:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {text[:200]!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {text[:200]!r}: a JSON object is expected")
    return data


def _int(data: Mapping[str, object], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: an integer is expected")
    return value


def _str(data: Mapping[str, object], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value or len(value) > 128:
        raise ValueError(f"{key}={value!r}: a non-empty id of at most 128 characters is expected")
    return value
