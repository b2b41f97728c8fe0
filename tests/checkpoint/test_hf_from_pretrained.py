"""`shardwise.parallel.from_pretrained`: transformers' loading, sharded on read, on 4 gloo ranks.

A small seeded Llama (4 key/value heads, so that its own plan splits them over 4 ranks)
written by transformers' own `save_pretrained` in several safetensors files is loaded by `from_pretrained(AutoModelForCausalLM, path, device_mesh=mesh,
tp_plan="auto", fsdp=...)` with the model's own plan over 4 tp ranks, and with FSDP x TP on
a (dp=2, tp=2) mesh. Against it, on every rank: transformers' `from_pretrained(path)` in
one process, then the same sharding by hand (`HFPlanner` on the tp dim, `fully_shard` on
the dp dim per decoder layer and at the root). Every parameter and buffer must have the same
layout and, gathered, the same bits; the logits of a forward must be equal bit for bit; and
each rank must have read no more than 1.05x the bytes of its own pieces (counted by the
reader `load_pretrained` makes, whose count `test_hf_read.py` checks against the kernel's).
`dtype="auto"` with no dtype in the config takes the files' (bf16), as transformers does.
Bad inputs (torch's mesh, a plan entry naming no module, a missing directory, a mesh without
the dims asked for) are errors naming the argument and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.parallel import HFPlanner, from_pretrained, parallelize_module
from shardwise.testing import run_distributed

from .conftest import LLAMA as _CONFTEST_LLAMA

transformers = pytest.importorskip("transformers")

LLAMA = {**_CONFTEST_LLAMA, "num_key_value_heads": 4}  # the model's own plan splits heads: 4 ranks need 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-kv4")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    return path

# name -> (mesh shape, mesh dim names, fsdp=)
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], Optional[str]]] = {
    "tp4-auto": ((4,), ("tp",), None),
    "fsdp2-x-tp2": ((2, 2), ("dp", "tp"), "dp"),
}


@contextmanager
def _counted_readers() -> Iterator[list[Any]]:
    """Every HuggingFaceStorageReader `load_pretrained` makes meanwhile, to read its `bytes_read`."""
    from shardwise.checkpoint import _hf_read

    made: list[Any] = []
    original = _hf_read.HuggingFaceStorageReader

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    _hf_read.HuggingFaceStorageReader = Counted  # type: ignore[misc]
    try:
        yield made
    finally:
        _hf_read.HuggingFaceStorageReader = original  # type: ignore[misc]


def _shard_by_hand(model: Any, mesh: sw.DeviceMesh, fsdp: Optional[str]) -> None:
    """The sharding from_pretrained applies, applied to a loaded model."""
    parallelize_module(model, mesh if mesh.ndim == 1 else mesh["tp"], HFPlanner())
    if fsdp is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh[fsdp])
        fully_shard(model, mesh=mesh[fsdp])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _layout(t: torch.Tensor) -> Any:
    return (type(t).__name__, t.dtype, tuple(t.placements) if isinstance(t, sw.DTensor) else None)


def _local_bytes(state: dict[str, Any]) -> int:
    return sum((t.to_local() if isinstance(t, sw.DTensor) else t).nbytes for t in state.values())


def _load(path: str, layout: str) -> tuple[int, int]:
    shape, names, fsdp = LAYOUTS[layout]
    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    with _counted_readers() as readers:
        model = from_pretrained(transformers.AutoModelForCausalLM, path, device_mesh=mesh, tp_plan="auto", fsdp=fsdp)
    assert type(model).__name__.endswith("LlamaForCausalLM") and not model.training
    want = transformers.LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        one_process = want(input_ids=ids).logits
    _shard_by_hand(want, mesh, fsdp)

    got_tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    want_tensors = {**dict(want.named_parameters()), **dict(want.named_buffers())}
    assert set(got_tensors) == set(want_tensors)
    assert any(isinstance(t, sw.DTensor) for t in got_tensors.values())  # sharded, not plain
    for name, value in want_tensors.items():
        assert _layout(got_tensors[name]) == _layout(value), (name, _layout(got_tensors[name]), _layout(value))
        assert torch.equal(_full(got_tensors[name]), _full(value)), name
    with torch.no_grad():
        got, expected = model(input_ids=ids).logits, want(input_ids=ids).logits
    assert torch.equal(_full(got), _full(expected)), float((_full(got) - _full(expected)).abs().max())
    assert torch.allclose(_full(got), one_process, rtol=1e-5, atol=1e-6)  # and the model is the one process's

    assert len(readers) == 1, readers
    return readers[0].bytes_read, _local_bytes(model.state_dict())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_from_pretrained_on_a_shardwise_mesh_equals_transformers_then_sharding_and_reads_only_own_bytes(
        llama_dir: Path, layout: str) -> None:
    results = run_distributed(_load, 4, str(llama_dir), layout, timeout=300)
    whole = sum(t.nbytes for t in transformers.LlamaForCausalLM.from_pretrained(llama_dir).state_dict().values())
    for rank, (read, own) in enumerate(results):
        assert 0 < read <= 1.05 * own, (layout, rank, read, own)
    assert max(read for read, _ in results) < whole / 2  # no rank reads the whole model
    print(f"\n{layout}: bytes read per rank {[r for r, _ in results]}, own pieces {[o for _, o in results]}, "
          f"whole {whole}")


def _from_files_dtype(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = from_pretrained(transformers.LlamaForCausalLM, path, device_mesh=mesh, tp_plan="auto")
    want = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
    got = model.state_dict()
    for name, value in want.items():
        assert got[name].dtype == value.dtype == torch.bfloat16 and torch.equal(_full(got[name]), value), name


def test_dtype_auto_with_none_in_the_config_is_the_files_dtype_as_in_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("dtype") == "bfloat16"  # the files' dtype is then all that tells
    (tmp_path / "config.json").write_text(json.dumps(config))
    run_distributed(_from_files_dtype, 2, str(tmp_path), timeout=300)


def _bad_inputs(path: str, missing: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    auto = transformers.AutoModelForCausalLM
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with pytest.raises(TypeError, match=r"device_mesh=\.\.\.\) got .*torch's.*shardwise"):
        from_pretrained(auto, path, device_mesh=torch_mesh("cpu", (2,)), tp_plan="auto")
    with pytest.raises(ValueError, match=r"(?s)name no module or parameter of LlamaForCausalLM.*"
                                         r"'model\.layers\.\*\.mlp\.upproj' \(did you mean 'model\.layers\.\*\.mlp\.up_proj'"):
        from_pretrained(auto, path, device_mesh=mesh, tp_plan={"model.layers.*.mlp.upproj": "colwise"})
    with pytest.raises(ValueError, match=r"not a directory: pass the directory transformers' save_pretrained wrote"):
        from_pretrained(auto, missing, device_mesh=mesh, tp_plan="auto")
    with pytest.raises(ValueError, match=r"(?s)fsdp='dp' is not a dim of the mesh.*name its tensor-parallel dim 'tp'"):
        from_pretrained(auto, path, device_mesh=sw.init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")),
                        tp_plan="auto", fsdp="dp")
    with pytest.raises(ValueError, match=r"neither tp_plan nor fsdp"):
        from_pretrained(auto, path, device_mesh=mesh)
    with pytest.raises(ValueError, match=r"'model\.norm'.*'scatter'"):  # a style transformers' plans do not have
        from_pretrained(auto, path, device_mesh=mesh, tp_plan={"model.norm": "scatter"})
    with pytest.raises(TypeError, match=r"does not take device_map="):
        from_pretrained(auto, path, device_mesh=mesh, tp_plan="auto", device_map="cpu")
    with pytest.raises(TypeError, match=r"a transformers model class .* got 'llama'"):
        from_pretrained("llama", path, device_mesh=mesh, tp_plan="auto")


def test_bad_inputs_are_errors_that_name_the_argument_and_the_fix(llama_dir: Path, tmp_path: Path) -> None:
    run_distributed(_bad_inputs, 2, str(llama_dir), str(tmp_path / "not-there"), timeout=300)
