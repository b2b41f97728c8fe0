"""`CommCounter`: collectives per module path, forward and backward apart, equal to `comm_log()`.

The demo's GPT under its Megatron plan on a (4,) tp mesh, and on a (2, 2) dp x tp mesh with
ZeRO-3 over dp: one training step (forward, loss_parallel loss, backward) inside both a
`comm_log()` and a `CommCounter(model)`. The counter's totals per collective kind (count
and bytes received) equal the log's, split by pass as the log's records fall before and
after `backward()`; each block's row-parallel projections own exactly one forward
all_reduce, of the activation's bytes; the printed tree names them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.debug import CommCounter
from shardwise.testing import distributed


def _gpt(mesh: Any, shard_parameters: bool) -> Any:
    from shardwise._demo.model import CharGPT, CharGPTConfig
    from shardwise._demo.train import manual_plan
    from shardwise.parallel import data_parallel, parallelize_module

    torch.manual_seed(0)
    model = CharGPT(CharGPTConfig(vocab=16, d_model=32, seq=8))
    parallelize_module(model, mesh["tp"], manual_plan(), replicate_rest=True)
    if "dp" in (mesh.mesh_dim_names or ()):
        data_parallel(model, mesh, dp_dim="dp", shard_parameters=shard_parameters)
    return model


def _tally(records: list[Any]) -> dict[str, tuple[int, int]]:
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for r in records:
        count[r.op] += 1
        size[r.op] += r.bytes_received
    return {k: (count[k], size[k]) for k in sorted(count)}


@pytest.mark.parametrize(("shape", "names"), [((4,), ("tp",)), ((2, 2), ("dp", "tp"))], ids=["tp4", "dp2-tp2-zero3"])
@distributed(world_size=4)
def test_the_counter_agrees_with_the_log_module_by_module(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    from shardwise._demo.model import loss_fn
    from shardwise.parallel import loss_parallel

    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _gpt(mesh, shard_parameters=True)
    x, y = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
    with sw.comm_log() as log, CommCounter(model) as counter:
        with loss_parallel():
            loss = loss_fn(model(x), y)
            forward = len(log)
            loss.backward()
    assert counter.totals() == _tally(log)
    assert counter.totals("forward") == _tally(log[:forward])
    assert counter.totals("backward") == _tally(log[forward:])
    tp, tokens = mesh.size("tp"), 4 * 8
    table = counter.to_dict()
    for block in range(2):  # a row-parallel projection's output: one all_reduce of the activation
        for layer in ("attn.proj", "mlp.down"):
            got = table[f"blocks.{block}.{layer}"]["forward"]
            assert set(got) == {"all_reduce"} and got["all_reduce"]["count"] == 1, (layer, got)
            assert got["all_reduce"]["bytes"] == 2 * (tp - 1) * tokens * 32 * 4 // tp, (layer, got)
    text = str(counter)
    assert "proj" in text and "down" in text and text.splitlines()[-1].startswith("total")


@distributed(world_size=4)
def test_without_a_model_everything_is_counted_under_the_root() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.randn(8, 4), mesh, [sw.Shard(0)])
    with sw.comm_log() as log, CommCounter() as counter:
        x.full_tensor()
        x.redistribute(mesh, [sw.Replicate()]).sum()
    assert _tally(log)["all_gather"][0] == 2
    assert list(counter.to_dict()) == [""] and counter.totals() == _tally(log)


def test_a_counter_follows_modules_only() -> None:
    with pytest.raises(TypeError, match=r"CommCounter follows an nn.Module's submodules, got str"):
        CommCounter("model")  # type: ignore[arg-type]
