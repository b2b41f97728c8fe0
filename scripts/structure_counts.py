"""Count the seams issue 46 names, so a refactor reports them before and after with one command.

    .venv/bin/python scripts/structure_counts.py            # the table
    .venv/bin/python scripts/structure_counts.py --list     # and every place counted

| count | what is counted |
|---|---|
| modules over 400 lines | files under src/shardwise |
| functions over 60 lines | `def`s (methods and nested ones included), first line to last |
| classes over 150 lines | `class` statements, first line to last |
| one-element-list cells | module-level `X = [v]` but `__all__` (a mutable cell standing in for a global) |
| module-level dicts | module-level names bound to an empty dict (`{}`, `dict()`, `defaultdict(...)`): state filled at run time |
| private cross-package imports | pairs (module, private module of a subpackage the module is not in) one imports from the other |
| process-group creation sites | calls of `new_group`, `new_subgroups`, `split_group`, `_new_group_with_tag`, `new_group_with_tag` |
| end-of-backward callbacks | calls of `queue_callback` |
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "shardwise"
GROUP_MAKERS = {"new_group", "new_subgroups", "split_group", "_new_group_with_tag", "new_group_with_tag"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _package(name: str, modules: dict[str, Path]) -> str:
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def _imported(name: str, tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The modules of this package `name` imports (the module itself when a name is one)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name, modules).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    return out


def _is_empty_dict(value: ast.AST) -> bool:
    if isinstance(value, ast.Dict):
        return not value.keys
    return isinstance(value, ast.Call) and not value.keywords and ast.unparse(value.func).split(".")[-1] in (
        "dict", "defaultdict", "OrderedDict") and (not value.args or ast.unparse(value.func).endswith("defaultdict"))


def count() -> dict[str, list[str]]:
    modules = _modules()
    found: dict[str, list[str]] = {k: [] for k in (
        "modules over 400 lines", "functions over 60 lines", "classes over 150 lines", "one-element-list cells",
        "module-level dicts", "private cross-package imports", "process-group creation sites",
        "end-of-backward callbacks")}
    for name, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        where = f"{path.relative_to(SRC)}"
        lines = len(text.splitlines())
        if lines > 400:
            found["modules over 400 lines"].append(f"{where} ({lines})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 60:
                    found["functions over 60 lines"].append(f"{where}:{node.lineno} {node.name} ({n})")
            elif isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 150:
                    found["classes over 150 lines"].append(f"{where}:{node.lineno} {node.name} ({n})")
            elif isinstance(node, ast.Call):
                callee = ast.unparse(node.func).split(".")[-1]
                if callee in GROUP_MAKERS:
                    found["process-group creation sites"].append(f"{where}:{node.lineno} {callee}")
                elif callee == "queue_callback":
                    found["end-of-backward callbacks"].append(f"{where}:{node.lineno}")
        for stmt in tree.body:
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if value is None:
                continue
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            label = f"{where}:{stmt.lineno} {', '.join(ast.unparse(t) for t in targets)}"
            names = [ast.unparse(t) for t in targets]
            if isinstance(value, ast.List) and len(value.elts) == 1 and names != ["__all__"]:
                found["one-element-list cells"].append(label)
            elif _is_empty_dict(value):
                found["module-level dicts"].append(label)
        for target in sorted(_imported(name, tree, modules)):
            private = target.rpartition(".")[2].startswith("_") and modules[target].name != "__init__.py"
            home = _package(target, modules)
            if private and home != ROOT and home != _package(name, modules):
                found["private cross-package imports"].append(f"{name} -> {target}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every place counted")
    args = parser.parse_args()
    found = count()
    width = max(map(len, found))
    for key, places in found.items():
        print(f"{key:<{width}}  {len(places)}")
        if args.list:
            for p in places:
                print(f"    {p}")


if __name__ == "__main__":
    main()
