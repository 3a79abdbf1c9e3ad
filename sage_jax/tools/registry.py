"""The built-in tools by name, as `rollout.tools` names them."""

from __future__ import annotations

from typing import Sequence

from sage_jax.tools.base import Tool
from sage_jax.tools.calculator import Calculator
from sage_jax.tools.python_tool import PythonTool

NAMES = ("python", "calculator")
SCHEMAS = {"python": PythonTool.schema, "calculator": Calculator.schema}


def make_tools(names: Sequence[str], timeout_s: float = 5.0) -> dict[str, Tool]:
    """The built-in tools by name ("python", "calculator"); an unknown name is refused with the choices."""
    builders = {"python": lambda: PythonTool(timeout_s=timeout_s), "calculator": Calculator}
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}: rollout.tools takes names from {sorted(builders)}")
    return {n: builders[n]() for n in names}
