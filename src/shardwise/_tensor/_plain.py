"""Plain tensors that meet DTensors: taken as replicated, after the ranks agree they are.

A model makes tensors of its own inside its forward (position ids, masks, rotary tables,
constants); they are plain, the same on every rank, and meet DTensors. Such a tensor counts
as replicated on the DTensors' mesh, as under `implicit_replication()`, with no workaround.

A plain tensor can also be rank-local: a `to_local()` piece, a `use_local_output=True`
output, per-rank data. Taken as global it would be silently wrong, so the first time plain
tensors meet DTensors at an op *site* (the op, the modes, the DTensors' layouts and where
the plain tensors sit), the ranks of the mesh compare a fingerprint of each (shape and
three sums) and raise on every rank, naming the op, the argument and the ranks, when they
differ. The site key leaves out the plain tensors' shapes and the scalars, which may differ
between ranks, so every rank checks the same sites at the same time and none waits alone.
A site is checked once per sharded model, not once per process: sharding a module over a
mesh (`distribute_module`, `shard_module`, `parallelize_module`) forgets the sites checked
on that mesh and the meshes inside it (`forget_checks`; every rank of those meshes shards
the module too), so a second model meeting a rank-local tensor where an earlier one met a
replicated tensor still raises, and a model's first step checks what it would first in a process.

Inside `implicit_replication()` the user vouches for the tensors and nothing is checked.
A 0-dim tensor is a scalar, as a Python number is (a step count, a learning rate, a loss
scale): never checked, so an optimizer step stays free of communication.
A tensor of torch's own DTensor class is not plain and never counts as replicated: it is
refused with a TypeError (`_foreign`).
"""

from __future__ import annotations

import struct
from typing import Any, Optional

import torch

from .. import _comm as comm
from .._mesh import DeviceMesh
from .._mesh import DryMesh
from ._foreign import is_torch_dtensor, refuse_torch_dtensor
from ._wrap import DTensorBase

__all__ = ["FINGERPRINT_WIDTH", "check_plain", "fingerprint", "forget_checks", "meets_plain", "same_fingerprint"]

_CHECKED: dict[DeviceMesh, set[tuple[Any, ...]]] = {}  # the DTensors' mesh -> its checked sites
_MAX_DIMS = 8
_WIDTH = 1 + _MAX_DIMS + 3  # ndim, shape padded, three sums as float64 bits
FINGERPRINT_WIDTH = _WIDTH
_RELATIVE = 1e-6  # sums this close count as equal (a non-deterministic kernel, not another piece)


