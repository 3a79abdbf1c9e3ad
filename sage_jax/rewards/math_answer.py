r"""Final answers in model text: extract the last \boxed{} (else the last "answer is ..." / "Answer: ..." / "####"
statement, the forms real models end with) and normalise it to a canonical string (units, text commands, number
words, matrices, repeating decimals, thousands separators), the form rewards.math compares. Pure string work: no
parser, nothing evaluated.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

MAX_ANSWER_CHARS = 1000

_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)\s*")
# "The (final) answer is: 18", "answer would be 18", "**Answer:** 18", "Final answer: $18$", "#### 18". The latest
# statement in the text wins, whichever form it has (a model restating its answer ends with the one it means).
_MARKER_RE = re.compile(r"\banswers?\b(?:\*\*)?\s*(?:(?:is|was|would be|will be|should be)\b\s*:?|[:=])(?:\*\*)?"
                        r"|####", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(r"\**\$?(-?\d[\d,]*(?:\.\d+)?)\**\.?")
_LEAD_NUMBER_RE = re.compile(r"(-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?)\s+[a-zA-Z][a-zA-Z\s',-]*\.?")
_CHAIN_RESULT_RE = re.compile(r"[\d\s+\-*/x×().,$]+=\s*(-?\$?\d[\d,]*(?:\.\d+)?)(?:\s+[a-zA-Z][a-zA-Z\s',-]*)?\.?")

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
            if end in partner and text[end + 1:partner[end]].strip():  # "within \boxed{}" echoed: not an answer
                return text[end + 1:partner[end]]
        else:
            token = _BARE_TOKEN_RE.match(text, end)  # "\boxed 5"
            if token:
                return token.group(0)
    return None


def _clean_tail(ans: str) -> str:
    """The answer part of "answer is $5$. I hope it is correct." / "answer is **18** apples." style tails."""
    ans = ans.strip().strip("*").strip()
    math_span = re.match(r"\$+([^$]+)\$+|\\\((.+?)\\\)|\\\[(.+?)\\\]", ans)
    if math_span:
        return next(g for g in math_span.groups() if g is not None).strip()
    ans = re.split(r"\.\s|\. *$|\s+I hope|\s*\*\*|;", ans)[0].strip()
    lead = _LEAD_NUMBER_RE.fullmatch(ans)  # "18 apples", "18 dollars in total": the number (no other digits)
    if lead:
        return lead.group(1)
    chain = _CHAIN_RESULT_RE.fullmatch(ans)  # "4 + 5 = 9": the result
    if chain:
        return chain.group(1)
    return ans


def _marked_answer(text: str) -> str | None:
    for match in reversed(list(_MARKER_RE.finditer(text))):
        window = text[match.end():match.end() + 2 * MAX_ANSWER_CHARS]  # bounded: thousands of markers stay linear
        rest, newline, after = window.partition("\n")
        if not rest.strip() and newline:  # "Answer:\n18": the answer on the next non-empty line
            rest = after.lstrip().partition("\n")[0]
        ans = _clean_tail(rest)
        if ans:
            return ans
    return None


def extract_answer(text: str) -> str | None:
    """Last \\boxed{} / \\fbox{} content, else the answer of the last "answer is" / "Answer:" / "####" statement."""
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    # asked for only the number, the reply is that number ("13", "**13**", "13 apples.")
    bare = _BARE_NUMBER_RE.fullmatch(text.strip()) or _LEAD_NUMBER_RE.fullmatch(text.strip())
    if bare:
        return bare.group(1)
    return _marked_answer(text)


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
