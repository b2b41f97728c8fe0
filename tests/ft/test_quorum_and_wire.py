"""The quorum rule and the healing wire format, without processes: each row of their docstrings' tables; a
restarted lighthouse in this process."""

from __future__ import annotations

import gc
import io
import json
import pickle
import threading
import time
from datetime import timedelta
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from shardwise.ft import Lighthouse, QuorumRule
from shardwise.ft._client import QuorumClient
from shardwise.ft._quorum import Ask, Quorum, decide
from shardwise.ft._wire import pack, unpack

RULE = QuorumRule(min_replicas=1, join_timeout=1.0)


def _asking(**steps: int) -> dict[str, tuple[Ask, float]]:
    return {rid: (Ask(rid, f"t{rid}", step, 2), 10.0) for rid, step in steps.items()}


def test_everyone_alive_asking_forms_at_once_and_nobody_heals() -> None:
    q = decide(RULE, _asking(a=7, b=7, c=7), ("a", "b", "c"), ("a", "b", "c"), now=10.0, quorum_id="x-1")
    assert q == Quorum("x-1", ("a", "b", "c"), 7, 2, {})


def test_a_member_with_a_stale_heartbeat_is_not_waited_for() -> None:
    q = decide(RULE, _asking(a=7, b=7), ("a", "b", "c"), ("a", "b"), now=10.0, quorum_id="x-2")
    assert q is not None and q.members == ("a", "b")


def test_a_fresh_member_that_does_not_ask_is_waited_for_until_join_timeout() -> None:
    assert decide(RULE, _asking(a=7, b=7), ("a", "b", "c"), ("a", "b", "c"), now=10.5, quorum_id="x-3") is None
    q = decide(RULE, _asking(a=7, b=7), ("a", "b", "c"), ("a", "b", "c"), now=11.0, quorum_id="x-3")
    assert q is not None and q.members == ("a", "b")


def test_a_restarted_group_behind_heals_from_an_up_to_date_member_in_turn() -> None:
    q = decide(RULE, _asking(a=7, b=7, c=0, d=3), ("a", "b"), ("a", "b", "c", "d"), now=10.0, quorum_id="x-4")
    assert q is not None and q.step == 7 and q.heal_from == {"c": "a", "d": "b"}


def test_a_restarted_group_never_forms_a_quorum_beside_live_members_mid_step() -> None:
    # regression: the restarted group's ask started the join clock while the live members were
    # mid-step, and after join_timeout it formed a quorum of its own at step 0 (split brain)
    assert decide(RULE, _asking(c=0), ("a", "b"), ("a", "b", "c"), now=99.0, quorum_id="x-6") is None
    q = decide(RULE, _asking(c=0), ("a", "b"), ("c",), now=99.0, quorum_id="x-6")  # a and b gone: c goes on
    assert q is not None and q.members == ("c",)


def test_groups_behind_wait_for_a_live_group_ahead_that_was_left_out_rather_than_go_back_in_time() -> None:
    # regression: c, alive at step 6 but left out of the last quorum for not asking in time, and
    # b restarted at step 0 with nobody left to heal from: b formed a quorum of its own at step 0
    # and trained the job again from its first step beside c
    steps = {"a": 6, "b": 0, "c": 6}
    assert decide(RULE, _asking(b=0), ("a", "b"), ("b", "c"), now=99.0, quorum_id="x-7", last_steps=steps) is None
    q = decide(RULE, _asking(b=0, c=6), ("a", "b"), ("b", "c"), now=99.0, quorum_id="x-7", last_steps=steps)
    assert q is not None and q.step == 6 and q.heal_from == {"b": "c"}
    q = decide(RULE, _asking(b=0), ("a", "b"), ("b",), now=99.0, quorum_id="x-7", last_steps=steps)  # c gone too
    assert q is not None and q.members == ("b",) and q.step == 0


def test_a_restarted_lighthouse_learns_a_live_groups_step_before_a_restarted_group_forms_a_quorum_alone() -> None:
    # regression (bench ft): the lighthouse restarted while a was mid-step at 7 and b, just restarted,
    # asked at step 0; the new incarnation, knowing nothing of a, formed a quorum of b alone at step 0
    # and b trained the job again from its start. a's heartbeat thread now tells it a's last step.
    log = io.StringIO()
    rule = QuorumRule(min_replicas=1, join_timeout=0.3)
    house = Lighthouse(rule=rule, heartbeat_timeout=0.5, log=log).start()
    port, connect, beat = house.store.port, timedelta(seconds=30), timedelta(milliseconds=50)
    a = QuorumClient(house.address, "a", 0, 1, connect, beat)
    b: Optional[QuorumClient] = None
    try:
        assert a.quorum("t1", 7, timedelta(seconds=30)).step == 7
        house.stop()
        del house.store  # the service dies: a's connection is lost ...
        gc.collect()
        house = Lighthouse(port=port, rule=rule, heartbeat_timeout=0.5, log=log).start()  # ... and comes back
        deadline = time.monotonic() + 120  # a's heartbeat thread reconnects and tells the new lighthouse
        while house._last_steps.get("a") != 7:  # its last step (a loaded machine: however long that takes)
            assert time.monotonic() < deadline, (house._last_steps, log.getvalue())
            time.sleep(0.01)
        b = QuorumClient(house.address, "b", 0, 1, connect, beat)
        with pytest.raises(TimeoutError):  # a is alive (beating) at step 7: b alone at 0 must wait
            b.quorum("t1", 0, timedelta(seconds=3))
        answers: dict[str, Quorum] = {}
        waiting = threading.Thread(target=lambda: answers.update(b=b.quorum("t2", 0, timedelta(seconds=30))))
        waiting.start()
        answers["a"] = a.quorum("t2", 8, timedelta(seconds=30))
        waiting.join()
        assert answers["a"] == answers["b"] and answers["a"].step == 8 and answers["a"].heal_from == {"b": "a"}
    finally:
        for client in (a, b):
            if client is not None:
                client.close()
        house.stop()


