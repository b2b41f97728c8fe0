"""Dispatch turns each plan type `_ops.make_plan` can return into its runner through one table.

`_dispatch._RUNNERS` has exactly one entry per member of `_ops.OpPlan` (a new plan type is one
entry there), and a plan of a type without an entry raises a `TypeError` that names the type
and the table, instead of falling through to some other runner.
"""

from __future__ import annotations

import typing

import pytest
import torch

from shardwise._ops import OpPlan
from shardwise._tensor import _dispatch


def test_every_plan_type_has_exactly_one_runner() -> None:
    assert set(_dispatch._RUNNERS) == set(typing.get_args(OpPlan))


def test_a_plan_type_without_a_runner_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class NewPlan:
        pass

    monkeypatch.setattr(_dispatch, "make_plan", lambda call: NewPlan())
    with pytest.raises(TypeError, match=r"NewPlan, a plan type with no runner: add one entry for it to _tensor._dispatch._RUNNERS"):
        _dispatch._make_plan(torch.ops.aten.add.Tensor, (torch.ones(2), torch.ones(2)), {}, frozenset())
