"""A replica group's state as tensors plus a JSON header: what healing sends, and nothing that runs code.

A state is a tree of dicts (string or integer keys), lists, tuples, tensors and JSON
scalars (None, bool, int, float, str): a model's and an optimizer's `state_dict()`, a step
count, RNG states. `pack` turns it into a header (the tree, with each tensor replaced by its
dtype, shape and, for a DTensor, its layout) and the list of tensors (a DTensor's local
piece). The header travels as UTF-8 JSON bytes, the tensors as they are, in chunks. `unpack`
reads a header that must be JSON of exactly that shape (anything else is refused with the
path of the first bad node), allocates each tensor from an allow-listed dtype and a checked
size, and rebuilds DTensors on the receiver's own mesh (that of its current state at the same
path, or the one mesh of its state for a value it does not hold yet, such as a new
optimizer's moments): replica groups have the same shape, so each rank receives the pieces
it holds.

| node | header |
|---|---|
| dict | `{"d": [[key, node], ...]}` |
| list / tuple | `{"l": [...]}` / `{"u": [...]}` |
| scalar | `{"v": value}` |
| tensor | `{"t": index, "dtype": "float32", "shape": [..]}` (+ `"placements"`, `"global"` for a DTensor) |
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves

from .._layout import contiguous_strides
from .._placement import Placement, Replicate, Shard
from .._tensor import DTensor

__all__ = ["MAX_HEADER_BYTES", "pack", "unpack"]

MAX_HEADER_BYTES = 64 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def pack(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """(header, tensors) of `state`; TypeError naming the path of a node it cannot send."""
    tensors: list[torch.Tensor] = []

    def node(x: Any, path: str) -> Any:
        if isinstance(x, DTensor):
            local = x.to_local().detach()
            tensors.append(local.contiguous())
            return {"t": len(tensors) - 1, "dtype": _dtype_name(local, path), "shape": list(local.shape),
                    "global": list(x.shape), "placements": [str(p) for p in x.placements]}
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().contiguous())
            return {"t": len(tensors) - 1, "dtype": _dtype_name(x, path), "shape": list(x.shape)}
        if isinstance(x, Mapping):
            for k in x:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"state at {path}: key {k!r} ({type(k).__name__}); keys must be str or int")
            return {"d": [[k, node(v, f"{path}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "u": [node(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        raise TypeError(f"state at {path}: a {type(x).__name__} cannot be sent to a healing group (tensors, dicts, "
                        "lists, tuples and None/bool/int/float/str can); keep it out of state_dict() or convert it")

    header = json.dumps(node(state, "state")).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"the state's header is {len(header)} bytes, over {MAX_HEADER_BYTES}: too many entries")
    return header, tensors


def unpack(header: bytes, like: Any) -> tuple[Any, list[torch.Tensor]]:
    """(state with empty tensors, those tensors in order) from a received `header`, DTensors
    rebuilt on the meshes of the DTensors at the same paths in `like` (the receiver's state);
    ValueError naming the path of the first node that is not what `pack` writes."""
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"a state header of {len(header)} bytes, over {MAX_HEADER_BYTES}: refused")
    try:
        tree = json.loads(header.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a state header that is not UTF-8 JSON: {exc}") from None
    buffers: list[torch.Tensor] = []
    meshes: list[Any] = []  # the distinct meshes of the receiver's DTensors
    for t in tree_leaves(like):
        if isinstance(t, DTensor) and not any(t.device_mesh == m for m in meshes):
            meshes.append(t.device_mesh)

    def node(h: Any, mirror: Any, path: str) -> Any:
        if not isinstance(h, dict) or len(h) == 0:
            raise ValueError(f"state header at {path}: {str(h)[:80]} is not a node")
        if "t" in h:
            return tensor(h, mirror, path)
        (kind, body), = h.items() if len(h) == 1 else [("?", None)]
        if kind == "v" and (body is None or isinstance(body, (bool, int, float, str))):
            return body
        if kind in ("l", "u") and isinstance(body, list):
            items = [node(v, _child(mirror, i), f"{path}[{i}]") for i, v in enumerate(body)]
            return items if kind == "l" else tuple(items)
        if kind == "d" and isinstance(body, list) and all(isinstance(e, list) and len(e) == 2 and isinstance(
                e[0], (str, int)) and not isinstance(e[0], bool) for e in body):
            return {k: node(v, _child(mirror, k), f"{path}[{k!r}]") for k, v in body}
        raise ValueError(f"state header at {path}: {str(h)[:80]} is not a node")

    def tensor(h: dict[str, Any], mirror: Any, path: str) -> torch.Tensor:
        dtype, shape = _DTYPES.get(str(h.get("dtype"))), h.get("shape")
        if h.get("t") != len(buffers) or dtype is None or not isinstance(shape, list) or not _sizes(shape):
            raise ValueError(f"state header at {path}: tensor {str(h)[:120]} (its index must be {len(buffers)}, its "
                             f"dtype one of {sorted(_DTYPES)}, its shape non-negative integers)")
        local = torch.empty(shape, dtype=dtype)
        buffers.append(local)
        if "placements" not in h:
            return local
        whole = h.get("global")
        if not isinstance(whole, list) or not _sizes(whole):
            raise ValueError(f"state at {path}: a DTensor's global shape {str(whole)[:80]}: non-negative integers")
        placements = tuple(_placement(p, path) for p in h["placements"])
        if isinstance(mirror, DTensor):
            if placements != tuple(mirror.placements) or list(mirror.shape) != whole:
                raise ValueError(f"state at {path}: the sender's layout {h['placements']} of {whole} differs from "
                                 f"this group's {[str(p) for p in mirror.placements]} of {list(mirror.shape)}")
            return DTensor.from_local(local, mirror.device_mesh, placements, shape=mirror.shape,
                                      stride=mirror.stride(), run_check=False)
        if mirror is not None or len(meshes) != 1:  # (a state this group does not hold yet: optimizer moments)
            raise ValueError(f"state at {path}: the sender holds a DTensor here, this group "
                             f"{'a ' + type(mirror).__name__ if mirror is not None else 'nothing'}"
                             f"{'' if mirror is not None else f' and its state has {len(meshes)} meshes'}; replica "
                             "groups must shard their state alike")
        return DTensor.from_local(local, meshes[0], placements, shape=whole, stride=contiguous_strides(whole),
                                  run_check=False)

    return node(tree, like, "state"), buffers


def _child(mirror: Any, key: Any) -> Optional[Any]:
    try:
        return mirror[key] if mirror is not None else None
    except (KeyError, IndexError, TypeError):
        return None


def _sizes(shape: Any) -> bool:
    return isinstance(shape, list) and len(shape) <= 64 and all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40 for n in shape)


def _dtype_name(t: torch.Tensor, path: str) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"state at {path}: dtype {t.dtype} cannot be sent (one of {sorted(_DTYPES)})")
    return name


def _placement(text: Any, path: str) -> Placement:
    if text == "R":
        return Replicate()
    if isinstance(text, str) and text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return Shard(int(text[2:-1]))
    raise ValueError(f"state at {path}: placement {str(text)[:40]!r}: R or S(d) expected")
