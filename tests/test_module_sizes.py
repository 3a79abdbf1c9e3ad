"""Every module of sage_jax/ reads in one sitting (STYLE.md): about 400 lines at most, functions about 80.

The limits carry a little slack over "about" so that a one-line fix does not fail the suite; a module that grows past
them should be split along its concerns (as hf_io -> hf_config, objectives -> advantages did), not exempted here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sage_jax"
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def long_modules(limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in _modules()}
    return {name: n for name, n in sizes.items() if n > limit}


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    out = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out[f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"] = n
    return out


def test_the_checks_see_an_oversized_module_and_function():
    assert long_modules(limit=100) and long_functions(limit=30)


def test_no_module_over_the_limit():
    assert not long_modules(), f"modules over {MAX_MODULE_LINES} lines (split them): {long_modules()}"


def test_no_function_over_the_limit():
    assert not long_functions(), f"functions over {MAX_FUNCTION_LINES} lines (split them): {long_functions()}"
