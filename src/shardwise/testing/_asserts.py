"""pytest's assertion messages inside the workers: import a test module with its asserts rewritten.

pytest rewrites `assert got == want` in test modules so a failure shows both values.
The workers import test modules with the plain importer, so a failing `assert` there
would say only `AssertionError`. The parent tells the worker which module the body
comes from when pytest rewrote that module; the worker imports it the same way (with
the default, config-free message formatting) before it unpickles the body.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from types import ModuleType

__all__ = ["rewritten_by_pytest", "import_rewritten"]


def rewritten_by_pytest(module_name: str) -> bool:
    """Whether the parent's pytest loaded `module_name` with its asserts rewritten."""
    loader = getattr(sys.modules.get(module_name), "__loader__", None)
    return type(loader).__name__ == "AssertionRewritingHook"


def import_rewritten(module_name: str) -> ModuleType:
    """Import `module_name` (once) with pytest's assert rewriting applied to its source."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    from _pytest.assertion.rewrite import rewrite_asserts  # only workers of a pytest parent get here

    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or spec.loader is None:
        raise ModuleNotFoundError(f"the body's module {module_name!r} is not importable in the worker", name=module_name)
    with open(spec.origin, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=spec.origin)
    rewrite_asserts(tree, source, spec.origin, None)
    code = compile(tree, spec.origin, "exec", dont_inherit=True)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    package, _, name = module_name.rpartition(".")
    if package:
        setattr(sys.modules[package], name, module)
    return module
