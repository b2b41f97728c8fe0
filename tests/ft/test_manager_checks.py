"""Bad configurations and hostile input to the quorum service, in one process (managers of one rank each)."""

from __future__ import annotations

import io
import pickle
import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise.ft as ft
from shardwise.ft import Lighthouse, QuorumRule


def _manager(address: str, rid: str, **kwargs: Any) -> ft.Manager:
    return ft.Manager(lighthouse_addr=address, replica_id=rid, rank=0, world_size=kwargs.pop("world_size", 1),
                      timeout=timedelta(seconds=2), **kwargs)


def _as_torchrun_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")


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


def test_a_replicate_dim_not_outermost_and_other_bad_meshes_or_checkpoints_are_value_errors_naming_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _as_torchrun_rank(monkeypatch)
    with Lighthouse(log=io.StringIO()) as lighthouse:
        manager = _manager(lighthouse.address, "a", world_size=2)
        for shape, names, dim, says in [
                ((2, 1), ("dp_shard", "dp_replicate"), 1, r"replicate_dim=1\) \('dp_replicate'\): .* must be the outermost"),
                ((2, 2), None, 0, "the replicate dim has size 2; .* give 1"),
                ((1, 4), None, 0, "4 ranks, but this replica group has 2"),
                ((2,), None, 0, "a replicate dim and at least one dim inside each group")]:
            with pytest.raises(ValueError, match=says):
                ft.ft_init_device_mesh("cpu", shape, names, replicate_dim=dim, manager=manager)
        with pytest.raises(TypeError, match="a shardwise.ft.Manager is expected"):
            ft.ft_init_device_mesh("cpu", (1, 2), manager=object())  # type: ignore[arg-type]
        manager.shutdown()
        for bad in (dict(checkpoint_every=5), dict(checkpoint_dir="/tmp/x"), dict(checkpoint_dir="/x", checkpoint_every=-1)):
            with pytest.raises(ValueError, match="give both"):
                _manager(lighthouse.address, "b", **bad)


def test_a_manager_of_a_group_of_two_made_outside_any_world_or_launch_is_a_value_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with Lighthouse(log=io.StringIO()) as lighthouse, pytest.raises(ValueError, match="outside torchrun"):
        _manager(lighthouse.address, "a", world_size=2)


def test_a_group_of_another_shape_is_refused_by_name_and_the_others_go_on(monkeypatch: pytest.MonkeyPatch,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    _as_torchrun_rank(monkeypatch)  # (b: rank 0 of a group of 2, before its world)
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.1), log=io.StringIO()) as lighthouse:
        a = _manager(lighthouse.address, "a", quorum_timeout=timedelta(seconds=5))
        a.start_quorum()
        assert a.should_commit() and a.current_step() == 1
        b = _manager(lighthouse.address, "b", world_size=2)  # (as its rank 0: it asks for its group of 2)
        with pytest.raises(ValueError, match="replica group b has 2 ranks and the others 1"):
            b.start_quorum()
        a.start_quorum()
        assert a.should_commit() and a.num_participants() == 1 and a.current_step() == 2
        a.shutdown()  # finished: it does not stay for b, refused (alive, never to ask again)
        b.shutdown()
    assert "after quorum_timeout" not in capfd.readouterr().err


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


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.bfloat16), (torch.float32,), (torch.bfloat16, torch.float16)],
                         ids=["float64-carries-the-count", "float32-carries-it", "no-carrier"])
def test_reduce_gradients_weights_by_samples_whatever_carries_the_count(dtypes: tuple[torch.dtype, ...]) -> None:
    # one member: the packing alone (the count riding in a float buffer, or a reduction of its own),
    # each gradient back in place as (g * samples) / total
    with Lighthouse(rule=QuorumRule(min_replicas=1, join_timeout=0.1), log=io.StringIO()) as lighthouse:
        a = _manager(lighthouse.address, "a")
        a.start_quorum()
        a.samples = 3
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(n, generator=gen).to(dtypes[k % len(dtypes)]) for k, n in enumerate((5, 7, 1, 4))]
        want = [(g * 3.0) / 3.0 for g in grads]
        a.reduce_gradients(grads)
        assert a.errored() is None and all(torch.equal(g, w) for g, w in zip(grads, want)), (grads, want)
        a.shutdown()
