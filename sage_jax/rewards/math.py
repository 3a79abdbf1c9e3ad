r"""Math answer verifier: extract the final answer, normalise it, decide equivalence with the gold answer.

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
from fractions import Fraction
from typing import Any

MAX_ANSWER_CHARS = 1000
MAX_PARSE_CHARS = 300  # longer answers are only compared as strings (the longest MATH gold answer has 139 chars)
MAX_BRACE_DEPTH = 8  # latex2sympy slows down exponentially on deeply nested groups
MAX_DIGITS = 1e5

_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)\s*")
_FINAL_RE = re.compile(r"final answer is\s*:?\s*(.+)", re.IGNORECASE)
_ANSWER_RE = re.compile(r"\banswer\s*:\s*(.+)", re.IGNORECASE)
_GSM_RE = re.compile(r"####\s*(.+)")

_UNIT_WORDS = {
    "cm", "mm", "km", "m", "meter", "meters", "metre", "metres", "centimeter", "centimeters", "kilometer",
    "kilometers", "inch", "inches", "foot", "feet", "ft", "yard", "yards", "mile", "miles", "mph", "kg", "g", "gram",
    "grams", "pound", "pounds", "lb", "lbs", "ounce", "ounces", "oz", "liter", "liters", "l", "ml", "second",
    "seconds", "sec", "s", "minute", "minutes", "min", "hour", "hours", "hr", "hrs", "day", "days", "week", "weeks",
    "month", "months", "year", "years", "degree", "degrees", "deg", "dollar", "dollars", "cent", "cents", "unit",
    "units", "square", "sq", "cubic", "percent", "radians", "rad", "points", "people", "students", "ways", "times",
}
_TEXT_CMDS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mbox", "operatorname")

_ONES = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6}

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that its (signal) time-outs are off


# ----------------------------------------------------------------------------------------------- extraction


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[start] == '{' and the index after it; None if unbalanced."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # \{ and \} are literal braces, not grouping
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
        i += 1
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """Index of each balanced '{' -> index of its '}', in one pass (\\{ and \\} are literal, as in _braced)."""
    partner, open_stack = {}, []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            open_stack.append(i)
        elif ch == "}" and open_stack:
            partner[open_stack.pop()] = i
        i += 1
    return partner


_BARE_TOKEN_RE = re.compile(r"[^\s$]+")


def _last_boxed(text: str) -> str | None:
    # One pass over the text: a model stuck in a loop writes thousands of unclosed \boxed{, and scanning to the
    # end once per candidate would be quadratic in them.
    partner = None
    for match in reversed(list(_BOX_RE.finditer(text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            partner = _closing_braces(text) if partner is None else partner
            if end in partner:
                return text[end + 1:partner[end]]
        else:
            token = _BARE_TOKEN_RE.match(text, end)  # "\boxed 5"
            if token:
                return token.group(0)
    return None


def _clean_tail(ans: str) -> str:
    """The answer part of "final answer is $5$. I hope it is correct." style lines."""
    ans = ans.strip()
    dollars = re.match(r"\$+([^$]+)\$+", ans)
    if dollars:
        return dollars.group(1)
    ans = re.split(r"\.\s|\. *$|\s+I hope", ans)[0]
    return ans.strip()


def extract_answer(text: str) -> str | None:
    """Last \\boxed{} / \\fbox{} content, else the text after 'final answer is', 'Answer:' or '####'."""
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_FINAL_RE, _ANSWER_RE, _GSM_RE):
        matches = list(pattern.finditer(text))
        if matches:
            ans = _clean_tail(matches[-1].group(1))
            return ans or None
    return None


# ----------------------------------------------------------------------------------------------- normalisation


def _map_command_args(s: str, cmd: str, fn) -> str:
    """Replaces every \\cmd{arg} (brace-balanced) by fn(arg)."""
    out, i, pattern = [], 0, re.compile(r"\\" + cmd + r"\s*\{")
    while True:
        match = pattern.search(s, i)
        if match is None:
            out.append(s[i:])
            return "".join(out)
        group = _braced(s, match.end() - 1)
        if group is None:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:match.start()])
        out.append(fn(group[0]))
        i = group[1]


def _text_arg(arg: str) -> str:
    words = arg.replace("\\", " ").replace(".", " ").split()
    if words and all(w.lower() in _UNIT_WORDS for w in words):
        return "\x01"  # a unit: dropped below together with a following ^2 / ^3
    return arg


def _number_words(s: str) -> str | None:
    words = s.lower().replace("-", " ").replace(",", " ").split()
    known = _ONES.keys() | _TENS.keys() | _SCALES.keys() | {"and"}
    if not words or words == ["and"] or any(w not in known for w in words):
        return None
    total, current = 0, 0
    for w in words:
        if w in _ONES:
            current += _ONES[w]
        elif w in _TENS:
            current += _TENS[w]
        elif w == "hundred":
            current = max(current, 1) * 100
        elif w in _SCALES:
            total += max(current, 1) * _SCALES[w]
            current = 0
    return str(total + current)


def _repeating_decimal(s: str) -> str | None:
    match = re.fullmatch(r"(-?)(\d*)\.(\d*)\\(?:overline|bar)\{?(\d+)\}?", s)
    if not match:
        return None
    sign, whole, fixed, rep = match.groups()
    value = Fraction(int(whole or 0)) + Fraction(int(fixed + rep) - int(fixed or 0),
                                                 10 ** len(fixed) * (10 ** len(rep) - 1))
    value = -value if sign else value
    if value.denominator == 1:
        return str(value.numerator)
    return f"{'-' if value < 0 else ''}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _matrix_to_tuple(match: re.Match) -> str:
    body = match.group(1).strip().strip("\\").strip()
    rows = [r.strip() for r in re.split(r"\\\\", body) if r.strip()]
    cells = [[c.strip() for c in r.split("&")] for r in rows]
    if all(len(r) == 1 for r in cells):
        return "(" + ",".join(r[0] for r in cells) + ")"
    if len(cells) == 1:
        return "(" + ",".join(cells[0]) + ")"
    return match.group(0)


def _strip_outer_braces(s: str) -> str:
    while s.startswith("{") and s.endswith("}"):
        group = _braced(s, 0)
        if group is None or group[1] != len(s):
            break
        s = group[0].strip()
    return s


def normalize(ans: Any) -> str:
    """Canonical string form of an answer (used for the exact-match fast path and fed to math-verify)."""
    if isinstance(ans, bool):
        ans = str(ans)
    if isinstance(ans, float) and ans.is_integer():
        ans = int(ans)
    s = str(ans).strip()
    if len(s) > MAX_ANSWER_CHARS:
        return s
    s = s.replace("\n", " ").replace("\\!", "").replace("\\displaystyle", "")
    s = re.sub(r"(?<!\\)\\[,;: ]|~", " ", s)
    s = re.sub(r"^\$+|\$+$|^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left\.|\\right\.", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])", "", s)
    for cmd in _TEXT_CMDS:
        s = _map_command_args(s, cmd, _text_arg)
    s = re.sub(r"\s*\x01\s*(?:\^\s*\{?[23]\}?)?", " ", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\degree", "", s)
    s = re.sub(r"\\?%|\\\$|\$", "", s)
    s = s.replace("{,}", ",")
    s = re.sub(r"\\begin\{[pbvB]?matrix\}(.*?)\\end\{[pbvB]?matrix\}", _matrix_to_tuple, s)
    # Bare trailing unit words: "5 cm", "12 square feet", "30 degrees".
    while True:
        match = re.fullmatch(r"(.*\d.*?)\s+([a-zA-Z]+)\.?(?:\^\{?[23]\}?)?", s)
        if not (match and match.group(2).lower() in _UNIT_WORDS):
            break
        s = match.group(1).strip()
    words = _number_words(s)
    if words is not None:
        return words
    s = re.sub(r"(?<![\\a-zA-Z])(pi|infty|cdot|times|sqrt(?=\{))(?![a-zA-Z])", r"\\\1", s)
    # Whitespace is insignificant except between a command and a following letter ("\pi r").
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    s = s.rstrip(".").rstrip(",")
    s = _strip_outer_braces(s)
    eq = re.fullmatch(r"(?:[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+)(?:=|\\in)([^=]+)", s)
    if eq and not re.search(r"[<>]|\\[lg]eq?(?![a-z])", eq.group(1)):
        s = eq.group(1)
    choice = re.fullmatch(r"\(([A-Ea-e])\)", s)
    if choice:
        s = choice.group(1).upper()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return _repeating_decimal(s) or s


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


def verify(completion: str, gold: Any) -> bool:
    """True when the final answer in `completion` equals `gold` (a string or number)."""
    pred = extract_answer(completion)
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
