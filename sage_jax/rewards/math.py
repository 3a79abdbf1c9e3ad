r"""Math answer verifier: extract the final answer, normalise it (both in rewards.math_answer), decide equivalence
with the gold answer.

    verify(completion, gold) -> bool          score(completion, gold) -> 1.0 / 0.0
    verify_with_timeout(completion, gold, timeout_s)   (any thread; runs in a child process that is killed on time-out)

Order of checks: exact normalised string match; math-verify on both sides wrapped in $...$ (its LaTeX parser builds
sympy trees without eval); a restricted sympy parser for plain-text leftovers. Forms math-verify misses are rewritten
by `normalize` first (column vectors -> tuples, repeating decimals -> fractions, number words -> digits) and
intervals vs inequalities use math-verify's set/relation comparison.

Model text is never eval'd: the plain-text parser only sees strings made of digits, operators and a short list of
names (no quotes, underscores, brackets or attribute access). Answers over MAX_ANSWER_CHARS are rejected; answers
over MAX_PARSE_CHARS, nested deeper than MAX_BRACE_DEPTH, holding forms latex2sympy evaluates eagerly (\sum, \binom,
numeric exponent towers), or whose sympy trees could reach more than MAX_DIGITS digits (10^7!, (x+1)^1000) are only
compared as strings.
math-verify's own signal-based time-outs are off (they fail off the main thread); hard limits live in the pool.
"""

from __future__ import annotations

import logging
import math as _math
import re
from typing import Any

from sage_jax.rewards.math_answer import MAX_ANSWER_CHARS, extract_answer, normalize

MAX_PARSE_CHARS = 300  # longer answers are only compared as strings (the longest MATH gold answer has 139 chars)
MAX_BRACE_DEPTH = 8  # latex2sympy slows down exponentially on deeply nested groups
MAX_DIGITS = 1e5

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that its (signal) time-outs are off


# ----------------------------------------------------------------------------------------------- sympy guards


def _digits(expr: Any, depth: int = 0) -> float:
    """Upper bound on the number of decimal digits of numbers reachable by evaluating `expr`."""
    import sympy

    if depth > 100:
        return _math.inf
    if isinstance(expr, sympy.MatrixBase):
        return max((_digits(e, depth + 1) for e in expr), default=0.0)
    if not isinstance(expr, sympy.Basic):
        return 0.0
    if isinstance(expr, sympy.Rational):
        return 0.30103 * max(int(expr.p).bit_length(), int(expr.q).bit_length()) + 1
    if isinstance(expr, sympy.Float):
        return abs(float(sympy.log(abs(expr) + 1, 10))) + 1 if expr.is_finite else 1.0
    if not expr.args:
        return 1.0
    if isinstance(expr, sympy.Pow):
        if expr.args[0].free_symbols and expr.args[1].is_Number and abs(expr.args[1]) > 100:
            return _math.inf  # expanding (x+1)^1000 takes minutes
        base, exp = _digits(expr.args[0], depth + 1), _digits(expr.args[1], depth + 1)
        return _math.inf if exp > 6 else max(base, 1.0) * 10.0 ** exp
    if isinstance(expr, sympy.exp):
        power = _digits(expr.args[0], depth + 1)
        return _math.inf if power > 6 else 10.0 ** power
    if isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.binomial, sympy.gamma, sympy.subfactorial)):
        n = max(_digits(a, depth + 1) for a in expr.args)
        return _math.inf if n > 6 else 10.0 ** n * n + 1
    parts = [_digits(a, depth + 1) for a in expr.args]
    return sum(parts) if isinstance(expr, sympy.Mul) else max(parts) + 1


def _safe_tree(expr: Any) -> bool:
    try:
        return _digits(expr) <= MAX_DIGITS
    except (RecursionError, TypeError, ValueError, AttributeError):
        return False


def _brace_depth(s: str) -> int:
    depth = best = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        best = max(best, depth)
    return best


# ----------------------------------------------------------------------------------------------- comparisons


