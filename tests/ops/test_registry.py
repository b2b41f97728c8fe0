"""The one op-rule registry: one rule per overload and mode, answers independent of imports.

The central check runs `tests/ops/registry_probe.py` in two fresh interpreters, one with
only `shardwise._ops` imported (the package's `__init__`, which imports every layer, is
stood in for) and one after `import shardwise`, and compares every propagation answer
for calls that reach every registered op, under no mode and under each mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise import AbstractMesh, Replicate, Shard
from shardwise._ops import (
    LocalCall,
    OpKind,
    OpSchema,
    OpStrategy,
    active_modes,
    op_mode,
    propagate,
    register_op_kind,
    register_op_strategy,
    registered_ops,
    registered_rules,
    rule_for,
    strategy_calls,
)
from shardwise._ops._loss_parallel import LOSS_PARALLEL
from shardwise._spec import DTensorSpec, TensorMeta

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]


def _probes(*hows: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each probe's answers, the probes run side by side (fresh interpreters)."""
    running = [subprocess.Popen([sys.executable, "-m", "tests.ops.registry_probe", *how], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for how in hows]
    found = []
    try:
        for p in running:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            found.append(json.loads(out))
    finally:
        for p in running:
            p.kill()
    return found


def test_ops_answers_the_same_whatever_else_is_imported() -> None:
    alone, everything = _probes(("ops", str(ROOT / "src")), ("all",))
    # the first interpreter really had only the op layer and what it stands on
    assert "shardwise._tensor" not in alone["layers"] and "shardwise.parallel" not in alone["layers"], alone["layers"]
    assert "shardwise._tensor" in everything["layers"]
    assert alone["registered"] == everything["registered"]
    # every registered op got at least one sampled call
    assert set(alone["registered"]) <= set(alone["reached"]), sorted(set(alone["registered"]) - set(alone["reached"]))
    answered = {k.split(" | ")[0] for k, v in alone["answers"].items() if not v.startswith("error")}
    assert len(answered) >= 0.9 * len(alone["registered"]), len(answered)
    assert alone["answers"].keys() == everything["answers"].keys()
    differ = [k for k, v in alone["answers"].items() if everything["answers"][k] != v]
    assert not differ, "answers that depend on imports:\n" + "\n".join(
        f"{k}\n  _ops alone: {alone['answers'][k]}\n  everything: {everything['answers'][k]}" for k in differ[:5])


def _never(schema: OpSchema) -> OpStrategy:
    raise AssertionError("never called")


def test_a_second_rule_for_an_overload_is_refused_naming_both_places() -> None:
    with pytest.raises(ValueError, match=r"aten\.mm\.default already has a rule, registered at "
                                         r"shardwise/_ops/_matmul\.py:\d+; a second one at .*test_registry\.py:\d+"):
        register_op_strategy(aten.mm.default)(_never)
    with pytest.raises(ValueError, match=r"aten\._log_softmax\.default under mode 'loss_parallel' already has a rule"):
        register_op_strategy(aten._log_softmax.default, mode=LOSS_PARALLEL)(_never)
    with pytest.raises(ValueError, match="already has a rule"):
        register_op_kind(aten.nonzero.default, OpKind.REPLICATED)
    assert rule_for(aten.mm.default).strategy is not _never


def test_register_op_kind_registers_only_replicated_rules() -> None:
    with pytest.raises(ValueError, match="give other kinds a strategy"):
        register_op_kind(aten.mm.default, OpKind.SHARDED)


def test_every_overload_has_at_most_one_rule_per_mode() -> None:
    keys = [(r.op, r.mode) for r in registered_rules()]
    assert len(keys) == len(set(keys))
    assert len(registered_ops()) > 1000


def test_kinds_say_how_an_op_runs() -> None:
    assert rule_for(aten.mm.default).kind is OpKind.SHARDED
    assert rule_for(aten.add.Tensor).kind is OpKind.POINTWISE
    assert rule_for(aten.view.default).kind is OpKind.VIEW
    assert rule_for(aten.nonzero.default).kind is OpKind.REPLICATED
    assert rule_for(aten.squeeze_.dim).relayout and rule_for(aten.resize_.default).relayout
    assert not rule_for(aten.squeeze.dim).relayout
    assert rule_for(aten._chunk_cat.default).kind is OpKind.DECOMPOSED  # no rule, a decomposition
    assert rule_for(aten.segment_reduce.default).kind is OpKind.FALLBACK  # neither
    assert rule_for(aten.uniform_.default).local is not None  # draws from the placement-invariant generator
    assert "uniform_" in str(rule_for(aten.uniform_.default)) and "local" in str(rule_for(aten.uniform_.default))


def _logits(mesh_shape: tuple[int, ...] = (4,)) -> DTensorSpec:
    meta = TensorMeta(torch.Size([8, 10]), (10, 1), torch.float32)
    return DTensorSpec(AbstractMesh(mesh_shape), (Shard(1),), meta)


def test_a_mode_switches_to_the_variant_and_is_part_of_the_cache_key() -> None:
    schema = OpSchema(aten._log_softmax.default, (_logits(), 1, False))
    base = rule_for(aten._log_softmax.default)
    assert base.mode is None and LOSS_PARALLEL not in active_modes()
    outside = propagate(schema)
    with op_mode(LOSS_PARALLEL):
        variant = rule_for(aten._log_softmax.default)
        assert variant.mode == LOSS_PARALLEL and variant.plain_as_replicated and variant.local is not None
        inside = propagate(schema)
    assert outside.output_spec.placements == (Shard(0),)  # type: ignore[union-attr]
    assert inside.input_specs == (None,) and inside.output_spec.placements == (Shard(1),)  # type: ignore[union-attr]
    calls = strategy_calls()
    assert propagate(schema) == outside  # both answers stay cached, side by side
    with op_mode(LOSS_PARALLEL):
        assert propagate(schema) == inside
    assert strategy_calls() == calls
    # an op without a variant answers the same under the mode (one cache entry)
    mm = OpSchema(aten.mm.default, (_logits(), DTensorSpec(AbstractMesh((4,)), (Replicate(),),
                                                           TensorMeta(torch.Size([10, 3]), (3, 1), torch.float32))))
    with op_mode(LOSS_PARALLEL):
        assert rule_for(aten.mm.default) is rule_for(aten.mm.default, frozenset())
        assert propagate(mm) == propagate(mm, rule_for(aten.mm.default, frozenset()))


def test_local_call_reads_arguments_by_position_or_name() -> None:
    call = LocalCall(aten.add.Tensor, [torch.ones(2)], {"other": torch.ones(2), "alpha": 2}, (), None, None)  # type: ignore[arg-type]
    assert call.arg(2, "alpha") == 2 and call.arg(5, "missing", "dflt") == "dflt"
    assert torch.equal(call.run_op(), torch.full((2,), 3.0))
