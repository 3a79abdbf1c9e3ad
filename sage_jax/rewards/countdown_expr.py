"""Countdown expressions: the canonical form, the parser of model text, the solver and a solution's strategy.

Solutions are compared in a canonical form: additive chains are flattened into (added terms, subtracted terms) and
multiplicative chains into (factors, divisors), each side sorted. So a+b == b+a, (a+b)+c == a+(b+c),
a-(b-c) == a+c-b and a/(b/c) == a*c/b all count as one solution. Model text is parsed by a small recursive-descent
parser; nothing is ever evaluated by Python.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import Iterable, Sequence, Union

# A canonical node: a leaf int, ("+", added, subtracted) or ("*", factors, divisors); tuples of child nodes are sorted
# and never contain a node of the same kind (chains are flattened).
Node = Union[int, tuple]

STRATEGIES = ("add", "sub", "mul", "div")
OP_STRATEGIES = ("add", "sub", "mul", "div", "mixed")
MAX_EXPR_CHARS = 128
MAX_DEPTH = 16
MAX_LITERAL_DIGITS = 4


# ----------------------------------------------------------------------------------------------- canonical form


def _parts(node: Node, kind: str) -> tuple[tuple, tuple]:
    if isinstance(node, tuple) and node[0] == kind:
        return node[1], node[2]
    return (node,), ()


def _sort_key(node: Node) -> tuple:
    # Composite terms first, then numbers largest first: "4*3-2" rather than "2-3*4"-like orders.
    if isinstance(node, int):
        return (1, -node, "")
    return (0, 0, render(node))


def _sorted(nodes: Iterable[Node]) -> tuple:
    return tuple(sorted(nodes, key=_sort_key))


def combine(op: str, left: Node, right: Node) -> Node:
    """Canonical node of `left op right` for canonical children."""
    if op in "+-":
        lp, ln = _parts(left, "+")
        rp, rn = _parts(right, "+")
        pos, neg = (lp + rp, ln + rn) if op == "+" else (lp + rn, ln + rp)
        return ("+", _sorted(pos), _sorted(neg))
    if op in "*/":
        lp, ln = _parts(left, "*")
        rp, rn = _parts(right, "*")
        num, den = (lp + rp, ln + rn) if op == "*" else (lp + rn, ln + rp)
        return ("*", _sorted(num), _sorted(den))
    raise ValueError(f"unknown operator {op!r}; expected one of + - * /")


@functools.lru_cache(maxsize=65536)
def render(node: Node) -> str:
    """Expression string of a canonical node (parses back to the same node)."""
    if isinstance(node, int):
        return str(node)
    kind, main, inverse = node
    if kind == "+":
        return "+".join(render(t) for t in main) + "".join("-" + render(t) for t in inverse)

    def factor(t: Node) -> str:
        return f"({render(t)})" if isinstance(t, tuple) and t[0] == "+" else render(t)

    return "*".join(factor(t) for t in main) + "".join("/" + factor(t) for t in inverse)


def _apply(op: str, a: Fraction | None, b: Fraction | None) -> Fraction | None:
    """Exact `a op b`; None (undefined) propagates and division by zero gives None."""
    if a is None or b is None or (op == "/" and b == 0):
        return None
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b


def leaves(node: Node) -> list[int]:
    if isinstance(node, int):
        return [node]
    return [x for t in node[1] + node[2] for x in leaves(t)]


def _ops(node: Node) -> set[str]:
    if isinstance(node, int):
        return set()
    kind, main, inverse = node
    ops = {kind} if len(main) > 1 else set()
    if inverse:
        ops.add("-" if kind == "+" else "/")
    for t in main + inverse:
        ops |= _ops(t)
    return ops


# ----------------------------------------------------------------------------------------------- parser


_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*/()]))")


def _tokenize(text: str) -> list[str | int] | None:
    tokens: list[str | int] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            return None
        digits, op = m.groups()
        if digits is not None:
            if len(digits) > MAX_LITERAL_DIGITS or (len(digits) > 1 and digits[0] == "0"):
                return None
            tokens.append(int(digits))
        else:
            tokens.append(op)
        pos = m.end()
    return tokens


Parsed = tuple[Node, Union[Fraction, None]]  # canonical node, exact value of the expression as written


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'.

    Values are computed on the expression as written, not on its canonical form: rearranging a/(b/(c-c)) into
    a*(c-c)/b would otherwise turn a division by zero into a valid answer.
    """

    def __init__(self, tokens: list[str | int]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | int | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def chain(self, ops: tuple[str, str], operand, depth: int) -> Parsed:
        node, val = operand(depth)
        while self.peek() in ops:
            op = self.tokens[self.i]
            self.i += 1
            right, right_val = operand(depth)
            node, val = combine(op, node, right), _apply(op, val, right_val)
        return node, val

    def expr(self, depth: int) -> Parsed:
        return self.chain(("+", "-"), self.term, depth)

    def term(self, depth: int) -> Parsed:
        return self.chain(("*", "/"), self.factor, depth)

    def factor(self, depth: int) -> Parsed:
        tok = self.peek()
        if isinstance(tok, int):
            self.i += 1
            return tok, Fraction(tok)
        if tok == "(" and depth < MAX_DEPTH:
            self.i += 1
            parsed = self.expr(depth + 1)
            if self.peek() != ")":
                raise ValueError("unbalanced parenthesis")
            self.i += 1
            return parsed
        raise ValueError(f"unexpected token {tok!r}")


def parse_valued(expr: str) -> Parsed | None:
    """(canonical node, exact value as written; None where it divides by zero), or None if malformed."""
    if not isinstance(expr, str) or len(expr) > MAX_EXPR_CHARS:
        return None
    tokens = _tokenize(expr)
    if not tokens:
        return None
    parser = _Parser(tokens)
    try:
        parsed = parser.expr(0)
    except ValueError:
        return None
    return parsed if parser.i == len(tokens) else None


def parse(expr: str) -> Node | None:
    """Canonical node of an arithmetic expression, or None if it is not a well-formed + - * / ( ) expression."""
    parsed = parse_valued(expr)
    return None if parsed is None else parsed[0]


def canonical(expr: str) -> str | None:
    """Canonical string of an expression (commutative/associative variants collapse), or None if malformed."""
    node = parse(expr)
    return None if node is None else render(node)


def strategy(expr: str | Node, scheme: str = "top") -> str:
    """Strategy of a solution.

    scheme "top": kind of the top-level operation: "add" (sum, nothing subtracted), "sub" (sum with a subtracted term),
        "mul" (product, no divisor), "div" (product with a divisor).
    scheme "ops": operators used anywhere: "add" (+ only), "sub" (+/- with a -), "mul" (* only), "div" (*// with a /),
        "mixed" (additive and multiplicative operators together).
    """
    node = parse(expr) if isinstance(expr, str) else expr
    if node is None:
        raise ValueError(f"cannot classify malformed expression {expr!r}")
    if isinstance(node, int):
        return "leaf"
    if scheme == "top":
        kind, _, inverse = node
        if kind == "+":
            return "sub" if inverse else "add"
        return "div" if inverse else "mul"
    if scheme == "ops":
        ops = _ops(node)
        additive, multiplicative = ops & {"+", "-"}, ops & {"*", "/"}
        if additive and multiplicative:
            return "mixed"
        if additive:
            return "sub" if "-" in ops else "add"
        return "div" if "/" in ops else "mul"
    raise ValueError(f"unknown strategy scheme {scheme!r}; use 'top' or 'ops'")


# ----------------------------------------------------------------------------------------------- solver


@functools.lru_cache(maxsize=4096)
def expressions(numbers: tuple[int, ...]) -> dict[Node, Fraction]:
    """All canonical expressions using every number exactly once, with their values (bottom-up over subsets)."""
    n = len(numbers)
    forms: dict[int, dict[Node, Fraction]] = {1 << i: {numbers[i]: Fraction(numbers[i])} for i in range(n)}
    for mask in range(1, 1 << n):
        if mask in forms:
            continue
        out: dict[Node, Fraction] = {}
        sub = (mask - 1) & mask
        while sub:
            rest = mask ^ sub
            for a, va in forms[sub].items():
                for b, vb in forms[rest].items():
                    for op in "+-*/":
                        v = _apply(op, va, vb)
                        if v is not None:
                            out.setdefault(combine(op, a, b), v)
            sub = (sub - 1) & mask
        forms[mask] = out
    return forms[(1 << n) - 1]


def solution_nodes(numbers: Sequence[int], target: int) -> list[Node]:
    """Canonical nodes of every distinct solution, sorted by their strings."""
    exprs = expressions(tuple(sorted(int(x) for x in numbers)))
    nodes = [node for node, v in exprs.items() if v == target]
    return sorted(nodes, key=render)


def solve(numbers: Sequence[int], target: int) -> list[str]:
    """Every distinct solution (canonical strings, sorted)."""
    return [render(node) for node in solution_nodes(numbers, target)]