def _mv_parse(s: str) -> list:
    from math_verify import LatexExtractionConfig, parse

    return parse(f"${s}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


def _has_relation(s: str) -> bool:
    return bool(re.search(r"[<>]|\\[lg]eq?(?![a-zA-Z])|\\neq?(?![a-zA-Z])", s))


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import verify as mv_verify

    gold_parsed, pred_parsed = _mv_parse(gold), _mv_parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    if not all(_safe_tree(x) for x in gold_parsed + pred_parsed if not isinstance(x, str)):
        return False
    set_vs_relation = _has_relation(pred) != _has_relation(gold)
    return bool(mv_verify(gold_parsed, pred_parsed, allow_set_relation_comp=set_vs_relation, timeout_seconds=None))


# latex2sympy evaluates sums, products, gcds and binomials eagerly, so numeric towers must be stopped before parsing.
_EAGER_RE = re.compile(r"\\(?:sum|prod|int|lim|iint|oint)(?![a-zA-Z])|\^\s*\{[^{}]*\^|\^\s*[\w.]+\s*\^"
                       r"|\^\s*\{?\s*\d{7,}|\\binom\s*\{?\s*\d{5,}")
_PLAIN_OK = re.compile(r"[0-9a-z+\-*/^(). ]+")
_PLAIN_NAMES = {"sqrt", "pi", "e", "exp", "log", "ln", "sin", "cos", "tan"}


def _plain_parse(s: str) -> Any:
    """A sympy tree for plain-text arithmetic ("3/4*pi", "2 sqrt(2)"), or None. Never sees code: see module doc."""
    import sympy
    from sympy.parsing.sympy_parser import (auto_number, auto_symbol, convert_xor, implicit_multiplication,
                                            parse_expr)

    s = s.replace("\\", "").replace("{", "(").replace("}", ")")
    if not _PLAIN_OK.fullmatch(s) or re.search(r"\.\s*[a-z]|\de[+-]?\d{4}", s):
        return None
    names = set(re.findall(r"[a-z]+", s))
    if any(len(n) > 1 and n not in _PLAIN_NAMES for n in names):
        return None
    global_dict = {"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
                   "Symbol": sympy.Symbol, "sqrt": sympy.sqrt, "pi": sympy.pi, "e": sympy.E, "exp": sympy.exp,
                   "log": sympy.log, "ln": sympy.log, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan}
    transformations = (auto_symbol, auto_number, convert_xor, implicit_multiplication)
    try:
        return parse_expr(s, local_dict={}, global_dict=global_dict, transformations=transformations,
                          evaluate=False)
    except Exception:  # noqa: BLE001 - any parse failure means "not comparable"
        return None


def _sympy_equal(pred: str, gold: str) -> bool:
    import sympy

    a, b = _plain_parse(pred), _plain_parse(gold)
    if a is None or b is None or not (_safe_tree(a) and _safe_tree(b)):
        return False
    try:
        diff = a - b
        if diff.free_symbols:
            return sympy.simplify(diff) == 0
        value = complex(sympy.N(diff, 30))
        return abs(value) <= 1e-9 * max(1.0, abs(complex(sympy.N(b, 30))))
    except Exception:  # noqa: BLE001
        return False


def is_equivalent(pred: str, gold: str) -> bool:
    """Equivalence of two normalised answers."""
    if pred == gold:
        return True
    if not pred or not gold:
        return False
    if re.fullmatch(r"[A-Za-z]+", pred) and re.fullmatch(r"[A-Za-z]+", gold):
        return pred.lower() == gold.lower()
    if max(len(pred), len(gold)) > MAX_PARSE_CHARS or max(_brace_depth(pred), _brace_depth(gold)) > MAX_BRACE_DEPTH:
        return False
    if _EAGER_RE.search(pred + gold):
        return False
    try:
        if _math_verify_equal(pred, gold):
            return True
    except Exception:  # noqa: BLE001 - a checker crash is a wrong answer, not a failed step
        pass
    return _sympy_equal(pred, gold)


def gold_answer(gold: Any) -> str:
    """The answer inside a gold value: numbers as is, '\\boxed{..}' or '#### ..' solutions reduced to the answer."""
    if isinstance(gold, str) and ("\\boxed" in gold or "\\fbox" in gold or "####" in gold):
        return extract_answer(gold) or gold
    return gold


_LAST_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    found = _LAST_NUMBER_RE.findall(text[-2 * MAX_ANSWER_CHARS:])
    return found[-1].rstrip(",") if found else None


def verify(completion: str, gold: Any) -> bool:
    """True when the final answer in `completion` equals `gold` (a string or number).

    A gold of {"answer": ..., "last_number": True} (data.answer_extraction="last_number") also reads an answer
    that is only stated, not marked: the last number in the text when no boxed / "answer is" form is there (the
    GSM8K "flexible" convention, for small models that write "so Tom has 33 cards").
    """
    lenient = isinstance(gold, dict) and bool(gold.get("last_number"))
    gold = gold["answer"] if isinstance(gold, dict) and "answer" in gold else gold
    pred = extract_answer(completion)
    if pred is None and lenient and isinstance(completion, str):
        pred = _last_number(completion)
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    return is_equivalent(normalize(pred), normalize(gold_answer(gold)))


def score(completion: str, gold: Any) -> float:
    return 1.0 if verify(completion, gold) else 0.0


def warmup() -> None:
    """Imports math-verify and compiles its regexes (pool workers call this before reporting ready)."""
    verify("\\boxed{\\frac{1}{2}}", "0.5")


def verify_with_timeout(completion: str, gold: Any, timeout_s: float = 5.0) -> bool:
    """`verify` in a child process with a hard time limit (False on time-out); safe from any thread."""
    from sage_jax.rewards import pool

    return bool(pool.shared_pool("math").score([completion], [gold], timeout_s=timeout_s)[0] >= 1.0)