def test_a_decision_read_before_the_lighthouse_died_is_the_one_every_rank_returns_after() -> None:
    # regression (CI): the lighthouse died after b had read step 5's decision (commit) and applied
    # the step, before a read it; the restarted one held neither the decision nor the votes, a's
    # wait for b's vote ran out and a discarded the step b had taken. b now reposts, reconnecting,
    # the decision it read, and a returns that one.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    port, connect, beat = store.port, timedelta(seconds=30), timedelta(milliseconds=50)
    a = QuorumClient(f"127.0.0.1:{port}", "a", 0, 1, connect, beat)
    b = QuorumClient(f"127.0.0.1:{port}", "b", 0, 1, connect, beat)
    try:
        quorum = Quorum("x-5", ("a", "b"), 5, 1, {})
        store.set("vote/x-5/a/0", "1")  # a's vote, posted before the service died
        assert b.vote(quorum, True, timedelta(seconds=30))  # b reads the decision: commit
        del store  # the service dies ...
        gc.collect()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        outcome: list[bool] = []  # ... and comes back; a, still voting, waits a second for b's vote
        voting = threading.Thread(target=lambda: outcome.append(a.vote(quorum, True, timedelta(seconds=1))))
        voting.start()
        time.sleep(1.5)  # (past a's own second: having reconnected, a waits longer for the others to repost)
        with pytest.raises(TimeoutError):  # b asks for its next quorum: it reconnects and reposts what it read
            b.quorum("t6", 6, timedelta(seconds=0.5))
        voting.join(60)
        assert outcome == [True] and store.get("decision/x-5") == b"1"
    finally:
        a.close()
        b.close()


def _done(rid: str, step: int) -> tuple[Ask, float]:
    return Ask(rid, f"d{rid}", step, 2, done=True), 10.0


def test_a_group_behind_finished_ones_heals_to_their_last_step_in_a_final_quorum_and_takes_none() -> None:
    # regression: b missed the last quorum (step 9); a and c committed it and ended, and b then
    # formed a quorum alone at step 9 and took it again on its own part of the batch
    asking = {**_asking(b=9), "a": _done("a", 10), "c": _done("c", 10)}
    q = decide(RULE, asking, ("a", "c"), ("a", "b", "c"), now=10.0, quorum_id="x-8")
    assert q == Quorum("x-8", ("a", "b", "c"), 10, 2, {"b": "a"}, ("a", "c")) and q.final and q.voters == ("b",)
    assert Quorum.loads(q.dumps()) == q and Ask.loads(asking["a"][0].dumps()) == asking["a"][0]
    two = QuorumRule(min_replicas=2, join_timeout=0.0)  # a heal takes no step: min_replicas does not hold it up
    assert decide(two, asking, ("a", "c"), ("a", "b", "c"), now=10.0, quorum_id="x-8") == q
    # finished groups alone form nothing; beside a working group at their step, they are left out of its quorum
    assert decide(RULE, {"a": _done("a", 10)}, ("a",), ("a",), now=99.0, quorum_id="x-9") is None
    q = decide(RULE, {**_asking(b=10), "a": _done("a", 10)}, ("a", "b"), ("a", "b"), now=10.0, quorum_id="x-9")
    assert q == Quorum("x-9", ("b",), 10, 2, {})


