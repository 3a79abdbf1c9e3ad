"""Countdown: a small, procedural, verifiable arithmetic task with several solutions per problem.

A problem is a multiset of small numbers and a target; an answer is an arithmetic expression that uses every number
exactly once with + - * / and parentheses and evaluates (exactly, over the rationals) to the target.

    prompt      "3 4 2>10:"
    completion  "4*3-2=10"          (the tokenizer appends <eos>; an <answer>...</answer> wrapper is also accepted)

Solutions are compared in a canonical form (countdown_expr: a+b == b+a, a-(b-c) == a+c-b, ...); problems, the
tokenizer and SFT demonstrations are in countdown_data; this module scores. A solution's strategy is the kind of its
top-level operation ("add", "sub", "mul", "div"), which gives the dominant/rare mode structure used by the
mode-collapse experiment (`demonstrations` draws SFT targets with uneven strategy weights).

Model text is parsed by a small recursive-descent parser; nothing is ever evaluated by Python.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Mapping, Sequence

# the task's public names, all importable from here
from sage_jax.rewards.countdown_data import (DEFAULT_MODE_WEIGHTS, CountdownTokenizer,  # noqa: F401
                                             completion_text, demonstrations, generate_problems, problem_key,
                                             prompt)
from sage_jax.rewards.countdown_expr import (MAX_DEPTH, MAX_EXPR_CHARS, MAX_LITERAL_DIGITS,  # noqa: F401
                                             OP_STRATEGIES, STRATEGIES, Node, parse_valued, canonical, combine, leaves,
                                             parse, render, solve, strategy)

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
    parsed = parse_valued(expr)
    if parsed is None:
        return 0.0
    node, val = parsed
    target = int(gold["target"])
    if claimed is not None and claimed != target:
        return 0.0
    if Counter(leaves(node)) != Counter(int(x) for x in gold["numbers"]):
        return 0.0
    return 1.0 if val is not None and val == target else 0.0


def strategy_shares(completions: Sequence[str], problems: Sequence[Mapping[str, Any]],
                                        scheme: str = "top") -> dict[str, float]:
    """Share of each strategy among the correct completions (completion i answers problem i)."""
    counts: Counter = Counter()
    for completion, problem in zip(completions, problems, strict=True):
        if score(completion, problem) == 1.0:
            counts[strategy(extract_expression(completion)[0], scheme)] += 1
    total = sum(counts.values())
    return {s: counts[s] / total for s in counts} if total else {}
