"""Countdown: a small, procedural, verifiable arithmetic task with several solutions per problem.

A problem is a multiset of small numbers and a target; an answer is an arithmetic expression that uses every number
exactly once with + - * / and parentheses and evaluates (exactly, over the rationals) to the target.

    prompt      "3 4 2>10:"
    completion  "4*3-2=10"          (the tokenizer appends <eos>; an <answer>...</answer> wrapper is also accepted)

Solutions are compared in a canonical form: additive chains are flattened into (added terms, subtracted terms) and
multiplicative chains into (factors, divisors), each side sorted. So a+b == b+a, (a+b)+c == a+(b+c),
a-(b-c) == a+c-b and a/(b/c) == a*c/b all count as one solution. A solution's strategy is the kind of its
top-level operation ("add", "sub", "mul", "div"), which gives the dominant/rare mode structure used by the
mode-collapse experiment (`demonstrations` draws SFT targets with uneven strategy weights).

Model text is parsed by a small recursive-descent parser; nothing is ever evaluated by Python.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence, Union

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


def _parse(expr: str) -> Parsed | None:
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
    parsed = _parse(expr)
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
def _expressions(numbers: tuple[int, ...]) -> dict[Node, Fraction]:
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


def _solution_nodes(numbers: Sequence[int], target: int) -> list[Node]:
    exprs = _expressions(tuple(sorted(int(x) for x in numbers)))
    nodes = [node for node, v in exprs.items() if v == target]
    return sorted(nodes, key=render)


def solve(numbers: Sequence[int], target: int) -> list[str]:
    """Every distinct solution (canonical strings, sorted)."""
    return [render(node) for node in _solution_nodes(numbers, target)]


# ----------------------------------------------------------------------------------------------- problems


def problem_key(problem: Mapping[str, Any]) -> tuple:
    return tuple(sorted(problem["numbers"])), int(problem["target"])


def _eligible_targets(numbers: tuple[int, ...], target_range: tuple[int, int], min_solutions: int,
                      min_strategies: int) -> list[int]:
    by_target: dict[int, list[Node]] = {}
    for node, v in _expressions(numbers).items():
        if v.denominator == 1 and target_range[0] <= v <= target_range[1]:
            by_target.setdefault(int(v), []).append(node)
    return sorted(t for t, nodes in by_target.items()
                  if len(nodes) >= min_solutions and len({strategy(x) for x in nodes}) >= min_strategies)


def generate_problems(
    n: int,
    seed: int,
    num_numbers: int = 3,
    low: int = 1,
    high: int = 15,
    target_range: tuple[int, int] = (1, 99),
    min_solutions: int = 2,
    min_strategies: int = 1,
    exclude: Iterable[Mapping[str, Any]] = (),
    max_enumerate: int = 2000,
) -> list[dict[str, Any]]:
    """`n` distinct problems {"numbers": [...], "target": int}, each with >= `min_solutions` distinct solutions
    spanning >= `min_strategies` top-level strategies.

    Problems in `exclude` (e.g. the train split when building a test split) are never returned. With 3 numbers and at
    most `max_enumerate` number multisets, every eligible (numbers, target) pair is listed and `n` are drawn without
    replacement; those pools are small (3 numbers, targets 1..99: 465 problems for 1..9, 1259 for 1..15, 2146 for
    1..20). Otherwise the numbers are drawn uniformly from [low, high] and the target uniformly among the eligible
    ones (~50 ms per 4-number problem).
    """
    if n < 0 or num_numbers < 2 or low > high or low < 0:
        raise ValueError(f"bad countdown settings n={n} num_numbers={num_numbers} range=[{low},{high}]")
    rng = random.Random(seed)
    seen = {problem_key(p) for p in exclude}
    settings = (target_range, min_solutions, min_strategies)
    problems: list[dict[str, Any]] = []
    if num_numbers <= 3 and math.comb(high - low + num_numbers, num_numbers) <= max_enumerate:
        pool = [(nums, t)
                for nums in itertools.combinations_with_replacement(range(low, high + 1), num_numbers)
                for t in _eligible_targets(nums, *settings) if (nums, t) not in seen]
        if len(pool) < n:
            raise ValueError(f"only {len(pool)} countdown problems exist with {num_numbers} numbers in [{low},{high}],"
                             f" targets {target_range}, >= {min_solutions} solutions, >= {min_strategies} strategies"
                             f" (after exclusions); asked for"
                             f" {n}: widen the number range or lower n")
        chosen = rng.sample(pool, n)
    else:
        chosen, failures = [], 0
        while len(chosen) < n:
            nums = tuple(sorted(rng.randint(low, high) for _ in range(num_numbers)))
            targets = [t for t in _eligible_targets(nums, *settings) if (nums, t) not in seen]
            if not targets:
                failures += 1
                if failures > 5000:
                    raise ValueError(f"found only {len(chosen)} of {n} countdown problems ({num_numbers} numbers in"
                                     f" [{low},{high}], targets {target_range}): widen the ranges or lower n")
                continue
            failures = 0
            chosen.append((nums, rng.choice(targets)))
            seen.add(chosen[-1])
    for nums, target in chosen:
        shuffled = list(nums)
        rng.shuffle(shuffled)
        problems.append({"numbers": shuffled, "target": int(target)})
    return problems


def prompt(problem: Mapping[str, Any]) -> str:
    return " ".join(str(x) for x in problem["numbers"]) + f">{int(problem['target'])}:"


def completion_text(expr: str, target: int) -> str:
    return f"{expr}={int(target)}"


# ----------------------------------------------------------------------------------------------- reward


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LINE_RE = re.compile(r"\s*([0-9+\-*/()\s]+?)\s*(?:=\s*(-?\d{1,8}))?\s*")


def extract_expression(completion: str) -> tuple[str, int | None] | None:
    """(expression, claimed result or None) from the last <answer> block, else from the last non-empty line."""
    if not isinstance(completion, str):
        return None
    answers = _ANSWER_RE.findall(completion)
    text = answers[-1] if answers else completion
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or len(lines[-1]) > MAX_EXPR_CHARS + 16:
        return None
    m = _LINE_RE.fullmatch(lines[-1])
    if m is None:
        return None
    claimed = None if m.group(2) is None else int(m.group(2))
    return m.group(1), claimed


def score(completion: str, gold: Mapping[str, Any]) -> float:
    """1.0 iff the completion's expression uses each gold number exactly once and equals the target exactly."""
    extracted = extract_expression(completion)
    if extracted is None:
        return 0.0
    expr, claimed = extracted
    parsed = _parse(expr)
    if parsed is None:
        return 0.0
    node, val = parsed
    target = int(gold["target"])
    if claimed is not None and claimed != target:
        return 0.0
    if Counter(leaves(node)) != Counter(int(x) for x in gold["numbers"]):
        return 0.0
    return 1.0 if val is not None and val == target else 0.0


