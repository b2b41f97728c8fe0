"""Propagation answers for aten calls sampled from OpInfo, as JSON on stdout (see test_registry).

    python -m tests.ops.registry_probe ops SRC   # only shardwise._ops (and what it needs) imported
    python -m tests.ops.registry_probe all       # `import shardwise` first: every layer imported

Each OpInfo's first sample that runs is run once on plain CPU tensors (forward, and
backward where it has a float output that requires grad) under a dispatch mode that
records every aten call; each call becomes an `OpSchema` with its tensors laid out on an
abstract mesh ((2,): Shard(0) where dim 0 has 2 or more elements; (2, 2): that and
Shard(-1) likewise), and the answer is `propagate`'s, under no mode and under every mode
some rule has a variant for. The output maps "op | schema | mode" to the answer (or the
error's type), plus which registered ops were reached.
"""

from __future__ import annotations

import json
import random
import sys
import types
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _import_ops(how: str) -> Any:
    if how == "ops":  # the package's __init__ imports every layer: stand in a bare package
        package = types.ModuleType("shardwise")
        package.__path__ = [sys.argv[2] + "/shardwise"]
        sys.modules["shardwise"] = package
    else:
        import shardwise  # noqa: F401
    import shardwise._ops as ops

    return ops


_T = ("t", (4, 6), (6, 1), torch.float32)
# stand-ins by the argument's type as the schema prints it
_SIMPLE = {"int": 0, "float": 1.0, "bool": False, "number": 1.0, "str": "sum", "List[int]": [1],
           "List[number]": [1.0, 1.0], "List[bool]": [True, True, True], "ScalarType": torch.float32}


def _synthesized(op: Any) -> Any:
    """A call of `op` made from its schema alone (for ops no OpInfo sample reaches): a (4, 6)
    float tensor per tensor argument, a plain value per required other; None when an argument
    has a type with no stand-in. The call may be invalid: the answer is then an error, the
    same in both interpreters."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in op._schema.arguments:
        kind = str(a.type)
        if kind in ("Tensor", "Optional[Tensor]") and not a.has_default_value():
            value: Any = _T
        elif kind == "List[Tensor]":
            value = (_T, _T)
        elif kind == "List[Optional[Tensor]]":
            value = (_T, None)
        elif a.has_default_value():
            continue
        elif kind.startswith("Optional["):
            value = None
        elif kind in _SIMPLE:
            value = _SIMPLE[kind]
        else:
            return None
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def main() -> None:
    how = sys.argv[1]
    ops = _import_ops(how)
    from shardwise import _ops
    from shardwise._mesh import AbstractMesh
    from shardwise._placement import Replicate, Shard
    from shardwise._spec import DTensorSpec, TensorMeta

    layers = sorted(m for m in sys.modules if m.startswith("shardwise.") and m.count(".") == 1)
    from torch.testing._internal.common_methods_invocations import op_db

    calls: list[tuple[Any, Any, Any]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("t", tuple(a.shape), tuple(a.stride()), a.dtype) if a.ndim else ("s", a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(meta(x) for x in a)
        return a

    seen: list[tuple[Any, Any, Any]] = []
    for k, info in enumerate(op_db):
        torch.manual_seed(k)  # OpInfo samples are random: the same draws in both interpreters
        random.seed(k)
        try:
            samples = info.sample_inputs_func(info, "cpu", torch.float32, True)
            for sample in samples:
                calls.clear()
                with Record():
                    out = info.op(sample.input, *sample.args, **sample.kwargs)
                    if isinstance(out, torch.Tensor) and out.requires_grad and out.is_floating_point():
                        out.sum().backward()
                seen.extend((f, meta(a), {name: meta(v) for name, v in k.items()}) for f, a, k in calls)
                break
        except Exception:
            continue

    def spec(m: Any, mesh: Any) -> Any:
        if isinstance(m, tuple) and m and m[0] == "t":
            _, shape, stride, dtype = m
            placements = []
            for i in range(mesh.ndim):
                dim = 0 if i == 0 else len(shape) - 1
                placements.append(Shard(dim) if shape and shape[dim] >= 2 else Replicate())
            if len(placements) == 2 and placements[0] == placements[1]:
                placements[1] = Replicate()
            return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, dtype))
        if isinstance(m, tuple) and m and m[0] == "s":
            return _ops.ScalarTensor(m[1], "cpu")
        if isinstance(m, (tuple, list)):  # lists become tuples, as dispatch makes them
            return tuple(spec(x, mesh) for x in m)
        return m

    modes = sorted({r.mode for r in ops.registered_rules() if r.mode is not None})
    answers: dict[str, str] = {}
    reached: set[str] = set()
    warnings.simplefilter("ignore")

    def answer(calls: list[tuple[Any, Any, Any]]) -> None:
        for func, args, kwargs in calls:
            if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
                continue
            for mesh in (AbstractMesh((2,)), AbstractMesh((2, 2))):
                schema = ops.OpSchema(func, tuple(spec(a, mesh) for a in args),
                                      tuple((k, spec(v, mesh)) for k, v in kwargs.items()))
                if not schema.input_specs() or " at 0x" in repr(schema):  # no DTensor, or an object by address
                    continue
                reached.add(str(func))
                for mode in [None, *modes]:
                    key = f"{func} | {schema!r} | {mesh.shape} | {mode}"
                    if key in answers:
                        continue
                    try:
                        if mode is None:
                            result = ops.propagate(schema)
                        else:
                            with ops.op_mode(mode):
                                result = ops.propagate(schema)
                        answers[key] = repr(result)
                    except Exception as exc:
                        answers[key] = f"error {type(exc).__name__}"

    answer(seen)
    # every registered op no sample reached: one call made from its schema
    made = [(op, *_synthesized(op)) for op in ops.registered_ops() if str(op) not in reached and _synthesized(op)]
    answer(made)
    registered = sorted(str(op) for op in ops.registered_ops())
    json.dump({"layers": layers, "answers": answers, "reached": sorted(reached), "registered": registered}, sys.stdout)


if __name__ == "__main__":
    main()
