"""Placements are frozen, hashable values with a short `str` and a `repr` that round-trips."""

from __future__ import annotations

import copy
import doctest
import pickle

import pytest

import shardwise
from shardwise import Partial, Placement, Replicate, Shard, _placement

ALL = [Shard(0), Shard(1), Shard(-1), Replicate(), Partial(), Partial("avg"), Partial("max"), Partial("min")]
NAMES = {"Shard": Shard, "Replicate": Replicate, "Partial": Partial}


def test_equality_is_by_kind_and_value() -> None:
    assert Shard(0) == Shard(0)
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum")
    assert Partial("sum") != Partial("max")
    # different kinds never compare equal, whatever the payload
    for i, a in enumerate(ALL):
        for j, b in enumerate(ALL):
            assert (a == b) == (i == j), (a, b)
            assert (a != b) == (i != j), (a, b)
    assert Shard(0) != 0 and Replicate() != "R" and Partial() != "sum"


def test_hash_agrees_with_equality() -> None:
    assert hash(Shard(2)) == hash(Shard(2))
    assert hash(Partial("avg")) == hash(Partial("avg"))
    assert len(set(ALL + [Shard(0), Replicate(), Partial("sum")])) == len(ALL)
    table = {p: str(p) for p in ALL}
    assert table[Shard(1)] == "S(1)" and table[Partial()] == "P(sum)"


@pytest.mark.parametrize(
    ("placement", "text"),
    [(Shard(0), "S(0)"), (Shard(-1), "S(-1)"), (Replicate(), "R"), (Partial(), "P(sum)"), (Partial("avg"), "P(avg)")],
)
def test_str_is_short(placement: Placement, text: str) -> None:
    assert str(placement) == text


@pytest.mark.parametrize("placement", ALL, ids=str)
def test_repr_round_trips_through_eval(placement: Placement) -> None:
    again = eval(repr(placement), dict(NAMES))
    assert again == placement and type(again) is type(placement)
    assert repr(again) == repr(placement)


def test_repr_names_the_fields() -> None:
    assert repr(Shard(1)) == "Shard(dim=1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial("max")) == "Partial(reduce_op='max')"


@pytest.mark.parametrize("placement", ALL, ids=str)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trips(placement: Placement, protocol: int) -> None:
    again = pickle.loads(pickle.dumps(placement, protocol=protocol))
    assert again == placement and type(again) is type(placement) and hash(again) == hash(placement)


@pytest.mark.parametrize("placement", ALL, ids=str)
def test_copies_are_equal(placement: Placement) -> None:
    assert copy.copy(placement) == placement
    assert copy.deepcopy(placement) == placement


@pytest.mark.parametrize(
    ("placement", "field", "value"),
    [(Shard(0), "dim", 1), (Partial(), "reduce_op", "max"), (Replicate(), "anything", 1), (Shard(0), "extra", 1)],
)
def test_placements_are_frozen(placement: Placement, field: str, value: object) -> None:
    before = repr(placement)
    with pytest.raises(AttributeError):
        setattr(placement, field, value)
    assert repr(placement) == before


def test_placements_have_no_instance_dict() -> None:
    for p in ALL:
        assert not hasattr(p, "__dict__"), p


@pytest.mark.parametrize("op", ["mul", "SUM", "", "mean", "products"])
def test_partial_with_an_unknown_op_names_it_and_lists_the_valid_ones(op: str) -> None:
    with pytest.raises(ValueError) as err:
        Partial(op)
    message = str(err.value)
    assert repr(op) in message, message
    for valid in ("sum", "avg", "max", "min"):
        assert valid in message, message


@pytest.mark.parametrize("dim", ["0", 0.0, None, True, [0]])
def test_shard_takes_an_int_dim(dim: object) -> None:
    with pytest.raises(TypeError) as err:
        Shard(dim)  # type: ignore[arg-type]
    assert repr(dim) in str(err.value)


def test_predicates() -> None:
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert not Shard(0).is_replicate() and not Shard(0).is_partial()
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial().is_partial() and not Partial().is_shard() and not Partial().is_replicate()


def test_reduce_op_is_kept() -> None:
    assert [Partial(op).reduce_op for op in ("sum", "avg", "max", "min")] == ["sum", "avg", "max", "min"]
    assert Partial().reduce_op == "sum"
    assert Shard(3).dim == 3


def test_public_names_are_the_placement_classes() -> None:
    assert shardwise.Shard is Shard and shardwise.Replicate is Replicate and shardwise.Partial is Partial
    assert all(isinstance(p, shardwise.Placement) for p in ALL)


def test_placement_module_doctests_pass() -> None:
    result = doctest.testmod(_placement)
    assert result.attempted >= 2 and result.failed == 0, result


def test_partial_takes_torchs_spelling_product_for_prod() -> None:
    assert Partial("product") == Partial("prod") and str(Partial("product")) == "P(prod)"