# ----------------------------------------------------------------------------------------------- tokenizer


class CountdownTokenizer:
    """Character-level tokenizer for the countdown prompts and completions (no HF tokenizer needed).

    encode() prepends <bos> by default (prompts) and appends <eos> on request (SFT completions); decode() drops special
    tokens and stops at the first <eos>.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*/()=>: "

    def __init__(self):
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        self.stoi = {ch: i for i, ch in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        try:
            ids = [self.stoi[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the countdown vocabulary {self.CHARS!r}") from None
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if skip_special_tokens:
                if i == self.eos_id:
                    break
                if i < len(self.SPECIALS):
                    continue
            out.append(self.itos[i] if 0 <= i < len(self.itos) else "")
        return "".join(out)

    def batch_decode(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]


# ----------------------------------------------------------------------------------------------- SFT data


DEFAULT_MODE_WEIGHTS = {"mul": 0.7, "add": 0.2, "sub": 0.07, "div": 0.03}


def _weighted_index(rng: Any, weights: Sequence[float]) -> int:
    if isinstance(rng, random.Random):
        return rng.choices(range(len(weights)), weights=weights)[0]
    total = float(sum(weights))
    return int(rng.choice(len(weights), p=[w / total for w in weights]))  # numpy Generator


def demonstrations(
    problems: Sequence[Mapping[str, Any]],
    rng: Any,
    mode_weights: Mapping[str, float] | None = None,
    scheme: str = "top",
) -> list[dict[str, Any]]:
    """One SFT demonstration per problem; its strategy is drawn ∝ mode_weights among those the problem has.

    rng: random.Random, numpy Generator or int seed. Problems none of whose strategies has positive weight are skipped.
    Returns dicts with prompt, completion ("EXPR=TARGET", no <eos>), strategy, numbers, target.
    """
    weights = dict(DEFAULT_MODE_WEIGHTS if mode_weights is None else mode_weights)
    if isinstance(rng, int):
        rng = random.Random(rng)
    demos = []
    for problem in problems:
        target = int(problem["target"])
        by_strategy: dict[str, list[str]] = {}
        for node in _solution_nodes(problem["numbers"], target):
            by_strategy.setdefault(strategy(node, scheme), []).append(render(node))
        names = [s for s in sorted(by_strategy) if weights.get(s, 0.0) > 0]
        if not names:
            continue
        name = names[_weighted_index(rng, [weights[s] for s in names])]
        options = by_strategy[name]
        expr = options[_weighted_index(rng, [1.0] * len(options))]
        demos.append({"prompt": prompt(problem), "completion": completion_text(expr, target), "strategy": name,
                                    "numbers": list(problem["numbers"]), "target": target})
    return demos


def strategy_shares(completions: Sequence[str], problems: Sequence[Mapping[str, Any]],
                                        scheme: str = "top") -> dict[str, float]:
    """Share of each strategy among the correct completions (completion i answers problem i)."""
    counts: Counter = Counter()
    for completion, problem in zip(completions, problems, strict=True):
        if score(completion, problem) == 1.0:
            counts[strategy(extract_expression(completion)[0], scheme)] += 1
    total = sum(counts.values())
    return {s: counts[s] / total for s in counts} if total else {}
