"""`Namespace`: a label that keeps skips of the same name apart.

Skip names are plain strings chosen by the author of a layer, so two copies of one
layer (two encoder/decoder pairs of a U-Net) stash the same name. Isolating each pair
in its own `Namespace` makes the pairs distinct: a skip is identified by
`(namespace, name)`. The default namespace is `None`, which counts as a `Namespace`
for `isinstance`. Namespaces are hashable and totally ordered (by a random id), so
routes can be sorted deterministically; a copy compares equal to its original.

>>> a, b = Namespace("enc1"), Namespace("enc2")
>>> a == a, a == b, isinstance(None, Namespace)
(True, False, True)
>>> import copy
>>> copy.copy(a) == a
True
"""

from __future__ import annotations

import abc
import uuid
from typing import Optional

__all__ = ["Namespace"]


class Namespace(metaclass=abc.ABCMeta):
    """A namespace for skip names; `label` only makes printed layouts readable."""

    __slots__ = ("_id", "label")

    def __init__(self, label: Optional[str] = None) -> None:
        self._id = uuid.uuid4()
        self.label = label

    def __repr__(self) -> str:
        tag = self.label if self.label is not None else self._id.hex[:8]
        return f"<Namespace '{tag}'>"

    def __hash__(self) -> int:
        return hash(self._id)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Namespace) and other is not None:
            return self._id == other._id
        return NotImplemented

    def __lt__(self, other: Namespace) -> bool:
        if isinstance(other, Namespace) and other is not None:
            return self._id < other._id
        return NotImplemented

    def __copy__(self) -> Namespace:
        twin = Namespace.__new__(Namespace)
        twin._id, twin.label = self._id, self.label
        return twin

    def __deepcopy__(self, memo: dict[int, object]) -> Namespace:
        return self.__copy__()


# The default namespace of every skip is None; it must pass `isinstance(ns, Namespace)`.
Namespace.register(type(None))


def sort_key(ns: Optional[Namespace]) -> str:
    """A total order over namespaces including the default one (`None` first)."""
    return "" if ns is None else ns._id.hex
