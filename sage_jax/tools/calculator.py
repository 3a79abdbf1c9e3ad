"""Calculator: arithmetic on numbers, evaluated by walking the expression's syntax tree (never eval).

    Calculator().run("(17 * 23 + 4) / 5")     # '79.0'
    Calculator().run("sqrt(2) ** 2")          # '2.0000000000000004'

+ - * / // % ** and parentheses, unary minus, and sqrt, log, exp, sin, cos, tan, abs, round, floor, ceil, factorial,
pi, e. Sizes are bounded (expression length, exponent, factorial argument, digits), so no call can hang the trainer.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from sage_jax.tools.base import ToolCallError, text_argument

MAX_CHARS = 500
MAX_EXPONENT = 4096
MAX_FACTORIAL = 500
MAX_DIGITS = 4000
_MAX_BITS = int(MAX_DIGITS * 3.33)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
              "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "factorial": math.factorial}
_CONSTANTS = {"pi": math.pi, "e": math.e}
SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. (17 * 23 + 4) / 5.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _check_size(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ToolCallError(f"a number over {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or isinstance(left, int) and isinstance(
                right, int) and abs(left).bit_length() * abs(right) > _MAX_BITS):
            raise ToolCallError(f"a power too large (an exponent over {MAX_EXPONENT} or over {MAX_DIGITS} digits)")
        return _check_size(_BINARY[type(node.op)](left, right))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        args = [_eval(a) for a in node.args]
        if node.func.id == "factorial" and args and abs(args[0]) > MAX_FACTORIAL:
            raise ToolCallError(f"factorial of more than {MAX_FACTORIAL}")
        return _check_size(_FUNCTIONS[node.func.id](*args))
    raise ToolCallError(f"not arithmetic: {ast.unparse(node)[:80]}")


def evaluate(expression: str) -> int | float:
    if len(expression) > MAX_CHARS:
        raise ToolCallError(f"an expression over {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolCallError(f"cannot parse {expression!r}: {e.msg}") from None
    try:
        return _eval(tree)
    except (ArithmeticError, ValueError, TypeError) as e:
        if isinstance(e, ToolCallError):
            raise
        raise ToolCallError(f"{type(e).__name__}: {e}") from None


class Calculator:
    name = "calculator"
    schema = SCHEMA

    def parse(self, arguments: Any) -> str:
        return text_argument(arguments, "expression", 'the calculator takes an expression: {"expression": "2 + 2"}')

    def run(self, expression: str) -> str:
        return str(evaluate(expression))
