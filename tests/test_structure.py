"""The shape of the source tree: no import cycle, no module over 500 lines.

The import graph counts every import statement, at the top of a file or inside a
function: an import hidden in a function is still a dependency, and a cycle held
together by one is still a cycle. Imports under `if TYPE_CHECKING:` never run and are
left out. `from .x import name` is an edge to `x` (or to
`x.name` when that is a module); importing a module also imports the packages above
it, so an edge into another package counts its `__init__` too (a module's own
ancestors and the root package are already importing when it runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "shardwise"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module, modules) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:`."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of this package it imports (see the module docstring); with
    `type_checking`, the imports under `if TYPE_CHECKING:` too."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree) if type_checking else _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, modules)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        edges: set[str] = set()
        ancestors = {".".join(name.split(".")[:k]) for k in range(1, len(name.split(".")) + 1)}
        for target in targets:
            parts = target.split(".")
            for k in range(2, len(parts) + 1):  # the target and every package above it but the root
                prefix = ".".join(parts[:k])
                if prefix in modules and prefix not in ancestors and prefix != name:
                    edges.add(prefix)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_an_import_in_a_function() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_under_src() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (each line: modules that import each other, directly or not):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_no_module_over_500_lines() -> None:
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = {name: n for name, n in long.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by job): {over}"


# torch's private APIs that differ between the supported torch versions (`shardwise._compat`)
_VERSIONED = frozenset({"nonstrict_trace", "register_constant", "resize_storage_bytes_", "skip_code",
                        "_new_group_with_tag"})


def _versioned_uses(tree: ast.AST) -> list[str]:
    """torch's versioned private APIs a module reaches itself: as attributes (`torch._dynamo.
    nonstrict_trace`, `torch._dynamo.disable`) or imported by name from torch."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in _VERSIONED or (
                node.attr == "disable" and isinstance(node.value, ast.Attribute) and node.value.attr == "_dynamo")):
            found.append(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found += [a.name for a in node.names if a.name in _VERSIONED]
    return found


def test_version_dependent_private_apis_are_reached_only_through_compat() -> None:
    """A new torch release is checked, and adapted, in one module: `_compat`."""
    assert _versioned_uses(ast.parse("import torch._dynamo\ntorch._dynamo.disable(f)")) == ["disable"]  # it can fail
    users = {name: uses for name, path in _modules().items() if name != f"{ROOT}._compat"
             if (uses := _versioned_uses(ast.parse(path.read_text())))}
    assert not users, f"call these through shardwise._compat instead: {users}"


# What deciding an op's layout looks like in code: propagation and its types, the strategy
# functions, the strided translation (`as_shard`), and the rule's layout facts.
_LAYOUT_NAMES = frozenset({"propagate", "OpSchema", "OutputSharding", "OpStrategy", "PlacementStrategy", "TupleStrategy",
                           "StrategyType", "redistribute_cost", "get_op_strategy", "as_shard"})
_LAYOUT_ATTRIBUTES = frozenset({"strategy", "output_spec", "output_meta", "positions_alike"})


def layout_decisions(path: Path) -> list[str]:
    """Where a module imports or reads one of `_LAYOUT_NAMES` / `_LAYOUT_ATTRIBUTES`, as 'line: name'."""
    found: list[str] = []
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in _LAYOUT_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in _LAYOUT_NAMES | _LAYOUT_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
    return sorted(found, key=lambda s: int(s.split(":")[0]))


def test_no_module_under_tensor_decides_an_op_layout() -> None:
    """Plan making is one pure step in `_ops` (`make_plan`): `_tensor` keeps the plan cache
    and the runners, and never propagates, reads a strategy or translates a strided layout."""
    modules = _modules()
    found = {name: layout_decisions(path) for name, path in modules.items() if name.startswith(f"{ROOT}._tensor")}
    found = {name: lines for name, lines in found.items() if lines}
    assert not found, "layout decided under _tensor (make it part of _ops.make_plan):\n" + "\n".join(
        f"  {name}: {', '.join(lines)}" for name, lines in sorted(found.items()))
    assert "make_plan" in modules[f"{ROOT}._ops._plan"].read_text()


_REGISTRY = f"{ROOT}._tensor._end_of_backward"


def queue_callback_calls(path: Path) -> list[int]:
    """Lines where a module reaches the autograd engine's end-of-backward callbacks (`queue_callback`)."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted({node.lineno for node in ast.walk(tree)
                   if (isinstance(node, ast.Attribute) and node.attr == "queue_callback")
                   or (isinstance(node, ast.Name) and node.id == "queue_callback")})


def test_gradients_reach_the_end_of_backward_only_through_the_registry(tmp_path: Path) -> None:
    """Issue 46: five mechanisms queued their own engine callback at the end of backward, each in
    the order its first gradient arrived; now one registry queues one per pass and orders the
    steps (`_tensor/_end_of_backward.py`). Everything else arms a step there."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\ntorch.autograd.Variable._execution_engine.queue_callback(f)\n")
    assert queue_callback_calls(probe) == [2]  # the check can fail
    modules = _modules()
    found = {name: lines for name, path in modules.items() if name != _REGISTRY
             if (lines := queue_callback_calls(path))}
    assert not found, f"queue_callback outside {_REGISTRY} (arm a Step there instead): {found}"
    assert queue_callback_calls(modules[_REGISTRY])  # and the registry does queue one


def test_no_import_cycle_inside_the_pipeline_not_even_for_type_checking() -> None:
    graph = import_graph(type_checking=True)
    inside = {name for name in graph if name.startswith("shardwise.pipeline")}
    found = cycles({name: graph[name] & inside for name in inside})
    assert not found, "import cycles in shardwise.pipeline:\n" + "\n".join(" <-> ".join(c) for c in found)


def _structure_counts() -> dict[str, list[str]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("structure_counts", SRC.parent / "scripts" / "structure_counts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.count()  # type: ignore[no-any-return]


def test_process_groups_are_made_only_in_the_groups_module() -> None:
    """Issue 46: groups were made by hand in five places; every one now comes from `_mesh/_groups.py`
    (torch's version-dependent maker sits behind `_compat`, which only `_groups` calls)."""
    sites = _structure_counts()["process-group creation sites"]
    assert sites, "the count finds no group creation at all: the check would pass vacuously"
    allowed = ("shardwise/_mesh/_groups.py:", "shardwise/_compat.py:")
    outside = [s for s in sites if not s.startswith(allowed)]
    assert not outside, f"process groups made outside shardwise._mesh._groups (add a maker there): {outside}"
    compat_callers = [name for name, path in _modules().items()
                      if "new_group_in_order" in path.read_text() and name not in (f"{ROOT}._compat", f"{ROOT}._mesh._groups")]
    assert not compat_callers, f"new_group_in_order called outside the groups module: {compat_callers}"


ALLOWED_PRIVATE = Path(__file__).resolve().parent / "private_imports_allowed.txt"


def test_private_imports_across_packages_only_shrink() -> None:
    """A package's private modules are its own: another package imports through the package's
    `__init__`. The pairs that still reach in are listed in `private_imports_allowed.txt`; a new
    one fails, and so does a listed one that is gone (so the list only shrinks)."""
    found = set(_structure_counts()["private cross-package imports"])
    allowed = {line.strip() for line in ALLOWED_PRIVATE.read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    new, gone = sorted(found - allowed), sorted(allowed - found)
    assert not new, "imports of another package's private module (import from its __init__ instead):\n  " + "\n  ".join(new)
    assert not gone, f"no longer imported: delete these lines from {ALLOWED_PRIVATE.name}:\n  " + "\n  ".join(gone)