def test_finished_groups_stay_to_give_their_state_until_every_live_group_has_finished() -> None:
    log = io.StringIO()
    house = Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.3), heartbeat_timeout=0.5, log=log).start()
    connect, beat, wait = timedelta(seconds=30), timedelta(milliseconds=50), timedelta(seconds=60)
    a, b, c = (QuorumClient(house.address, rid, 0, 1, connect, beat) for rid in ("a", "b", "c"))
    try:
        got: dict[str, Optional[Quorum]] = {}

        def finish(client: QuorumClient, token: str) -> threading.Thread:
            thread = threading.Thread(target=lambda: got.update({client.replica_id: client.linger(token, 10, wait)}))
            thread.start()
            return thread

        lingering = [finish(a, "d1"), finish(c, "d1")]
        time.sleep(0.5)  # a and c finished at step 10; b asks at step 9, behind them
        final = b.quorum("t9", 9, wait)
        for thread in lingering:
            thread.join(60)
        assert final.final and final.step == 10 and final.heal_from == {"b": "a"} and got == {"a": final, "c": final}
        leaving = [finish(client, "d2") for client in (a, b, c)]  # b, healed, has finished too: all three go
        for thread in leaving:
            thread.join(60)
        assert got == {"a": None, "b": None, "c": None}, log.getvalue()
        assert "final: b heals from a, which finished there; no step is taken" in log.getvalue()
    finally:
        for client in (a, b, c):
            client.close()
        house.stop()


def test_the_first_quorum_waits_join_timeout_for_groups_started_together_and_min_replicas() -> None:
    assert decide(RULE, _asking(a=0), (), ("a",), now=10.5, quorum_id="x-5") is None
    assert decide(RULE, _asking(a=0), (), ("a",), now=11.0, quorum_id="x-5") is not None
    two = QuorumRule(min_replicas=2, join_timeout=0.0)
    assert decide(two, _asking(a=0), (), ("a",), now=99.0, quorum_id="x-5") is None
    with pytest.raises(ValueError, match="min_replicas=0"):
        QuorumRule(min_replicas=0)


@pytest.mark.parametrize("text", ["not json", "[1]", json.dumps({"replica_id": "a", "token": "t", "step": -1,
                                                                   "group_size": 1}),
                                  json.dumps({"replica_id": "a", "token": "t", "step": "7", "group_size": 1})])
def test_a_malformed_ask_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError):
        Ask.loads(text)


def _state() -> dict[str, object]:
    return {"model": {"w": torch.arange(6, dtype=torch.float64).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None}]},
            "step": 7, "rng": torch.get_rng_state(), "name": "run-1", "nan": float("inf")}


def test_a_state_round_trips_through_the_header_and_its_tensors() -> None:
    state = _state()
    header, tensors = pack(state)
    rebuilt, buffers = unpack(header, None)
    assert len(buffers) == len(tensors) == 5
    for buf, t in zip(buffers, tensors):
        assert buf.dtype == t.dtype and buf.shape == t.shape
        buf.copy_(t)
    assert rebuilt["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple stays a tuple
    assert set(rebuilt["optim"]["state"]) == {0}  # integer keys stay integers
    assert rebuilt["step"] == 7 and rebuilt["name"] == "run-1" and rebuilt["nan"] == float("inf")
    assert torch.equal(rebuilt["model"]["w"], state["model"]["w"])  # type: ignore[index]


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("a pickle ran code",))


@pytest.mark.parametrize("header", [
    pickle.dumps({"w": _Boom()}),  # a code-running pickle
    b"\xff\xfe garbage",
    json.dumps({"t": 0, "dtype": "object", "shape": [2]}).encode(),  # a dtype outside the allow-list
    json.dumps({"t": 0, "dtype": "float32", "shape": [-1]}).encode(),
    json.dumps({"t": 5, "dtype": "float32", "shape": [2]}).encode(),  # a tensor index out of order
    json.dumps({"d": [[1.5, {"v": 1}]]}).encode(),  # a float key
    json.dumps({"x": []}).encode(),
], ids=["pickle", "bytes", "dtype", "shape", "index", "key", "node"])
def test_a_hostile_or_broken_header_is_refused_and_runs_nothing(header: bytes, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    with pytest.raises(ValueError):
        unpack(header, None)
    assert "ran code" not in capsys.readouterr().out


def test_a_state_that_cannot_travel_as_tensors_and_json_is_refused_by_path() -> None:
    with pytest.raises(TypeError, match=r"state at state\['model'\]\['fn'\]: a builtin_function"):
        pack({"model": {"fn": print}})
    with pytest.raises(TypeError, match="key"):
        pack({(1, 2): torch.ones(1)})


def test_the_sampler_trains_every_sample_of_an_epoch_once_whoever_is_alive() -> None:
    from shardwise.ft import ReplicaSampler

    sampler = ReplicaSampler(103, 12, seed=3)  # 8 steps an epoch, 7 samples dropped
    members_at = [3, 3, 2, 2, 1, 3, 2, 3]  # groups failing and coming back
    seen: list[int] = []
    for step, members in enumerate(members_at):
        pieces = [sampler.indices(step, members, m, r, 2) for m in range(members) for r in range(2)]
        assert sorted(i for p in pieces for i in p) == sorted(sampler.global_batch(step))
        seen += [i for p in pieces for i in p]
    assert len(seen) == len(set(seen)) == 96  # no sample twice, none of the epoch's skipped
    assert sampler.global_batch(8) != sampler.global_batch(0)  # the next epoch, reshuffled
    with pytest.raises(ValueError, match="global_batch_size=0"):
        ReplicaSampler(10, 0)
