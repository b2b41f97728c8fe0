"""Bad configurations and hostile input to the quorum service, in one process (managers of one rank each)."""

from __future__ import annotations

import io
import pickle
import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

import shardwise.ft as ft
from shardwise.ft import Lighthouse, QuorumRule


def _manager(address: str, rid: str, **kwargs: Any) -> ft.Manager:
    return ft.Manager(lighthouse_addr=address, replica_id=rid, rank=0, world_size=kwargs.pop("world_size", 1),
                      timeout=timedelta(seconds=2), **kwargs)


def test_no_lighthouse_at_start_is_a_value_error_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again: nothing listens there)
    with pytest.raises(ValueError, match=f"could not reach the lighthouse at 127.0.0.1:{port}"):
        _manager(f"127.0.0.1:{port}", "a", connect_timeout=timedelta(seconds=1))
    for bad, says in [(dict(replica_id="a b"), "replica_id='a b'"), (dict(lighthouse_addr="nohost"), "host:port"),
                      (dict(pg=object()), "pass pg=None"), (dict(min_replica_size=0), "min_replica_size=0")]:
        args: dict[str, Any] = {**dict(lighthouse_addr="127.0.0.1:1", replica_id="a", rank=0, world_size=1), **bad}
        with pytest.raises(ValueError, match=says):
            ft.Manager(**args)


def test_a_group_of_another_shape_is_refused_by_name_and_the_others_go_on() -> None:
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.1), log=io.StringIO()) as lighthouse:
        a = _manager(lighthouse.address, "a")
        a.start_quorum()
        assert a.should_commit() and a.current_step() == 1
        b = _manager(lighthouse.address, "b", world_size=2)  # (as its rank 0: it asks for its group of 2)
        with pytest.raises(ValueError, match="replica group b has 2 ranks and the others 1"):
            b.start_quorum()
        a.start_quorum()
        assert a.should_commit() and a.num_participants() == 1 and a.current_step() == 2
        a.shutdown()
        b.shutdown()


def test_garbage_and_pickles_sent_to_the_lighthouse_change_nothing_and_run_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    log = io.StringIO()
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.1), log=log) as lighthouse:
        host, port = lighthouse.address.split(":")
        with socket.create_connection((host, int(port))) as raw:  # not the store's protocol at all
            raw.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n" * 100)
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)  # type: ignore[attr-defined]
        boom = pickle.dumps(type("Boom", (), {"__reduce__": lambda self: (print, ("a pickle ran code",))})())
        n = store.add("ids", 1) - 1
        store.set(f"id/{n}", "x" * 500)  # not a replica id
        n = store.add("ids", 1) - 1
        store.set(f"id/{n}", "mallory")
        store.set("ask/mallory", boom)  # a registered id asking with a pickle
        a = _manager(lighthouse.address, "a")
        results: list[bool] = []
        worker = threading.Thread(target=lambda: (a.start_quorum(), results.append(a.should_commit())))
        worker.start()
        worker.join(60)
        assert results == [True] and a.quorum() is not None and a.quorum().members == ("a",)  # type: ignore[union-attr]
        a.shutdown()
    text = log.getvalue()
    assert "is not a replica id" in text and "ignored an ask of mallory" in text, text
    assert "ran code" not in capsys.readouterr().out
