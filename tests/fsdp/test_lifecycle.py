"""A `fully_shard` call's training state and its unit's parameter state move by one table each.

The tables (`_lifecycle`) answer every call in every state they list and nothing else; a step
walks the states FSDP2 names (IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD ->
IDLE; SHARDED -> GATHERING / UNSHARDED -> SHARDED). A forward after a backward that raised
and was not reset used to run on with the unit marked as mid-backward (its next backward
skipped the gather it needs); now it raises, naming the unit, the state, the call and the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise.fsdp._lifecycle import PARAMS, TRAINING, TrainingState, TransitionError, UnitState, advance
from shardwise.fsdp._state import state_of
from shardwise.testing import distributed

from .test_fully_shard import ROWS, _batches, _model, _ours


def test_every_row_leads_to_a_state_of_its_own_machine() -> None:
    for table, states in ((TRAINING, TrainingState), (PARAMS, UnitState)):
        for call, row in table.moves.items():
            assert row, call
            assert all(isinstance(a, states) and isinstance(b, states) for a, b in row.items()), call
        assert set(table.fixes) <= set(table.moves)


def test_a_call_in_a_state_its_row_does_not_list_names_the_unit_the_state_and_the_call() -> None:
    assert advance("u", TRAINING, TrainingState.IDLE, "pre_forward") is TrainingState.FORWARD
    assert advance("u", TRAINING, TrainingState.PRE_BACKWARD, "last post_backward") is TrainingState.POST_BACKWARD
    assert advance("u", PARAMS, UnitState.SHARDED_POST_FORWARD, "start_gather") is UnitState.GATHERING
    with pytest.raises(TransitionError, match=r"^fully_shard unit 'Block': pre_forward in training state POST_BACKWARD "
                                              r"\(allowed in IDLE, FORWARD\): .* call reset_iter_state\(\)"):
        advance("fully_shard unit 'Block'", TRAINING, TrainingState.POST_BACKWARD, "pre_forward")
    with pytest.raises(TransitionError, match=r"^u: views in parameters SHARDED \(allowed in UNSHARDED\): .*unshard"):
        advance("u", PARAMS, UnitState.SHARDED, "views")


def _states(model: nn.Module) -> list[Any]:
    found = [state_of(m) for m in model.modules()]
    return [s for s in found if s is not None]


@distributed(world_size=2)
def test_a_step_walks_the_states_and_a_forward_after_an_unreset_failed_backward_raises() -> None:
    model: Any = _ours(_model(), (2,))
    x = _batches(2, torch.float64, steps=1)[0][:ROWS]
    seen: list[tuple[str, TrainingState, UnitState]] = []
    block = model.blocks[1]
    state = state_of(block)
    assert state is not None and state.unit is not None
    block.register_forward_pre_hook(lambda m, a: seen.append(("in forward", state.training, state.unit.state)))
    loss = model(x).square().mean()
    seen.append(("after forward", state.training, state.unit.state))
    loss.backward()
    seen.append(("after backward", state.training, state.unit.state))
    # (the pre-hook runs after fully_shard's, which gathered the unit)
    assert seen == [("in forward", TrainingState.FORWARD, UnitState.UNSHARDED),
                    ("after forward", TrainingState.IDLE, UnitState.SHARDED),
                    ("after backward", TrainingState.IDLE, UnitState.SHARDED)]

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    hook = model.blocks[1].register_forward_hook(lambda m, a, out: [out.register_hook(fail), out][1])
    with pytest.raises(RuntimeError, match="boom"):
        model(x).square().mean().backward()
    hook.remove()
    assert TrainingState.PRE_BACKWARD in {s.training for s in _states(model)}
    with pytest.raises(TransitionError, match=r"fully_shard unit '.*': pre_forward in training state PRE_BACKWARD "
                                              r".* call reset_iter_state\(\) on the root module"):
        model(x)
    model.reset_iter_state()
    assert {(s.training, s.unit.state) for s in _states(model)} == {(TrainingState.IDLE, UnitState.SHARDED)}
    model(x).square().mean().backward()  # the next step runs
    with pytest.raises(TransitionError, match=r"views in parameters SHARDED"):
        state.unit.views()
