"""Key paths: a nested state dict as a flat list of (path, leaf), and the leaves put back.

A model's state dict is flat, but an optimizer's nests: per-parameter state under int ids
and a list of param groups holding tuples (`betas`). A checkpoint stores leaves, each under
its *path*, the keys and indices that lead to it from the top:
`("optim", "state", 0, "exp_avg")`. Dicts, lists and tuples are walked; anything else
(tensors, numbers, strings, None) is a leaf. Paths keep int keys ints (they travel as JSON
lists), so `state.0` of an optimizer and a module named "0" cannot be confused.

>>> sd = {"w": 1, "opt": {"state": {0: {"step": 2}}, "groups": [{"betas": (0.9, 0.99)}]}}
>>> [(show(p), v) for p, v in leaves(sd)]
[('w', 1), ('opt.state.0.step', 2), ('opt.groups.0.betas.0', 0.9), ('opt.groups.0.betas.1', 0.99)]
>>> put_back(sd, lambda path, leaf: leaf * 10)["opt"]["groups"][0]["betas"]
(9.0, 9.9)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Union

__all__ = ["Key", "Path", "is_stateful", "leaves", "put_back", "show"]

Key = Union[str, int]
Path = tuple[Key, ...]


def show(path: Path) -> str:
    """The path as people write it: keys joined by dots."""
    return ".".join(str(k) for k in path)


def _check_key(key: object, where: Path) -> Key:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        place = f" under '{show(where)}'" if where else ""
        raise TypeError(
            f"state dict key {key!r} of type {type(key).__name__}{place} cannot be a checkpoint path: "
            f"use str or int keys"
        )
    return key


def is_stateful(value: object) -> bool:
    """A top-level value that gives and takes its own state dict (a module, an optimizer):
    save stores `value.state_dict()`; load fills that and hands it to `value.load_state_dict`."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def leaves(tree: Any, where: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of `tree` with its path, depth first in the containers' own order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, where + (_check_key(key, where),))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from leaves(value, where + (i,))
    else:
        yield where, tree


def put_back(tree: Any, new_leaf: Callable[[Path, Any], Any], where: Path = ()) -> Any:
    """`tree` with every leaf replaced by `new_leaf(path, leaf)`: dicts and lists in place,
    tuples (and named tuples) rebuilt, so the caller stores the returned value."""
    if isinstance(tree, dict):
        for key in list(tree):
            tree[key] = put_back(tree[key], new_leaf, where + (key,))
        return tree
    if isinstance(tree, list):
        for i, value in enumerate(tree):
            tree[i] = put_back(value, new_leaf, where + (i,))
        return tree
    if isinstance(tree, tuple):
        items = [put_back(value, new_leaf, where + (i,)) for i, value in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return new_leaf(where, tree)