def _walk(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for where, value in [(f"argument {k}", v) for k, v in enumerate(args)] + [(f"{k}=", v) for k, v in kwargs.items()]:
        if isinstance(value, (list, tuple)):
            found.extend((f"{where}[{j}]", x) for j, x in enumerate(value) if isinstance(x, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            found.append((where, value))
    return found


def fingerprint(t: torch.Tensor) -> list[int]:
    """`t`'s shape and three sums (float64 bits): equal on two ranks when their tensors are."""
    if t.ndim > _MAX_DIMS or t.is_meta or t.device.type == "meta":
        return [-1] * _WIDTH
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.reshape(-1).to(torch.float64)
    weights = torch.arange(x.numel(), dtype=torch.float64, device=x.device).mul_(0.6180339887498949).frac_().add_(0.5)
    sums = [float(x.sum()), float((x * weights).sum()), float(x.abs().sum())]
    bits = [struct.unpack("<q", struct.pack("<d", s))[0] for s in sums]
    return [t.ndim, *t.shape, *([-1] * (_MAX_DIMS - t.ndim)), *bits]


def _sums(row: list[int]) -> list[float]:
    return [struct.unpack("<d", struct.pack("<q", b))[0] for b in row[1 + _MAX_DIMS:]]


def same_fingerprint(a: list[int], b: list[int]) -> bool:
    """Whether two fingerprints are of one tensor (sums within a relative 1e-6: kernels may not be deterministic)."""
    if a[: 1 + _MAX_DIMS] != b[: 1 + _MAX_DIMS]:
        return False
    if a == b:
        return True
    sa, sb = _sums(a), _sums(b)
    scale = max(abs(sa[2]), abs(sb[2]), 1e-300)
    return all(abs(x - y) <= _RELATIVE * scale for x, y in zip(sa, sb))


def _plain_elements(func: Any, args: tuple[Any, ...]) -> frozenset[str]:
    """For a `_foreach_*` / `_fused_*` call, the list indices ("k]") whose elements are plain in
    every list: they run as the plain op (`ByMeshPlan`) and never meet a DTensor."""
    name = func._schema.name
    if not (name.startswith("aten::_foreach_") or name.startswith("aten::_fused_")):
        return frozenset()
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    n = len(lists[0]) if lists else 0
    full = [a for a in lists if len(a) == n]
    return frozenset(f"{k}]" for k in range(n) if not any(isinstance(a[k], DTensorBase) for a in full))


def _traced(t: torch.Tensor) -> bool:
    """A stand-in of a tensor while torch.compile traces (fake, or a functional / proxy wrapper of
    a fake one, as in a compiled backward's trace): it has no values to compare."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    return t.is_meta or isinstance(t, torch._subclasses.FakeTensor) or maybe_get_fake_mode(t) is not None


def forget_checks(mesh: DeviceMesh) -> bool:
    """Check again every site on `mesh` and on the meshes whose ranks all belong to it (a module
    was just sharded over `mesh`); whether there was any."""
    ranks = set(mesh.mesh.flatten().tolist())
    gone = [m for m in _CHECKED if ranks.issuperset(m.mesh.flatten().tolist())]
    for m in gone:
        del _CHECKED[m]
    return bool(gone)


def _plain(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[tuple[str, Any]],
                                                                                list[tuple[str, Any]]]:
    """Every tensor of the call (where it sits, the tensor), and those of them a check compares."""
    found = _walk(args, kwargs)
    alone = _plain_elements(func, args)
    return found, [(where, t) for where, t in found
                   if not isinstance(t, DTensorBase) and t.ndim > 0 and where.rpartition("[")[2] not in alone]


def meets_plain(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether plain tensors meet DTensors at this call (what `check_plain` would compare)."""
    return bool(_plain(func, args, kwargs)[1])


def check_plain(func: Any, modes: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise on every rank when a plain tensor meeting DTensors at this op differs between ranks
    (checked once per site; see the module docstring)."""
    found, plain = _plain(func, args, kwargs)
    if not plain:
        return
    ours = next((t for _, t in found if isinstance(t, DTensorBase)), None)
    for where, t in plain:  # torch's own DTensor is no plain tensor: it cannot count as replicated
        if ours is not None and is_torch_dtensor(t):
            raise refuse_torch_dtensor(func, where, t, ours)
    mesh: Optional[Any] = next((t._spec.mesh for _, t in found if isinstance(t, DTensorBase)), None)
    if not isinstance(mesh, DeviceMesh) or mesh.size() == 1 or mesh.get_coordinate() is None:
        return
    dry = isinstance(mesh, DryMesh)  # a dry run checks as a real run would (its ranks agree by construction)
    if not dry and any(_traced(t) for _, t in plain):
        return
    site = (func, modes, tuple(t._spec if isinstance(t, DTensorBase) else where for where, t in found),
            (mesh.get_rank(), comm.dry_run_number()) if dry else None)  # once per simulated rank and dry run
    checked = _CHECKED.setdefault(mesh, set())
    if site in checked:
        return
    mine = [v for _, t in plain for v in fingerprint(t)]
    rows = comm.gather_over_mesh(mine, mesh.get_all_groups(), mesh.shape)
    checked.add(site)
    ranks = mesh.mesh.flatten().tolist()
    for k, (where, t) in enumerate(plain):
        pieces = [row[k * _WIDTH : (k + 1) * _WIDTH] for row in rows]
        odd = [r for r, p in zip(ranks, pieces) if not same_fingerprint(p, pieces[0])]
        if odd:
            shapes = sorted({tuple(p[1 : 1 + p[0]]) for p in pieces if p[0] >= 0})
            what = "shapes" if len(shapes) > 1 else "values"
            raise ValueError(
                f"{func}: the plain tensor in {where} (shape {tuple(t.shape)} on this rank) meets DTensors "
                f"on {mesh!r}, where a plain tensor counts as replicated, but its {what} differ between "
                f"ranks (rank {ranks[0]} and rank(s) {odd}{', shapes ' + str(shapes) if what == 'shapes' else ''}): "
                f"it is rank-local (a to_local() piece, a use_local_output=True output, or per-rank data), "
                f"and taking it as global would be silently wrong. Wrap it with "
                f"DTensor.from_local(t, mesh, placements) naming how it is split, keep the computation on "
                f"local tensors (to_local() the DTensors too), or give every rank the same tensor"
            )
