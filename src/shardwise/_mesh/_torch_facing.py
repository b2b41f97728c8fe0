"""A shardwise mesh where torch's functional collectives look for their own mesh.

torch's functional collectives find their group by type: `all_reduce(x, "sum", group=mesh)`
and `group=(mesh, mesh_dim)` (as torchtitan's loss logging calls them) raise "Unsupported
group type" for anything but torch's `DeviceMesh`. `isinstance` consults an object's
`__class__` when its own type does not match, so a shardwise mesh answers `__class__` with a
stand-in subclass of torch's `DeviceMesh` (made once per mesh class, named for it:
`DeviceMeshForTorch`), and only when the caller is one of the torch functions listed here
(`ACCEPTING`: the functional collectives' group resolution). Everywhere else, torch.compile's
machinery included, `mesh.__class__` is the mesh's own class, so no other torch code takes a
shardwise mesh for torch's; `type(mesh)` is shardwise's everywhere. Nothing in torch changes.
What those functions then read of the mesh is `ndim` and `_dim_group_names` (each mesh dim's
process group name), which `DeviceMesh` provides.

torch's modules are looked up where the program loaded them; this module imports none.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Optional

__all__ = ["ACCEPTING", "torch_facing"]

# (module, function): torch functions that check `isinstance(group, DeviceMesh)` and then read
# only the mesh's public API and `_dim_group_names`
ACCEPTING = (("torch.distributed._functional_collectives", "_resolve_group"),)

_NAMES = frozenset({"__instancecheck__", *(fn for _, fn in ACCEPTING)})  # the frames worth a closer look
_FACING: dict[type, type] = {}
_CODES: dict[int, tuple[tuple[int, ...], frozenset[CodeType]]] = {}  # 0 -> (the modules' ids, their codes)


def torch_facing(cls: type, caller: Optional[FrameType]) -> type:
    """What a mesh of class `cls` answers to `__class__` asked from `caller`'s frame: a subclass
    of torch's DeviceMesh for the functions in `ACCEPTING`, else `cls`."""
    if caller is None or caller.f_code.co_name not in _NAMES:  # (every failed isinstance on a mesh asks: cheap first)
        return cls
    if caller.f_code.co_name == "__instancecheck__":
        caller = caller.f_back  # (torch's mesh class has a metaclass whose isinstance check is Python)
    if caller is None or caller.f_code not in _accepting():
        return cls
    facing = _FACING.get(cls)
    if facing is None:
        torch_mesh = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
        if not isinstance(torch_mesh, type):
            return cls
        name = f"{cls.__name__}ForTorch"
        facing = _FACING[cls] = type(torch_mesh)(name, (torch_mesh,), {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"What a {cls.__module__}.{cls.__qualname__} is to torch's functional collectives."})
    return facing


def _accepting() -> frozenset[CodeType]:
    """The code objects of `ACCEPTING`'s functions among the modules loaded now."""
    modules = tuple(sys.modules.get(name) for name, _ in ACCEPTING)
    found = _CODES.get(0)
    if found is not None and found[0] == tuple(map(id, modules)):
        return found[1]
    codes = frozenset(code for module, (_, fn) in zip(modules, ACCEPTING)
                      if isinstance(code := getattr(getattr(module, fn, None), "__code__", None), CodeType))
    _CODES[0] = (tuple(map(id, modules)), codes)
    return codes
