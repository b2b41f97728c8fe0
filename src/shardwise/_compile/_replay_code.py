"""Turn a traced fx graph into one plain Python function that calls each op's C++ entry point.

`GraphModule`'s generated code spells every op as `torch.ops.aten.add.Tensor(...)`: four
attribute lookups and a Python `OpOverload.__call__` per op, about a microsecond on top of
the op on this machine, which is most of what a replay adds to the local ops. Here every
op's bound C++ callable (`OpOverload._op`, what `__call__` forwards to) and every constant
is a global of the generated function, so a replayed op is one global lookup and one call.
Intermediate values are dropped right after their last use, as fx's code does, so a
replayed train step holds no more activations than eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

__all__ = ["compile_graph"]


def compile_graph(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """A function of the graph's placeholders, in order, returning what the graph returns."""
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = i
    names: dict[torch.fx.Node, str] = {}
    scope: dict[str, Any] = {}

    def bind(value: Any) -> str:
        name = f"_g{len(scope)}"
        scope[name] = value
        return name

    def expr(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):  # fx's immutable_list, torch.Size
            items = ", ".join(expr(x) for x in a)
            return f"[{items}]" if isinstance(a, list) else f"({items}{',' if len(a) == 1 else ''})"
        if a is None or type(a) in (bool, int):
            return repr(a)
        return bind(a)  # floats (inf, nan), dtypes, devices, strings, memory formats: by reference

    params: list[str] = []
    lines: list[str] = []
    for i, node in enumerate(nodes):
        names[node] = f"v{i}"
        if node.op == "placeholder":
            params.append(names[node])
            continue
        if node.op == "get_attr":
            scope[names[node]] = functools.reduce(getattr, str(node.target).split("."), gm)
            continue
        if node.op == "output":
            lines.append(f"return {expr(node.args[0])}")
            break
        if node.op != "call_function":
            raise NotImplementedError(f"replay of a {node.op} node ({node.target}) is not supported")
        target = node.target
        fn = target._op if isinstance(target, torch._ops.OpOverload) else target
        args = [expr(a) for a in node.args] + [f"{k}={expr(v)}" for k, v in node.kwargs.items()]
        call = f"{bind(fn)}({', '.join(args)})"
        lines.append(f"{names[node]} = {call}" if node.users else call)
        dead = [names[u] for u in node.all_input_nodes if last_use[u] == i and u.op != "get_attr"]
        if dead:
            lines.append(f"del {', '.join(dict.fromkeys(dead))}")
    source = f"def replay({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(source, "<shardwise replay>", "exec"), scope)
    fn_out: Callable[..., Any] = scope["replay"]
    return fn_out
