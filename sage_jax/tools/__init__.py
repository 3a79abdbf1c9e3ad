"""Tools a model calls mid-answer: base.py (what a tool is: a name, a JSON schema for the chat template's `tools=`,
a parser and a run function; the pool that runs calls in threads while decoding goes on), sandbox.py (model-written
code in a fresh interpreter inside namespaces, under limits), python_tool.py (PythonTool), calculator.py
(Calculator: arithmetic without eval), registry.py (the built-in tools by name), calls.py (finding a call at the end
of the model's text: a ```python block or a Hermes-style <tool_call>).

    from sage_jax.tools import PythonTool, Calculator
    PythonTool(timeout_s=5.0).run("print(2 ** 100)")      # '1267650600228229401496703205376\\n'

Imports: nothing else of sage_jax (the bottom floors). Model output is untrusted: code runs only in sandbox.py.
"""

from __future__ import annotations

import importlib

_LAZY = {"PythonTool": "sage_jax.tools.python_tool", "Calculator": "sage_jax.tools.calculator",
         "ToolPool": "sage_jax.tools.base", "ToolOutput": "sage_jax.tools.base",
         "make_tools": "sage_jax.tools.registry"}


def __getattr__(name: str):
    if name in ("base", "calls", "calculator", "python_tool", "registry", "sandbox"):
        return importlib.import_module(f"sage_jax.tools.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sage_jax.tools' has no attribute {name!r}")
